"""Errors of the ``training`` package.

Every error here derives from :class:`TrainingError`, the root of this package
(it imports nothing: lower packages never depend on ``node/``). Other training
modules may append classes below; keep the existing ones stable because callers
catch them by name.
"""

class TrainingError(Exception):
    """Root of the errors the training package raises on purpose."""


class TrainingConfigError(TrainingError, ValueError):
    """A model, training, DiLoCoX or compression setting is missing, malformed or out of range."""


class ModelInputError(TrainingError, ValueError):
    """A tensor handed to the model has the wrong shape, dtype or length."""


class StageSplitError(TrainingError, ValueError):
    """A model cannot be split into the requested pipeline stages."""


class StateDictError(TrainingError, ValueError):
    """A state dict is missing names, has extra names or mismatched shapes."""


class DataError(TrainingError):
    """A corpus file is missing, empty, unreadable or too short."""


class PipelineError(TrainingError):
    """A multi-process pipeline could not be formed, timed out or failed."""


class ExportError(TrainingError):
    """A checkpoint could not be exported to the Hugging Face format."""


# --- DiLoCoX engine (training/diloco.py, compression.py, hashing.py) ---


class WeightsHashError(TrainingError, ValueError):
    """Tensors cannot be hashed canonically (unsupported dtype, not a tensor, bad stage hash)."""


class ContributionDecodeError(TrainingError, ValueError):
    """An encoded contribution is malformed, oversized or does not match the stage's tensors."""


class ContributionEncodeError(TrainingError, ValueError):
    """A pseudo-gradient cannot be encoded (non-finite values, unsupported shape or dtype)."""


class RoundOrderError(TrainingError):
    """An engine call came out of round order (encode/apply skipped or repeated a round)."""


class EngineStateError(TrainingError, ValueError):
    """An engine checkpoint does not match this stage (names, shapes, config or version)."""


class AggregationError(TrainingError, ValueError):
    """A round cannot be aggregated (no contributions, or weights and momentum do not match)."""


# --- Re-execution spot checks (training/replica_state.py, training/reexec.py) ---


class ReplicaStateError(TrainingError, ValueError):
    """A replica start state is malformed, does not match the configuration, or its parts disagree."""


class ReexecError(TrainingError):
    """A contribution cannot be re-executed from the inputs given (missing round, wrong replica or stages)."""


class PlatformError(TrainingError, ValueError):
    """A device or precision cannot be used here, or a recorded fingerprint is malformed."""


# --- Byzantine tolerance (training/robust.py): which way a contribution was malformed ---


class ContributionShapeError(ContributionDecodeError):
    """A contribution's tensors (names, count or shapes) do not match the stage's."""


class ContributionNonFiniteError(ContributionDecodeError):
    """A contribution holds or decodes to non-finite values."""


class ContributionCodecRefused(ContributionDecodeError):
    """A contribution uses a codec the run forbids (``raw`` on a non-empty tensor in a compressed run)."""


# --- Tokenizers and prepared datasets (training/tokenizer.py, training/shards.py) ---


class TokenizerError(TrainingError, ValueError):
    """A tokenizer file is missing, malformed, not the one the run names, or does not fit the model."""


class ShardError(DataError):
    """A prepared dataset's manifest or shard is malformed, truncated, or not the one the manifest names."""
