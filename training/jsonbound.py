"""JSON from others, refused when nested too deeply, before it is decoded.

``json.loads`` recurses in C once per nesting level and stops at the interpreter's recursion limit; a process
that imported ``py_ecc`` (web3's signing does) runs with a limit of 100,000, and the decoder overflows the
thread's stack well below it: a peer's ``b"[" * 80_000`` ended the process with a segmentation fault (not a
RecursionError a caller could catch). :func:`loads_bounded` measures the depth first, in C-speed passes.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)  # a JSON string: its brackets are not nesting
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_A_BRACKET = {c: None for c in range(128) if c not in _STEP}


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in the JSON ``text`` (0 for a scalar; not validated)."""
    brackets = _STRING.sub("", text).translate(_NOT_A_BRACKET).encode("ascii", "ignore")
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def loads_bounded(data: bytes | str, max_depth: int) -> Any:
    """``json.loads(data)``, refused with a ValueError when ``data`` nests arrays and objects deeper than
    ``max_depth`` (a list of lists is 2) or is not UTF-8."""
    text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
    depth = nesting_depth(text)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} deep, over {max_depth}")
    return json.loads(text)
