"""What every configuration section shares: the validation helper, ``"auto"`` values, the encoder and
random-source enums with their defaults, and the device and precision checks (training/config.py,
training/config_compression.py)."""

from __future__ import annotations

import math
from enum import StrEnum

from training.errors import TrainingConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TrainingConfigError(message)


AUTO = "auto"


class EncoderVersion(StrEnum):
    """``compression.encoder``: which encoder picks a contribution's bytes (``training/codec/``, one module
    each).

    Every version writes the same wire format and every decoder reads them all;
    the version is part of the run configuration so that a re-executing
    verifier codes with the run's encoder (docs/DILOCOX.md section 3).
    """

    V1 = "v1"  # range-finder factorization, estimates from coding every candidate
    V2 = "v2"  # Gram-matrix factorization, estimates from the factors' rounding residuals
    V3 = "v3"  # v2's selection every 4th round; codings kept and warm power iterations between
    V4 = "v4"  # v2's selection every 4th round; bytes re-allocated from its estimates between


class QuantScale(StrEnum):
    """``compression.quant_scale``: how the encoder picks a low-bit column's scale (the decoder reads any).

    ``MAX`` is every run's before the setting (and a run document's that names none): the column's largest
    magnitude maps to ``qmax``. ``MSE``: at 4 bits or fewer, the fraction of it with the smallest squared
    error (training/codec/coding.py ``ColumnQuantizer``; docs/DILOCOX.md section 14).
    """

    MAX = "max"
    MSE = "mse"


class RandomSource(StrEnum):
    """Where a run draws what it draws at random: ``model.init`` (the initial weights,
    :meth:`training.family.ModelFamily.init_state_dict`) and ``compression.sketch`` (the codec's fixed
    Gaussian sketch, :func:`training.codec.factorize.sketch`).

    Part of the run configuration, so every replica, every re-executing verifier and every auditor draws
    the run's own.
    """

    # torch.Generator + Tensor.normal_: its float32 kernel for >= 16 elements differs by CPU instruction
    # set (AVX2 against the others), so another machine may draw other weights from the same seed.
    TORCH = "torch"
    # Philox4x32-10 + a Box-Muller of correctly rounded float64 ops (training/portable_rng.py): the same
    # bits on every machine (issue 42, docs/DILOCOX.md "A starting point every machine derives alike").
    PHILOX = "philox"


#: The random source (model.init, compression.sketch) of a run a configuration names none for (``dlx-node
#: init``, ``demo``, ``create-run``, the launcher, the benches, every ModelConfig built in code).
DEFAULT_RANDOM = RandomSource.PHILOX
#: The source of a run document that names none: runs made before ``model.init`` and ``compression.sketch``
#: existed.
LEGACY_RANDOM = RandomSource.TORCH


#: The encoder of a run a configuration names none for: what ``dlx-node init``, ``dlx-node demo``,
#: the local launcher (so the end-to-end tests) and bench/bench_diloco.py all run.
DEFAULT_ENCODER = EncoderVersion.V4
#: The encoder of a run document that names none: runs made before ``compression.encoder`` existed.
LEGACY_ENCODER = EncoderVersion.V1


def _int_or_auto(value: int | str, where: str) -> int | str:
    """``value`` as an int, or ``"auto"``; TOML gives ints, ``--set`` gives strings."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        try:
            return int(text, 0)
        except ValueError:
            raise TrainingConfigError(f"{where}={value!r}: must be an integer or \"auto\"") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TrainingConfigError(f"{where}={value!r}: must be an integer or \"auto\"")
    return value


def _float_or_auto(value: float | str, where: str) -> float | str:
    """``value`` as a finite float, or ``"auto"``; TOML gives numbers, ``--set`` gives strings."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        try:
            value = float(text)
        except ValueError:
            raise TrainingConfigError(f"{where}={value!r}: must be a number or \"auto\"") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TrainingConfigError(f"{where}={value!r}: must be a finite number or \"auto\"")
    return float(value)


PRECISIONS = ("fp32", "bf16")


def check_device_spec(spec: str, where: str = "training.device") -> str:
    """``spec`` normalised (``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``), else a config error.

    Only the syntax: whether this machine has the device is ``training.platform.resolve_device``'s question.
    """
    if not isinstance(spec, str):
        raise TrainingConfigError(f"{where}={spec!r}: must be a string")
    text = spec.strip().lower()
    if text in (AUTO, "cpu", "cuda"):
        return text
    kind, _, index = text.partition(":")
    if kind == "cuda" and index.isdigit() and len(index) <= 3:
        return f"cuda:{int(index)}"
    raise TrainingConfigError(f'{where}={spec!r}: must be "auto", "cpu", "cuda" or "cuda:N" (N a GPU index)')


def check_precision(precision: str, where: str = "training.precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a config error."""
    _require(precision in PRECISIONS, f"{where}={precision!r}: must be one of {list(PRECISIONS)} "
                                      "(bf16: bfloat16 autocast, float32 master weights and optimizer state)")
    return precision


#: diloco.delay_correction's values (training/delay_correction.py).
DELAY_CORRECTIONS = ("rebase", "lookahead", "eager", "reset")
#: The outer optimizer (training/diloco.py outer_step; docs/DILOCOX.md section 14, "Outer Adam"): "nesterov",
#: SGD with (Nesterov) momentum (DiLoCo's; the contract's fraud proof recomputes it), "adam", FedAdam's
#: elementwise Adam without bias correction (Reddi et al., arXiv 2003.00295, Algorithm 2), whose state is two
#: moments per weight.
OUTER_OPTIMIZERS = ("nesterov", "adam")
#: Tensors of outer state per weight, by outer optimizer: the Nesterov momentum, or outer Adam's two moments
#: (stacked on a leading axis).
OUTER_STATE_TENSORS = {"nesterov": 1, "adam": 2}
#: Settings only outer Adam has, at the values a Nesterov run holds (and its run document omits).
OUTER_ADAM_ONLY = {"outer_adam_beta1": 0.9, "outer_adam_beta2": 0.99, "outer_adam_eps": 1e-8}
#: Settings only the Nesterov step reads, at their defaults: an outer-Adam run must leave them there (it would
#: otherwise look tuned by a setting it ignores).
OUTER_NESTEROV_ONLY = {"outer_momentum": 0.5, "nesterov": True, "outer_final_momentum": "auto"}
OUTER_DECAYS = ("constant", "linear", "cosine")
EXCHANGES = ("full", "sliced")
#: Screening's rule (docs/DILOCOX.md sections 10 and 13, "Screening"): "one_sided", version 1, the loss of
#: each contribution applied alone against the median's; "two_sided", version 2 (time-bounded runs), also
#: applied against itself: a contribution must descend (its slope), and its length cost no more than four
#: times the median one's (its curvature); "paired", version 3 (time-bounded runs), version 2 with the slope
#: judged per window of the screening batch: a contribution's slope may fall short of the least slope by two
#: standard errors of its measurement (docs/DILOCOX.md section 13, "Version 3").
SCREEN_RULES = ("one_sided", "two_sided", "paired")
#: What a record's checkpointHash commits (docs/PROTOCOL.md, "Archive and retention"): "file", the sha256 of
#: the whole checkpoint file (every run made before "header" existed); "header", a chunked run's, the hash of
#: the file's header alone (node/store/checkpoint_hash.py).
CHECKPOINT_HASHES = ("file", "header")
#: diloco.exchange = "auto" (the node template's): the sliced exchange from this many replicas, the full one
#: below. Where the sliced exchange wins: docs/PROTOCOL.md, "Sliced exchange", "Which exchange by default".
SLICED_FROM_REPLICAS = 8
#: diloco.min_slice_numel: its default (the live plan of session 7) and its bound.
DEFAULT_MIN_SLICE_NUMEL = 1024
MAX_MIN_SLICE_NUMEL = 1 << 30
#: The most parts a contribution is cut into (diloco.exchange_parts; p2p.parts.MAX_PARTS is the wire's bound).
MAX_EXCHANGE_PARTS = 1024


#: The most contributions of a stage a round of a fraud-provable run lists (issue 62): create-run's
#: ``RunParams.maxContributions`` (ledger.runparams.DEFAULT_MAX_CONTRIBUTIONS, the most the proof's cost bound
#: allows at the decoder's largest rank; tests/test_run_values.py ties the two).
MAX_LISTED = 6
#: The commitment schemes whose rounds list their accepted contributions (node/commitments/registry.py adds
#: every chunked scheme it registers): a run of one caps its accepted set at MAX_LISTED; the rest, the hashed
#: scheme's among them, list nothing.
LISTING_SCHEMES: set[str] = set()
