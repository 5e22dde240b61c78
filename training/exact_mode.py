"""The reproducible mode's dispatch: torch's operators replaced by fixed-order ones while a model runs.

:class:`ExactKernels` is a ``TorchFunctionMode``: inside ``with ExactKernels():`` every torch function the
model calls is looked up by name in :data:`HANDLERS` (matrix products, norms, attention, softmax,
cross-entropy, embeddings, the elementary functions, reductions, and the broadcasting of elementwise
operations: :mod:`training.exact_ops`) or in :data:`NEUTRAL` (views, copies, casts, comparisons, index
arithmetic and the single elementwise IEEE operations on tensors of one shape, whose results and autograd
backward passes are the same bits everywhere). Anything else raises :class:`ExactKernelError` naming it, so
an operator the mode does not cover is an error, never a silent platform-dependent result. The model's code
(training/gpt2.py, training/llama.py) is the same in both modes; the trainer enters the mode around the
forward pass (:meth:`training.platform.Platform.autocast`), and the backward pass runs the explicit backward
passes the forward recorded.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from training import exact_fused as fused
from training import exact_kernel
from training import exact_ops as ops
from training.exact_ops import ExactKernelError

_BINARY = {"add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "rsub", "mul", "__mul__", "__rmul__",
           "multiply", "div", "__truediv__", "__rtruediv__", "__div__", "__rdiv__", "true_divide", "divide",
           "where", "maximum", "minimum"}
_INPLACE = {"add_", "__iadd__", "sub_", "__isub__", "mul_", "__imul__", "div_", "__itruediv__"}

#: Operators that need no substitute: no arithmetic, or one IEEE operation per element of one shape (the
#: broadcasting of those in :data:`_BINARY` is made explicit first), or integer and boolean arithmetic.
NEUTRAL = frozenset({
    "__get__", "__set__", "__len__", "__int__", "__float__", "__bool__", "__index__", "__format__",
    "__repr__", "__contains__", "__hash__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__and__", "__or__", "__invert__", "__neg__", "neg", "abs", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "isfinite", "isnan", "all", "any", "item", "tolist", "numel",
    "size", "dim", "stride", "element_size", "is_floating_point", "is_contiguous", "data_ptr", "numpy",
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "contiguous", "split", "chunk",
    "tensor_split", "unbind", "narrow", "select", "squeeze", "unsqueeze", "flatten", "unflatten", "t",
    "cat", "concat", "concatenate", "stack", "clone", "detach", "detach_", "requires_grad_", "to", "float",
    "double", "long", "int", "bool", "type", "type_as", "cpu", "cuda", "copy_", "arange", "zeros", "ones",
    "empty", "full", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
    "new_empty", "new_full", "new_tensor", "tensor", "as_tensor", "tril", "triu", "clamp", "clip",
    "amax", "amin", "aminmax", "argmax", "argmin", "one_hot", "_assert_async", "is_compiling",
    "floor", "ceil", "round", "sign", "backward", "register_hook", "retain_grad",
    "_has_compatible_shallow_copy_type", "__setstate__", "__reduce_ex__", "__deepcopy__", "share_memory_",
    "is_shared", "untyped_storage", "storage",
    "_is_view", "get_device", "is_complex", "is_inference", "dtype", "device", "shape",
})


#: Divisions whose second operand divides the first (a number there is :func:`exact_kernel.as_divisor`'s).
_DIVISIONS = {"div", "__truediv__", "__div__", "true_divide", "divide", "div_", "__itruediv__"}


def _number_divisor(func, args):
    """``args`` with a Python number dividing a tensor off the CPU made a 0-dim tensor there (CUDA multiplies
    by a number's reciprocal: :func:`training.exact_kernel.as_divisor`)."""
    if func.__name__ in _DIVISIONS and len(args) > 1 and isinstance(args[0], torch.Tensor) \
            and isinstance(args[1], (int, float)) and not isinstance(args[1], bool) \
            and args[0].is_floating_point():
        return (args[0], exact_kernel.as_divisor(args[0], args[1]), *args[2:])
    return args


def _sqrt(func, args, kwargs):
    """torch's ``sqrt`` before kernel version 3; from it the correctly rounded root
    (:func:`training.exact_kernel.sqrt`), which has no derivative here."""
    x = args[0]
    if exact_kernel.CURRENT.get() < 3 or len(args) > 1 or kwargs:
        return func(*args, **kwargs)
    if x.requires_grad and torch.is_grad_enabled():
        raise ExactKernelError("sqrt of a tensor that needs a gradient (kernel version 3): use rsqrt")
    return exact_kernel.sqrt(x)


def _broadcast_binary(func, args, kwargs):
    if kwargs.get("alpha", 1) != 1:
        raise ExactKernelError(f"{func.__name__} with alpha (a fused multiply-add): no fixed-order kernel")
    args = _number_divisor(func, args)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len({t.shape for t in tensors}) > 1:
        expanded = iter(ops.broadcast(*tensors))
        args = tuple(next(expanded) if isinstance(a, torch.Tensor) else a for a in args)
    return func(*args, **kwargs)


def _inplace_binary(func, args, kwargs):
    if kwargs.get("alpha", 1) != 1:
        raise ExactKernelError(f"{func.__name__} with alpha (a fused multiply-add): no fixed-order kernel")
    target, other = _number_divisor(func, args)[:2]
    if isinstance(other, torch.Tensor) and other.shape != target.shape:
        other = ops.expand(other, target.shape)
    return func(target, other, *args[2:], **kwargs)


def _reduction(mean: bool):
    def handle(func, args, kwargs):
        x = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if kwargs.get("dtype") is not None:
            x = x.to(kwargs["dtype"])
        ops.check_float(x, func.__name__)
        return (ops.mean_dims if mean else ops.sum_dims)(x, dims, keepdim)
    return handle


def _unary(name: str):
    return lambda func, args, kwargs: ops.unary(name, args[0])


def _gelu(func, args, kwargs):
    if kwargs.get("approximate", args[1] if len(args) > 1 else "none") != "tanh":
        raise ExactKernelError("gelu: only the tanh approximation (GPT-2's gelu_new) has a fixed-order "
                               "kernel")
    return ops.unary("gelu_tanh", args[0])


def _dropout(func, args, kwargs):
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    if p and training:
        raise ExactKernelError(f"dropout p={p} while training: the reproducible mode needs model.dropout = 0")
    return args[0]


def _softmax(func, args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    return ops.softmax(args[0], dim)


def _pow(func, args, kwargs):
    if func.__name__ == "__rpow__":
        return ops.pow_(args[1], args[0])
    return ops.pow_(args[0], args[1] if len(args) > 1 else kwargs["exponent"])


def _sin_cos(index: int):
    return lambda func, args, kwargs: ops.sin_cos(args[0])[index]


def _repeat_interleave(func, args, kwargs):
    x = args[0]
    repeats = args[1] if len(args) > 1 else kwargs["repeats"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    if not isinstance(repeats, int) or dim is None:
        raise ExactKernelError("repeat_interleave: only an int count along a named dimension")
    dim %= x.dim()
    shape = (*x.shape[:dim + 1], repeats, *x.shape[dim + 1:])
    return ops.expand(x.unsqueeze(dim + 1), shape).flatten(dim, dim + 1)


def _expand(func, args, kwargs):
    x = args[0]
    if func.__name__ == "expand_as":
        shape = args[1].shape
    else:
        shape = args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
    shape = [x.size(i - len(shape) + x.dim()) if s == -1 else s for i, s in enumerate(shape)]
    return ops.expand(x, shape)


def _getitem(func, args, kwargs):
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(isinstance(i, (torch.Tensor, list)) for i in index):
        raise ExactKernelError("indexing by a tensor or list (its backward accumulates): use an embedding")
    return func(*args, **kwargs)


def _call(target):
    return lambda func, args, kwargs: target(*args, **kwargs)


#: Operator name -> its fixed-order substitute ``(func, args, kwargs) -> result``.
HANDLERS = {
    **dict.fromkeys(_BINARY, _broadcast_binary), **dict.fromkeys(_INPLACE, _inplace_binary),
    "sum": _reduction(False), "mean": _reduction(True),
    "matmul": _call(ops.matmul), "__matmul__": _call(ops.matmul), "mm": _call(ops.matmul),
    "bmm": _call(ops.matmul), "linear": _call(fused.linear), "addmm": _call(fused.addmm),
    "layer_norm": _call(fused.layer_norm), "softmax": _softmax,
    "scaled_dot_product_attention": _call(fused.attention), "cross_entropy": _call(fused.cross_entropy),
    "embedding": _call(ops.embedding), "dropout": _dropout, "gelu": _gelu,
    "silu": _unary("silu"), "sigmoid": _unary("sigmoid"), "tanh": _unary("tanh"), "exp": _unary("exp"),
    "log": _unary("log"), "rsqrt": _unary("rsqrt"), "sqrt": _sqrt,
    "pow": _pow, "__pow__": _pow, "__rpow__": _pow,
    "sin": _sin_cos(0), "cos": _sin_cos(1), "repeat_interleave": _repeat_interleave,
    "expand": _expand, "expand_as": _expand, "broadcast_to": _expand, "__getitem__": _getitem,
}


class ExactKernels(TorchFunctionMode):
    """While active, torch's operators are :data:`HANDLERS`' fixed-order ones or :data:`NEUTRAL`; any other
    raises :class:`ExactKernelError`. ``kernels``: the run's ``training.reproducible_kernels`` (the version
    of the matrix products, :mod:`training.exact_kernel`)."""

    def __init__(self, kernels: int = exact_kernel.LEGACY):
        super().__init__()
        self.kernels = exact_kernel.check_version(kernels)
        self._tokens: list = []

    def __enter__(self):
        self._tokens.append(exact_kernel.CURRENT.set(self.kernels))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            exact_kernel.CURRENT.reset(self._tokens.pop())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        handler = HANDLERS.get(name)
        if handler is not None:
            return handler(func, args, kwargs)
        if name in NEUTRAL:
            return func(*args, **kwargs)
        raise ExactKernelError(f"{name or func!r}: the reproducible mode has no fixed-order kernel for it "
                               "(docs/REPRODUCIBLE.md lists what it covers)")
