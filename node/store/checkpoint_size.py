"""A checkpoint's size from its stages' shapes, and the size from which a chunked run's checkpoints are kept
split and header-hashed by default (issue 75; node/store/checkpoint_split.py, node/store/checkpoint_hash.py).

Pure arithmetic, no import of the checkpoint code: the run document's ``diloco.checkpoint_hash = "auto"`` is
resolved with it (node/runconfig.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

#: ``storage.checkpoints = "auto"`` keeps a chunked run's checkpoint split from this size of the whole file
#: on (weights and outer momentum, float32), and ``diloco.checkpoint_hash = "auto"`` hashes its header from
#: there: below it every node keeping the whole file costs little and lets any one node serve it; above it
#: (llama-124m's is 1.0 GB, the 107B layout's 856 GB) the whole file on every node is S times the node's stage
#: on disk, and hashing it S times the node's stage downloaded a checkpoint round.
SPLIT_ABOVE_BYTES = 512 << 20


def tensor_bytes(stage_shapes: Iterable[Mapping[str, tuple[int, ...]]], outer_moments: int) -> int:
    """The tensor bytes of a checkpoint of stages of ``stage_shapes``: weights and outer state, float32."""
    params = sum(math.prod(shape) for shapes in stage_shapes for shape in shapes.values())
    return 4 * params * (1 + outer_moments)
