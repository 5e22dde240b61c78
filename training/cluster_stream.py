"""A model whose weights stay on a cluster's ranks: a block's parameters made real only while it runs
(issue 75).

:class:`BlockStreamer` takes a transformer module built on the meta device (no storage) and makes each block's
parameters real just before the block runs (a forward pre-hook: ``fetch(names)`` returns them, from the
ranks that hold them) and drops them after (a forward hook: back to meta); the parameters outside the blocks
(embeddings, final norm, head) are made real for a whole forward (:meth:`BlockStreamer.top`). The forward is
the module's own (the same operations in the same order on the same values), so its results are the bits of
the same module holding the same weights whole; the process holds one block's weights at a time beside the
embeddings and head. Used by the screening (training/cluster_screen.py, float64) and the held-out eval
(training/cluster_eval.py, float32) of a node that is a cluster.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

Fetch = Callable[[Sequence[str]], Mapping[str, torch.Tensor]]


class BlockStreamer:
    """``model``'s blocks streamed (module docstring); ``dtype``: what the fetched tensors are made."""

    def __init__(self, model: nn.Module, fetch: Fetch, dtype: torch.dtype) -> None:
        self.model, self.fetch, self.dtype = model, fetch, dtype
        blocks = list(model.trunk[model.family.blocks].values())
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        self.top_names = [name for name, p in model.named_parameters() if id(p) not in in_blocks]
        self._where = {}
        for name, _ in model.named_parameters():
            module_name, _, attribute = name.rpartition(".")
            self._where[name] = (model.get_submodule(module_name), attribute)
        prefix = {id(m): name for name, m in model.named_modules()}
        for block in blocks:
            names = [f"{prefix[id(block)]}.{name}" for name, _ in block.named_parameters()]
            block.register_forward_pre_hook(lambda _m, _args, names=names: self.load(names))
            block.register_forward_hook(lambda _m, _args, _out, names=names: self.drop(names))

    def load(self, names: Sequence[str]) -> None:
        """The parameters ``names`` made real from ``fetch``."""
        for name, tensor in self.fetch(names).items():
            module, attribute = self._where[name]
            module.register_parameter(attribute, nn.Parameter(tensor.to(self.dtype), requires_grad=False))

    def drop(self, names: Sequence[str]) -> None:
        """The parameters ``names`` back on the meta device (their storage freed)."""
        for name in names:
            module, attribute = self._where[name]
            shape = getattr(module, attribute).shape
            module.register_parameter(attribute, nn.Parameter(
                torch.empty(shape, dtype=self.dtype, device="meta"), requires_grad=False))

    @contextlib.contextmanager
    def top(self):
        """The parameters outside the blocks real for the forwards run inside."""
        self.load(self.top_names)
        try:
            yield
        finally:
            self.drop(self.top_names)
