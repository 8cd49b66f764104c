"""The sparse Linear as torch custom operators with an autograd formula (``torch.library``; the ``torch`` extra).

Why custom operators and not a bare ``autograd.Function``: an operator
registered with ``torch.library`` is opaque to ``torch.compile`` (it traces
the call through its fake implementation, which only computes shapes) and
to autograd (its registered formula), so a model with ``SparseLinear``
layers compiles and trains without graph breaks, and the kernels stay the
ones the MLIR pipeline generated.

``y = x W^T + b`` with ``W`` sparse of shape ``(out, in)``.  Every product
is a compiled kernel:

* forward: the Linear orientation ``Y[b,o] = X[b,i] * W[o,i] (+ bias[o])``
  in ``W``'s own format, on ``x`` and ``y`` row-major as torch keeps them:
  the kernel transposes blocks of the batch into cache-sized scratch for
  its tiled SpMM (CSR and N:M) and writes ``y`` rows directly, so no copy
  surrounds it and the next layers (attention above all) get contiguous
  tensors;
* input gradient ``dX = dY W``: the same Linear kernel on ``W^T`` stored as
  CSR, ``dX[b,i] = dY[b,o] * WT[i,o]``.  ``W^T``'s pattern is computed
  once per pattern (``TransposedPattern``); its values are ``W``'s values
  gathered into transposed order on each call (data movement, no
  arithmetic), which is 4x faster than a kernel scattering over ``W``'s
  columns;
* values gradient: the gradient of each stored entry only, an SDDMM over
  ``W``'s pattern, ``D[o,i] = S[o,i] * dYt[o,b] * X[b,i]`` with ``S`` the
  pattern in row-major CSR with values 1, so the pruned entries get no
  gradient and the mask stays fixed.  Its values come back in ``W``'s
  storage order (a gather when that order is not row-major, as for BSR);
  N:M patterns go through CSR too (a sparse N:M result is not generated
  correctly, see the report of issue 18);
* bias gradient: the column sums ``gb[o] = dY[b,o]``;
* an activation (``ACTIVATIONS``: GELU) runs in the forward kernel's
  epilogue; its backward recomputes the pre-activation with the plain
  forward kernel (one more SpMM, no saved ``rows x out`` tensor) and applies
  torch's own derivative before the gradients above.

The operators take the pattern as tensors (no Python objects), so they are
plain functions of their inputs: deep copies, ``state_dict`` loads and
``.to()`` of the module need no registry to stay in step.
"""

from __future__ import annotations

import functools
import json
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

from sparse_mlir.api import compile as compile_kernel
from sparse_mlir.errors import FormatError, InvalidIndicesError, OperandError
from sparse_mlir.formats import CSR, Format, format_from_json, format_to_json
from sparse_mlir.runtime import threads
from sparse_mlir.runtime.kernel import Kernel
from sparse_mlir.tensor import storage
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["ACTIVATIONS", "TransposedPattern", "feed_forward", "format_key", "linear", "transposed_pattern"]

# the Linear orientation: X and Y row-major as torch has them, no transposes or copies around the kernel
# (its emitter blocks the batch so that each block's X^T stays in L2, dialects/native/linear.py).  Its calls run
# with a blocktime of 0: torch's own OpenMP pool runs the operators between them on the same cores, and our
# workers spinning 5 ms after each call took them (MiniLM 90%, 2 threads, loaded host: 1434 -> 1193 ms, median
# of 7 interleaved rounds; the per-round ratios ranged 0.53-1.07)
_LINEAR = "Y[b,o] = X[b,i] * W[o,i]"
_LINEAR_BIAS = "Y[b,o] = X[b,i] * W[o,i] + bias[o]"
# an activation applied in the Linear kernel's epilogue, to each finished row while it is in L1 (``SparseLinear``'s
# ``activation``): no second pass over Y.  MiniLM's FFN (4096 x 1536, 90%, 1 thread): Linear 12.0 ms, then torch's
# GELU 4.1 ms more, fused 1.0 ms more
ACTIVATIONS = {"gelu": ("Y[b,o] = gelu(X[b,i] * W[o,i])", "Y[b,o] = gelu(X[b,i] * W[o,i] + bias[o])")}
_SDDMM = "D[o,i] = S[o,i] * Gt[o,b] * X[b,i]"
_COLUMN_SUMS = "gb[o] = G[b,o]"


@functools.cache
def _kernel(expression: str, formats: tuple[tuple[str, Format], ...], dtype: np.dtype) -> Kernel:
    """One compiled kernel per expression, formats and dtype (``compile`` plans on every call: 50 us; the dtype
    object is the key, its name costs 5 us to read)."""
    return compile_kernel(expression, formats=dict(formats), dtype=dtype.name)


@functools.cache
def format_key(fmt: Format) -> str:
    """A format as the string operator argument it travels as (custom operators take no Python objects)."""
    return json.dumps(format_to_json(fmt), sort_keys=True)


@functools.cache
def _format(key: str) -> Format:
    try:
        return format_from_json(json.loads(key))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # an operator called with a key of its own
        raise FormatError(f"not a weight format key ({format_key.__name__} makes them): {key!r}") from exc


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def _array(tensor: torch.Tensor | None) -> np.ndarray | None:
    """A tensor that may be absent (a bias) as an array over its memory."""
    return None if tensor is None else _numpy(tensor)


def _csr_width(nnz: int, size: int) -> Format:
    """CSR with 32-bit indices, or 64-bit ones when the entries or the dimension do not fit."""
    return CSR if max(nnz, size) < 2**31 else CSR.with_widths(64, 64)


class TransposedPattern(NamedTuple):
    """What the backward needs of ``W``'s pattern, as index tensors (module buffers, recomputed per pattern).

    ``pos``/``crd``: ``W`` in row-major CSR; ``stored``: for each stored entry
    of ``W``, its place in that order (empty when it is the identity, as for
    CSR and N:M); ``t_pos``/``t_crd``: ``W^T`` in CSR; ``t_order``: for each
    entry of ``W^T``, its place in ``W``'s storage.
    """

    pos: torch.Tensor
    crd: torch.Tensor
    stored: torch.Tensor
    t_pos: torch.Tensor
    t_crd: torch.Tensor
    t_order: torch.Tensor


def transposed_pattern(weight: SparseTensor) -> TransposedPattern:
    """The row-major and transposed CSR patterns of ``weight`` (index arithmetic only, once per pattern)."""
    (rows, cols), _ = weight.to_coo()
    out_features, in_features = weight.shape
    index = np.int32 if _csr_width(weight.nnz, max(weight.shape)) is CSR else np.int64

    def compressed(major: np.ndarray, minor: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        order = np.lexsort((minor, major))
        pos = np.concatenate(([0], np.cumsum(np.bincount(major, minlength=size)))).astype(index)
        return pos, minor[order].astype(index), order

    pos, crd, order = compressed(rows, cols, out_features)
    t_pos, t_crd, t_order = compressed(cols, rows, in_features)
    stored = np.empty(0, np.int64)
    if not np.array_equal(order, np.arange(order.size)):
        stored = np.empty(order.size, np.int64)
        stored[order] = np.arange(order.size)
    return TransposedPattern(*(torch.from_numpy(np.ascontiguousarray(a)) for a in
                               (pos, crd, stored, t_pos, t_crd, t_order.astype(np.int64))))


def operator_weight(fmt: str, shape: list[int], levels: list[torch.Tensor], values: torch.Tensor
                    ) -> SparseTensor:
    """A weight as the operators receive it (format key, shape, level buffers, values) as a ``SparseTensor``
    over the same memory.  The level buffers are checked whenever they are new to this function or were changed
    in place since (torch counts in-place changes in ``_version``): a module's coordinate set to 10**9 under
    ``no_grad``, or an operator called directly with its own buffers, crashed the kernel."""
    tensor = SparseTensor(_format(fmt), tuple(shape), (*map(_numpy, levels), _numpy(values)), validate=False)
    _check_levels(tensor, levels)
    return tensor


# level buffers checked as they are: id of the last level's tensor -> (a weak reference to it, the stamp it was
# checked with; ``_check_levels``).  Not a WeakKeyDictionary: it compares keys with ``==``, elementwise on tensors.
_checked_levels: dict[int, tuple[weakref.ref, tuple]] = {}


def _check_levels(tensor: SparseTensor, levels: list[torch.Tensor]) -> None:
    """Validate ``tensor`` (over the memory of ``levels``) unless these very level tensors were validated for it
    and have not changed in place since: the stamp is their objects, memory and ``_version`` counts, with the
    format, shape and value count.  Inference tensors count no changes: they are validated on every call."""
    try:
        stamp = (tensor.format, tensor.shape, tensor.nnz, tuple((id(t), t.data_ptr(), t._version) for t in levels))
    except RuntimeError:
        stamp = None
    anchor = levels[-1] if levels else None
    known = _checked_levels.get(id(anchor))
    if anchor is None or stamp is None or known is None or known[0]() is not anchor or known[1] != stamp:
        storage.validate(tensor.format, tensor.shape, tensor.buffers)
        if anchor is not None and stamp is not None:
            key = id(anchor)
            _checked_levels[key] = (weakref.ref(anchor, lambda _, key=key: _checked_levels.pop(key, None)), stamp)


def _check_activation(activation: str) -> None:
    if activation and activation not in ACTIVATIONS:
        raise OperandError(f"activation must be '' or one of {', '.join(sorted(ACTIVATIONS))}, got {activation!r}")


# -- the operators -------------------------------------------------------------------
@torch.library.custom_op("sparse_mlir::linear", mutates_args=())
def _linear(x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, levels: list[torch.Tensor],
            pattern: list[torch.Tensor], fmt: str, shape: list[int], activation: str) -> torch.Tensor:
    """``act(x W^T + b)`` for ``x`` of shape ``(rows, in)``: a row-major ``(rows, out)`` tensor; ``activation``
    one of ``ACTIVATIONS`` or ``""`` (none)."""
    del pattern  # the backward's (an input so that setup_context can save it)
    return run_linear(x, operator_weight(fmt, shape, levels, values), _array(bias), activation)


@_linear.register_fake
def _(x, values, bias, levels, pattern, fmt, shape, activation):
    return x.new_empty((x.shape[0], shape[0]))


def run_linear(x: torch.Tensor, weight: SparseTensor, bias: np.ndarray | None, activation: str) -> torch.Tensor:
    """The forward kernel ``act(x W^T + b)`` on 2-d ``x``: what the operator runs, and what ``SparseLinear``
    calls directly when nothing records the call (``runs_directly``, which keeps the bias's array with the
    weight: making it takes 0.9 us)."""
    operands: dict[str, Any] = {"W": weight}
    if bias is not None:
        operands["bias"] = bias
    _check_activation(activation)
    expressions = ACTIVATIONS[activation] if activation else (_LINEAR, _LINEAR_BIAS)
    kernel = _kernel(expressions[bias is not None], (("W", weight.format),), weight.dtype)
    with threads.blocktime(0):
        return torch.from_numpy(kernel(X=_numpy(x.contiguous()), **operands))


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what ``runs_directly`` takes: no subclass that wraps operators


def runs_directly(*tensors: torch.Tensor | None) -> bool:
    """Whether a forward may call its kernel without the dispatcher: no gradient wanted, and nothing that
    records or transforms operators (``torch.compile``, ``torch.jit.trace``, the profiler, ``torch.func``, a
    Python dispatch or function mode such as ``FlopCounterMode`` or ``with torch.device(...)``) is active; plain
    tensors only.

    Why: the operator's dispatch (the custom op's Python layers, the weight
    wrapped anew) cost 70-90 us a call, 4-5 times the kernel on a 10-row
    batch (384 -> 384 at 90%: 0.085 ms against 0.017), and a sentence runs
    through 36 of them.
    """
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.autograd._profiler_enabled():
        return False
    if (torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


@torch.library.custom_op("sparse_mlir::feed_forward", mutates_args=())
def _feed_forward(x: torch.Tensor, values1: torch.Tensor, bias1: torch.Tensor | None, levels1: list[torch.Tensor],
                  fmt1: str, shape1: list[int], activation: str, values2: torch.Tensor, bias2: torch.Tensor | None,
                  levels2: list[torch.Tensor], fmt2: str, shape2: list[int]) -> torch.Tensor:
    """``act(x W1^T + b1) W2^T + b2`` in one kernel (``dialects.native.mlp``): the hidden activations stay in
    cache.  Inference only (no autograd formula): ``SparseFeedForward`` runs the two layers' own operators when a
    gradient is wanted."""
    return run_feed_forward(x, operator_weight(fmt1, shape1, levels1, values1), _array(bias1), activation,
                            operator_weight(fmt2, shape2, levels2, values2), _array(bias2))


@_feed_forward.register_fake
def _(x, values1, bias1, levels1, fmt1, shape1, activation, values2, bias2, levels2, fmt2, shape2):
    return x.new_empty((x.shape[0], shape2[0]))


def run_feed_forward(x: torch.Tensor, w1: SparseTensor, bias1: np.ndarray | None, activation: str,
                     w2: SparseTensor, bias2: np.ndarray | None) -> torch.Tensor:
    """The fused feed-forward kernel on 2-d ``x``: what the operator runs, and what ``SparseFeedForward`` calls
    directly when nothing records the call (``runs_directly``)."""
    operands: dict[str, Any] = {"W1": w1, "W2": w2}
    if bias1 is not None:
        operands["b1"] = bias1
    if bias2 is not None:
        operands["b2"] = bias2
    kernel = _kernel(feed_forward_expression(activation, bias1 is not None, bias2 is not None),
                     (("W1", w1.format), ("W2", w2.format)), w1.dtype)
    with threads.blocktime(0):
        return torch.from_numpy(kernel(X=_numpy(x.contiguous()), **operands))


def feed_forward_expression(activation: str, bias1: bool, bias2: bool) -> str:
    """The kernel of two Linear layers in a chain, the first through ``activation`` (one of ``ACTIVATIONS``) or
    with a bias (the fused kernel needs an elementwise step between the two products, ``patterns.Mlp``)."""
    _check_activation(activation)
    if not activation and not bias1:
        raise OperandError("a fused feed-forward needs an activation or a bias between its two layers")
    hidden = "X[b,i] * W1[o,i]" + (" + b1[o]" if bias1 else "")
    return f"Y[b,p] = W2[p,o] * {activation}({hidden})" + (" + b2[p]" if bias2 else "")


def feed_forward(x: torch.Tensor, first: tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], str,
                                               tuple[int, int]], activation: str,
                 second: tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor], str, tuple[int, int]]
                 ) -> torch.Tensor:
    """``act(x W1^T + b1) W2^T + b2`` for 2-d ``x`` (checked by the caller), each layer given as its values, bias,
    level buffers, ``format_key`` and shape."""
    (v1, b1, l1, f1, s1), (v2, b2, l2, f2, s2) = first, second
    return _feed_forward(x, v1, b1, l1, f1, list(s1), activation, v2, b2, l2, f2, list(s2))


@torch.library.custom_op("sparse_mlir::linear_grad_input", mutates_args=())
def _grad_input(grad: torch.Tensor, values: torch.Tensor, t_pos: torch.Tensor, t_crd: torch.Tensor,
                t_order: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``dX = dY W`` as the Linear kernel on ``W^T`` (CSR): ``dX[b,i] = dY[b,o] * WT[i,o]``, row-major."""
    out_features, in_features = shape
    fmt = _csr_width(values.numel(), max(shape))
    try:
        gathered = np.take(_numpy(values), _numpy(t_order))  # numpy: torch's thread pool stalls on a busy machine
    except IndexError as exc:
        raise InvalidIndicesError(f"the transposed pattern's order is out of range: {exc}") from None
    w_t = SparseTensor(fmt, (in_features, out_features), (_numpy(t_pos), _numpy(t_crd), gathered), validate=False)
    _check_levels(w_t, [t_pos, t_crd])
    kernel = _kernel(_LINEAR, (("W", fmt),), w_t.dtype)
    with threads.blocktime(0):
        return torch.from_numpy(kernel(X=_numpy(grad.contiguous()), W=w_t))


@_grad_input.register_fake
def _(grad, values, t_pos, t_crd, t_order, shape):
    return grad.new_empty((grad.shape[0], shape[1]))


@torch.library.custom_op("sparse_mlir::linear_grad_values", mutates_args=())
def _grad_values(grad_t: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, crd: torch.Tensor, stored: torch.Tensor,
                 shape: list[int]) -> torch.Tensor:
    """The gradient of each stored value: the SDDMM ``S * (dY^T X)`` over ``W``'s pattern, in ``W``'s order."""
    nnz = crd.numel()
    fmt = _csr_width(nnz, max(shape))
    dtype = _numpy(x).dtype
    ones = SparseTensor(fmt, tuple(shape), (_numpy(pos), _numpy(crd), np.ones(nnz, dtype)), validate=False)
    kernel = _kernel(_SDDMM, (("S", fmt), ("D", fmt)), dtype)
    values = kernel(S=ones, Gt=_numpy(grad_t), X=_numpy(x.contiguous())).values
    return torch.from_numpy(np.take(values, _numpy(stored)) if stored.numel() else values.copy())


@_grad_values.register_fake
def _(grad_t, x, pos, crd, stored, shape):
    return x.new_empty((crd.numel(),))


@torch.library.custom_op("sparse_mlir::linear_grad_bias", mutates_args=())
def _grad_bias(grad: torch.Tensor) -> torch.Tensor:
    """The bias gradient: the column sums of ``dY``."""
    array = _numpy(grad.contiguous())  # rows of dY contiguous: the sums over rows vectorize across columns
    return torch.from_numpy(_kernel(_COLUMN_SUMS, (), array.dtype)(G=array))


@_grad_bias.register_fake
def _(grad):
    return grad.new_empty((grad.shape[1],))


def _setup_context(ctx, inputs, output) -> None:
    x, values, bias, levels, pattern, fmt, shape, activation = inputs
    ctx.shape, ctx.fmt, ctx.activation = shape, fmt, activation
    ctx.lists = len(levels), len(pattern)
    ctx.has_bias = bias is not None
    # an activation's backward recomputes the pre-activation from the weight's levels and the bias
    kept = [*levels, *([bias] if bias is not None else [])] if ctx.activation else []
    ctx.save_for_backward(x, values, *pattern, *kept)


def _backward(ctx, grad: torch.Tensor):
    x, values, pos, crd, stored, t_pos, t_crd, t_order, *kept = ctx.saved_tensors
    need_x, need_values, need_bias = ctx.needs_input_grad[:3]
    if ctx.activation:  # through the activation first: its derivative at the recomputed pre-activation
        levels, bias = kept[:ctx.lists[0]], (kept[-1] if ctx.has_bias else None)
        before = _linear(x, values, bias, levels, [pos, crd, stored, t_pos, t_crd, t_order], ctx.fmt, ctx.shape,
                         "")
        grad = _ACTIVATION_BACKWARD[ctx.activation](grad, before)
    grad_x = _grad_input(grad, values, t_pos, t_crd, t_order, ctx.shape) if need_x else None
    # the SDDMM reads dY^T: its rows are W's rows
    grad_values = _grad_values(grad.t().contiguous(), x, pos, crd, stored, ctx.shape) if need_values else None
    grad_bias = _grad_bias(grad) if need_bias and ctx.has_bias else None
    levels, pattern = ctx.lists
    return grad_x, grad_values, grad_bias, [None] * levels, [None] * pattern, None, None, None


_linear.register_autograd(_backward, setup_context=_setup_context)

# d act(z) / dz applied to the incoming gradient, torch's own formula for the function the kernel computed
_ACTIVATION_BACKWARD = {"gelu": lambda grad, z: torch.ops.aten.gelu_backward(grad, z)}


def linear(x: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, levels: list[torch.Tensor],
           pattern: list[torch.Tensor], fmt: str, shape: tuple[int, int], activation: str = "") -> torch.Tensor:
    """``act(x W^T + b)`` for 2-d ``x`` (checked by the caller: CPU, ``values``' dtype, ``in`` features; the
    activation one of ``ACTIVATIONS`` or ``""``), differentiable in ``x``, ``values`` (the stored entries only)
    and ``bias``.

    ``fmt`` is ``format_key`` of the weight's format, computed once by the
    caller: ``torch.compile`` takes it as a constant instead of tracing JSON.
    """
    return _linear(x, values, bias, levels, pattern, fmt, list(shape), activation)
