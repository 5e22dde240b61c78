"""The encoder kinds by version: ``compression.encoder`` -> an :class:`~training.codec.base.Encoder`."""

from __future__ import annotations

from training.codec.base import Encoder
from training.codec.v1 import V1Encoder
from training.codec.v2 import V2Encoder
from training.codec.v3 import V3Encoder
from training.codec.v4 import V4Encoder
from training.config import EncoderVersion

#: Every encoder a run can name, by version. A run document names its encoder, so a version stays
from training.config_compression import CompressionConfig

#: Every encoder a run can name, by version. A run document names its encoder, so a version stays
#: here as long as a run that names it may still be joined, re-executed or audited.
ENCODERS: dict[EncoderVersion, type[Encoder]] = {
    kind.version: kind for kind in (V1Encoder, V2Encoder, V3Encoder, V4Encoder)
}


def encoder_for(cfg: CompressionConfig) -> Encoder:
    """The encoder ``cfg.encoder`` names, under ``cfg``."""
    return ENCODERS[EncoderVersion(cfg.encoder)](cfg)
