"""Float32 tensors kept in a file instead of RAM until they are read once (issue 75: RAM per node).

A round's start state is captured in two parts (training/replica_capture.py): what the inner steps change
(the weights and the inner optimizer's two moments, three times the stage's weights) is copied before the
first inner step, and the engine's part is added when the state is written, after the previous round's
encode. Held as tensors, the copies stayed in RAM for most of a round, and two rounds' copies at once where
a round's start state waited for the previous encode: up to six times a stage's weights, 1.5 GB for a stage
of llama-124m.

:func:`spill_float32` writes them to a file instead, one tensor at a time (for CPU float32 tensors without
any copy: the array's own bytes), and :class:`SpilledTensors` reads each back only when it is asked for (one
``pread`` into a fresh buffer), so the start state's writer holds one tensor at a time. The file is
unlinked as soon as it is open: its blocks live as long as the open descriptor (the mapping's owner), and
nothing is left on disk by a crash. The values are the same bits (float32, the host's byte order).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from training.host_tensors import host_float32


class SpillFileError(OSError):
    """A spilled file that is not what was written to it (another length): its tensors are never used."""


class _OpenFile:
    """An open descriptor, closed when the last holder lets it go (a read in flight on another thread holds
    it while :meth:`SpilledTensors.read_from` moves the mapping to another file)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class SpilledTensors(Mapping):
    """name -> float32 CPU tensor, each read from the (unlinked) file when asked for; read-only."""

    def __init__(self, fd: int, index: dict[str, tuple[int, tuple[int, ...]]],
                 length: int | None = None) -> None:
        # The file's length as written: one of any other length (cut short, grown) is refused when read.
        if length is None:
            length = max((offset + 4 * math.prod(shape) for offset, shape in index.values()), default=0)
        self._source = (_OpenFile(fd), dict(index), length)

    def check_length(self) -> None:
        """Raise :class:`SpillFileError` unless the file is as long as what was written to it."""
        self._checked(self._source)

    @staticmethod
    def _checked(source: tuple[_OpenFile, dict, int]) -> None:
        file, _index, expected = source
        length = os.fstat(file.fd).st_size
        if length != expected:
            raise SpillFileError(f"a spilled state file holds {length} bytes, not the {expected} written "
                                 "to it (cut short or changed since): refused, not read")

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self._source  # one file for the whole read, whatever read_from does meanwhile
        file, index, _length = source
        offset, shape = index[name]
        size = 4 * math.prod(shape)
        self._checked(source)
        buffer = bytearray(size)
        view, done = memoryview(buffer), 0
        while done < size:
            read = os.preadv(file.fd, [view[done:]], offset + done)
            if read <= 0:
                raise SpillFileError(f"spilled tensor {name!r}: the file ended at byte {offset + done}")
            done += read
        return torch.frombuffer(buffer, dtype=torch.float32).view(shape) if size else \
            torch.zeros(shape, dtype=torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self._source[1])

    def __len__(self) -> int:
        return len(self._source[1])

    def shape_of(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without reading it."""
        return self._source[1][name][1]

    def fileno(self) -> int:
        """The file's descriptor (open while this is)."""
        return self._source[0].fd

    @property
    def nbytes(self) -> int:
        return sum(4 * math.prod(shape) for _, shape in self._source[1].values())

    def renamed(self, prefix: str) -> SpilledTensors:
        """The same tensors named ``prefix + name``, read from the same file when asked for (its own
        descriptor: either may be closed first)."""
        file, index, length = self._source
        return SpilledTensors(os.dup(file.fd), {prefix + name: where for name, where in index.items()},
                              length)

    def read_from(self, fd: int, offsets: Mapping[str, int]) -> None:
        """Read the same tensors from now on from the file ``fd`` (taken over: closed with this), where each
        one's float32 data starts at ``offsets[name]``: a file that holds the same bytes (the caller's word:
        a checkpoint written from this mapping, issue 75), so that this file's blocks can go. The file's
        length now is the one every later read checks. A read in flight finishes on the old file.
        ValueError (``fd`` closed) if ``offsets`` does not name exactly these tensors or one's data would
        pass the file's end."""
        try:
            _file, index, _length = self._source
            length = os.fstat(fd).st_size
            if set(offsets) != set(index):
                raise ValueError("the new file does not hold exactly these tensors")
            moved = {name: (int(offsets[name]), shape) for name, (_offset, shape) in index.items()}
            if any(at < 0 or at + 4 * math.prod(shape) > length for at, shape in moved.values()):
                raise ValueError("a tensor's data would pass the new file's end")
        except BaseException:
            os.close(fd)
            raise
        self._source = (_OpenFile(fd), moved, length)

    def close(self) -> None:
        """Let the file's blocks go (also done when this is garbage collected)."""
        self._source[0].close()


def spill_float32(tensors: Mapping[str, torch.Tensor], directory: Path) -> SpilledTensors:
    """float32 CPU copies of ``tensors``, kept in a file under ``directory`` (see the module docstring).

    Raises OSError (a full disk, say) with nothing left behind; the caller then keeps copies in RAM.
    """
    writer = SpillWriter(directory)
    try:
        for name, value in tensors.items():
            writer.add(name, value)
    except BaseException:
        writer.abandon()
        raise
    return writer.done()


class SpillWriter:
    """:func:`spill_float32` one tensor at a time, as each arrives (a cluster's tensors gathered from its
    ranks one by one: training/cluster_replica.py), so the caller holds none of them whole at once.
    :meth:`done` gives the :class:`SpilledTensors`; :meth:`abandon` lets the file go (an error)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        try:  # a file without a name (Linux): nothing to remove, whatever happens
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
        except (AttributeError, OSError):  # no O_TMPFILE here, or not on this file system: unlinked at once
            path = directory / f"spill-{os.getpid()}-{id(self):x}.f32"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            path.unlink()
        self._fd = fd
        try:
            self._out = os.fdopen(os.dup(fd), "wb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        self._index: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._offset = 0

    def add(self, name: str, value: torch.Tensor) -> None:
        host = host_float32(value).contiguous()  # no copy for a CPU float32 tensor
        self._index[name] = (self._offset, tuple(host.shape))
        if host.numel():
            data = memoryview(host.numpy()).cast("B")
            written = 0
            while written < len(data):
                written += self._out.write(data[written:])
        self._offset += 4 * host.numel()

    def done(self) -> SpilledTensors:
        self._out.close()
        return SpilledTensors(self._fd, self._index)

    def abandon(self) -> None:
        self._out.close()
        os.close(self._fd)


class MergedTensors(Mapping):
    """Two mappings of tensors with disjoint names seen as one (a start state's trainer and engine parts),
    without building a third: a spilled part stays in its file until each tensor is read."""

    def __init__(self, first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor]) -> None:
        both = set(first) & set(second)
        if both:
            raise ValueError(f"tensors named twice: {sorted(both)[:3]}")
        self._first, self._second = first, second

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._first[name] if name in self._first else self._second[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        yield from self._second

    def __len__(self) -> int:
        return len(self._first) + len(self._second)


class ChainedTensors(Mapping):
    """Mappings of tensors with disjoint names seen as one (a checkpoint's stages, each perhaps spilled),
    without building another: each tensor is read from its part when asked for."""

    def __init__(self, parts: list[Mapping[str, torch.Tensor]]) -> None:
        self._parts = list(parts)
        self._where: dict[str, int] = {}
        for index, part in enumerate(self._parts):
            for name in part:
                if self._where.setdefault(name, index) != index:
                    raise ValueError(f"tensor {name!r} named twice")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._parts[self._where[name]][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    @property
    def parts(self) -> list[Mapping[str, torch.Tensor]]:
        return list(self._parts)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, read from its part only where the part cannot say it otherwise."""
        part = self._parts[self._where[name]]
        known = getattr(part, "shape_of", None)
        return tuple(known(name)) if known is not None else tuple(part[name].shape)


class ZeroTensors(Mapping):
    """name -> a fresh float32 zero tensor of its shape, made when asked for: a state that is all zeros (the
    error-feedback residual of a run without feedback) held as its shapes only (issue 75: 4 bytes per
    parameter)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._shapes = {name: tuple(shape) for name, shape in shapes.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.zeros(self._shapes[name], dtype=torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def renamed(self, prefix: str) -> ZeroTensors:
        """The same zeros named ``prefix + name``."""
        return ZeroTensors({prefix + name: shape for name, shape in self._shapes.items()})


def unheld(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``tensors`` are not held in RAM (a :class:`SpilledTensors` file or :class:`ZeroTensors`): each
    read is a fresh tensor, so a caller reads each once and keeps the mapping as it is rather than copy it."""
    return isinstance(tensors, (SpilledTensors, ZeroTensors))


def shapes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """name -> shape of ``tensors``, without reading an unheld mapping's tensors."""
    known = getattr(tensors, "shape_of", None)
    if known is not None:
        return {name: tuple(known(name)) for name in tensors}
    return {name: tuple(value.shape) for name, value in tensors.items()}
