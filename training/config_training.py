"""The [training] section: local (inner) training of one replica (re-exported by :mod:`training.config`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from training.config_base import _require, check_device_spec, check_precision

#: training.optimizer's values (training/muon.py).
INNER_OPTIMIZERS = ("adamw", "muon")
#: The inner optimizer of a configuration that names none, and of a run document that names none (made before
#: the setting, or an AdamW run). AdamW: Muon won at llama-xs and llama-s but lost at the demo's GPT-2 `mini`
#: (docs/DILOCOX.md section 14), so it does not win at every size measured, the condition for a new default.
DEFAULT_OPTIMIZER, LEGACY_OPTIMIZER = "adamw", "adamw"
#: The reproducible mode's kernel version (training/exact_kernel.py) of a configuration that turns the mode on
#: and names none (3: version 2's compiled fixed-order products, several times faster than 1, with correctly
#: rounded square roots, so the same bits on every CPU build and a GPU: docs/REPRODUCIBLE.md), and of
#: a run document that names none (1: the runs made before versions existed keep their bits and hashes).
#: ``AUTO_KERNELS`` (the field's default) is resolved to one of them by ``TrainingConfig.__post_init__``.
DEFAULT_KERNELS, LEGACY_KERNELS, AUTO_KERNELS = 3, 1, 0
#: training.data_windows's values (training/data.py "Round batches"): whose key draws a round's windows.
DATA_WINDOWS = ("replica", "account")
#: training.inner_state's values: "carry" keeps the inner optimizer's state (AdamW's moments and step count,
#: Muon's momentum) from one outer round to the next (every run made before the setting); "fresh" starts each
#: round's inner steps from a new inner optimizer (issue 78, docs/FRAUD_PROOF.md "The claim's end").
INNER_STATES = ("carry", "fresh")


@dataclass
class TrainingConfig:
    """Local (inner) training of one replica."""

    data_path: str = ""  # empty: a small corpus the project generates itself
    seed: int = 0
    batch_size: int = 8
    inner_lr: float = 3e-3
    weight_decay: float = 0.1  # on matrices only (nanoGPT; bench/results/diloco_ablations.json)
    beta1: float = 0.9
    beta2: float = 0.99  # 0.95 -> 0.99: held-out 2.023 -> 1.767 at 1.536 M tokens (docs/DILOCOX.md section 9)
    grad_clip: float = 1.0
    # Inner learning-rate schedule across the whole run (training/schedule.py): linear warmup,
    # then cosine decay to inner_lr * min_lr_ratio over lr_decay_steps inner steps (0: the
    # run's total, rounds * H, when the caller knows it). "constant" keeps inner_lr.
    lr_schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    lr_decay_steps: int = 0
    eval_fraction: float = 0.1  # tail of the corpus held out for evaluation
    eval_batches: int = 4
    # Where and in which precision this node's inner steps run (training/platform.py, docs/GPU.md):
    # node settings, not run settings (NODE_ONLY_TRAINING: not in the run document, so members of
    # one run may train on different hardware). "auto": the first CUDA GPU if there is one, else
    # the CPU. "bf16": bfloat16 autocast, float32 master weights and AdamW state.
    device: str = "auto"
    precision: str = "fp32"
    # Run the inner steps through torch.compile (training/compiled.py; a node setting too). Off by default: a
    # compiled replica is another platform (its bits are not eager's), judged bit-exactly only by verifiers
    # that compile with the same compiler, and the first step waits for the compilation (docs/DILOCOX.md
    # section 11, "Compiled inner steps").
    compile: bool = False
    # The inner optimizer (training/muon.py, docs/DILOCOX.md section 14): "adamw", or "muon" (MuLoCo, arXiv
    # 2505.23725: Muon's orthogonalized Nesterov momentum for the hidden weight matrices, AdamW for
    # embeddings, head, norms and biases). The muon_* settings are Muon's: its momentum and a factor on the
    # inner lr for the Muon part (whose update is scaled to AdamW's RMS, so 1.0 uses the same lr). A
    # configuration that names none gets DEFAULT_OPTIMIZER; a run document that names none, LEGACY_OPTIMIZER
    # (node.runconfig.node_config_from_run): with "adamw" none of them is in the run document, which is then
    # what it was before the setting existed.
    optimizer: str = DEFAULT_OPTIMIZER
    muon_momentum: float = 0.95
    muon_lr_scale: float = 1.0
    # Fixed-order kernels (training/exact_mode.py, docs/REPRODUCIBLE.md): the forward and backward passes, the
    # clipping norm and the inner optimizer computed with single IEEE operations in an order that depends on
    # the shapes only, so the inner steps give the same bits on every CPU instruction set, thread count and
    # math library, and a rerun anywhere is judged bit for bit. A run setting (in the run document when on;
    # off, the document and its hash are what they were before the setting). Slower: off by default.
    reproducible: bool = False
    # The version of the reproducible mode's kernels (training/exact_kernel.py): 1, Ozaki-split products
    # through float64 BLAS (a run document that names none: the runs made before the setting keep their
    # bits); 2, a compiled fixed-order float32 product, several times faster (docs/REPRODUCIBLE.md, "Kernel
    # versions"); 3, version 2 with correctly rounded square roots (version 2's are torch's, whose CPU bits
    # depend on its build). A setting of training.reproducible = true only; in the run document when not 1.
    # A configuration that names none (AUTO_KERNELS) gets DEFAULT_KERNELS with the mode on (so a new run
    # records 3), 1 without it; a run document that names none, LEGACY_KERNELS (node.runconfig).
    reproducible_kernels: int = AUTO_KERNELS
    # Whose key draws the windows of a round's batches (training/data.py, "Round batches"): "replica", the
    # replica index (a seat count the chain does not know); "account", the 20-byte member account of the
    # replica's first-stage member, the signer of its stage-0 contribution (the key the chain's data dispute
    # recomputes the windows from: training/data_binding.py, docs/FRAUD_PROOF.md "The data's binding"). A run
    # setting, in the run document only when "account" (a "replica" run's document and hash are unchanged).
    data_windows: str = "replica"
    # The inner optimizer's state across outer rounds (INNER_STATES; training/inner_optimizers.py
    # begin_round): "carry" (the default, every run made before the setting) keeps AdamW's moments and step
    # count (Muon's momentum) from round to round; "fresh" clears them at each round's start, before its
    # start state is captured, so a round's program is its H steps from the round's start weights alone
    # (the inner lr still follows the run's schedule over the global step t*H + k; AdamW's bias correction
    # restarts at step 1 each round). What the plain end rule needs (docs/FRAUD_PROOF.md "The claim's end").
    # In the run document only when "fresh" (every older hash unchanged).
    inner_state: str = "carry"

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, f"training.batch_size={self.batch_size}: must be >= 1")
        _require(self.inner_lr > 0, f"training.inner_lr={self.inner_lr}: must be > 0")
        _require(self.weight_decay >= 0, f"training.weight_decay={self.weight_decay}: must be >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "training.beta1/beta2: must be in [0, 1)")
        _require(self.grad_clip >= 0, f"training.grad_clip={self.grad_clip}: must be >= 0 (0 = off)")
        _require(
            self.lr_schedule in ("cosine", "constant"),
            f"training.lr_schedule={self.lr_schedule!r}: must be 'cosine' or 'constant'",
        )
        _require(self.warmup_steps >= 0, f"training.warmup_steps={self.warmup_steps}: must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, f"training.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        _require(
            self.lr_decay_steps >= 0,
            f"training.lr_decay_steps={self.lr_decay_steps}: must be >= 0 (0 = run length)",
        )
        _require(
            0.0 < self.eval_fraction < 0.5,
            f"training.eval_fraction={self.eval_fraction}: must be in (0, 0.5)",
        )
        _require(self.eval_batches >= 1, f"training.eval_batches={self.eval_batches}: must be >= 1")
        self.device = check_device_spec(self.device)
        check_precision(self.precision)
        _require(isinstance(self.compile, bool), f"training.compile={self.compile!r}: must be true or false")
        _require(self.optimizer in INNER_OPTIMIZERS,
                 f"training.optimizer={self.optimizer!r}: must be one of {list(INNER_OPTIMIZERS)}")
        _require(
            0 <= self.muon_momentum < 1, f"training.muon_momentum={self.muon_momentum}: must be in [0, 1)"
        )
        _require(0 < self.muon_lr_scale < float("inf"),
                 f"training.muon_lr_scale={self.muon_lr_scale}: must be a finite factor > 0")
        _require(isinstance(self.reproducible, bool),
                 f"training.reproducible={self.reproducible!r}: must be true or false")
        _require(not self.reproducible or (self.precision == "fp32" and not self.compile),
                 f"training.reproducible = true computes float32 eagerly: set training.precision = \"fp32\" "
                 f"(not {self.precision!r}) and training.compile = false")
        _require(self.inner_state in INNER_STATES,
                 f"training.inner_state={self.inner_state!r}: must be one of {list(INNER_STATES)} "
                 "(\"fresh\": a new inner optimizer every outer round)")
        if type(self.reproducible_kernels) is int and self.reproducible_kernels == AUTO_KERNELS:
            self.reproducible_kernels = DEFAULT_KERNELS if self.reproducible is True else LEGACY_KERNELS
        _require(type(self.reproducible_kernels) is int and self.reproducible_kernels in (1, 2, 3),
                 f"training.reproducible_kernels={self.reproducible_kernels!r}: must be 1, 2 or 3")
        _require(self.reproducible or self.reproducible_kernels == 1,
                 f"training.reproducible_kernels={self.reproducible_kernels} is a setting of "
                 "training.reproducible = true: remove it or turn the mode on")
        _require(self.data_windows in DATA_WINDOWS,
                 f"training.data_windows={self.data_windows!r}: must be one of {list(DATA_WINDOWS)}")
        if self.optimizer != "muon":
            for name, neutral in MUON_ONLY.items():
                _require(
                    getattr(self, name) == neutral,
                    f"training.{name}={getattr(self, name)} is a setting of "
                    'training.optimizer = "muon": remove it or set the optimizer',
                )

    @property
    def codec_kernels(self) -> int:
        """The codec's fixed-order mode (training.exact_codec): 0 without the reproducible mode, else the
        run's kernel version (from version 3 the codec takes the correctly rounded square root)."""
        return self.reproducible_kernels if self.reproducible else 0

    def document(self) -> dict:
        """The settings every replica of a run shares (the run document's [training] table): all but
        :data:`NODE_ONLY_TRAINING`, and the optimizer's only when it is not AdamW (an AdamW run's table is
        what it was before ``training.optimizer`` existed, so its hash is unchanged)."""
        out = dataclasses.asdict(self)
        for name in NODE_ONLY_TRAINING:
            del out[name]
        if self.optimizer == "adamw":
            for name in ("optimizer", *MUON_ONLY):
                del out[name]
        if not self.reproducible:  # a run without the mode keeps the document (and hash) it had before it
            del out["reproducible"]
        if self.reproducible_kernels == 1:  # and a run of version 1 the one it had before versions
            del out["reproducible_kernels"]
        if self.data_windows == "replica":  # and a run drawn by replica index the one it had before it
            del out["data_windows"]
        if self.inner_state == "carry":  # and a run that carries its inner state the one it had before
            del out["inner_state"]
        return out

    @property
    def fresh_inner_state(self) -> bool:
        """Whether each outer round's inner steps start from a new inner optimizer (``inner_state``)."""
        return self.inner_state == "fresh"


def weaknesses(cfg: TrainingConfig) -> list[str]:
    """What a new run with these training settings gives up (``create-run`` refuses it without --weak-run).
    Kernel versions 1 and 2 take torch's CPU square root, whose bits are the math library's code path's
    (docs/REPRODUCIBLE.md, "Versions 1 and 2 depend on the CPU's math library"): an honest contribution
    rerun on another CPU can differ, so a spot check or an audit there finds a mismatch that is none."""
    if cfg.reproducible and cfg.reproducible_kernels < 3:
        return [f"training.reproducible_kernels={cfg.reproducible_kernels}: its square roots are the CPU's "
                "math library's, so a rerun on another CPU (Intel against AMD, or another MKL path) can "
                "differ from an honest contribution (safe: 3, the default)"]
    return []


#: Settings only Muon has, at the values an AdamW run holds (and its run document omits).
MUON_ONLY = {"muon_momentum": 0.95, "muon_lr_scale": 1.0}


#: [training] settings each node chooses for itself; the run document (and its hash) leaves them out.
NODE_ONLY_TRAINING = ("device", "precision", "compile")
