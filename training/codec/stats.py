"""What the encoder reports about one contribution: per tensor and per round."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TensorCodecStats:
    """How one tensor was coded in one round."""

    name: str
    shape: tuple[int, ...]
    codec: str  # "raw" | "quant" | "lowrank"
    rank: int  # 0 unless lowrank
    bits: int  # 32 for raw
    raw_bytes: int
    payload_bytes: int  # packed integers + scales, without msgpack framing
    rel_error: float  # ||X - decoded||_F / ||X||_F (0 for a zero tensor)
    met_budget: bool


@dataclass
class CompressionStats:
    """Per-round codec report of one contribution."""

    outer_round: int
    stage_index: int
    raw_bytes: int = 0  # float32 size of the pseudo-gradient
    encoded_bytes: int = 0  # len() of the msgpack contribution
    encode_seconds: float = 0.0
    tensors: list[TensorCodecStats] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """raw_bytes / encoded_bytes."""
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else float("inf")

    @property
    def max_rel_error(self) -> float:
        return max((t.rel_error for t in self.tensors), default=0.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ratio"] = self.ratio
        out["max_rel_error"] = self.max_rel_error
        return out
