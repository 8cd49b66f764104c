"""torch tensors in and out of every kernel, without copies where the layouts allow it.

A kernel's call goes through ``call_with_torch`` (``runtime.calls``): torch
operands become what the kernel already takes, and the result goes back to
torch.

* dense CPU tensors are viewed as numpy arrays (``Tensor.numpy()``: zero
  copy), CUDA tensors as CuPy arrays through DLPack (zero copy);
* ``torch.sparse_csr`` and ``torch.sparse_coo`` tensors become scipy (CPU) or
  ``cupyx.scipy.sparse`` (CUDA) matrices over the same buffers, checked like
  any scipy operand;
* when any operand is a torch tensor, a dense result comes back as a torch
  tensor over the result's memory (``torch.from_numpy`` / DLPack), a CSR
  result as ``torch.sparse_csr_tensor`` over its buffers; ``out=`` may be a
  torch tensor, written in place and returned.

Kernels do not record autograd: a tensor that requires grad is refused
(``.detach()`` it, or use ``sparse_mlir.torch.SparseLinear``), never
silently cut from the graph.  torch is never imported here: if the caller
has not imported it, no operand can be a tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from sparse_mlir.errors import DTypeError, FormatError, InvalidIndicesError, OperandError
from sparse_mlir.tensor.device import cupy

__all__ = ["call_with_torch", "from_torch", "to_torch"]


def call_with_torch(call: Callable[..., Any], kernel: Any, out: Any, operands: dict[str, Any]) -> Any:
    """``call(kernel, out, **operands)`` with torch tensors converted in and the result converted back."""
    torch = sys.modules.get("torch")
    if torch is None:
        return call(kernel, out, **operands)
    tensor = torch.Tensor
    if not isinstance(out, tensor):
        for value in operands.values():  # a plain loop: this runs on every call in a process that imported torch
            if isinstance(value, tensor):
                break
        else:
            return call(kernel, out, **operands)
    converted = {name: from_torch(name, value, torch) if isinstance(value, torch.Tensor) else value
                 for name, value in operands.items()}
    if isinstance(out, torch.Tensor):
        call(kernel, from_torch("out", out, torch, writable=True), **converted)
        return out
    return to_torch(call(kernel, out, **converted), torch)


def from_torch(name: str, tensor: Any, torch: Any, *, writable: bool = False) -> Any:
    """The numpy / CuPy array or scipy / cupyx matrix over ``tensor``'s memory."""
    if tensor.requires_grad:
        raise OperandError(f"operand {name} requires grad: kernels do not record autograd, so its gradient would "
                           f"be lost; pass {name}.detach() (or use sparse_mlir.torch.SparseLinear)")
    if tensor.dtype in (torch.bfloat16, torch.complex64, torch.complex128, torch.bool):
        raise DTypeError(f"operand {name} is a {tensor.dtype} tensor; kernels take float16 (GPU), float32, float64, "
                         f"int32 or int64")
    cuda = tensor.device.type == "cuda"
    if tensor.device.type not in ("cpu", "cuda"):
        raise OperandError(f"operand {name} is on {tensor.device}; kernels take CPU or CUDA tensors")
    if tensor.layout == torch.strided:
        if writable and not tensor.is_contiguous():
            raise OperandError(f"{name}= must be a contiguous tensor (it is written in place)")
        return cupy().from_dlpack(tensor) if cuda else tensor.numpy()
    if writable:
        raise OperandError(f"{name}= must be a dense tensor, got layout {tensor.layout}")
    if tensor.layout == torch.sparse_csr:
        buffers = (tensor.values(), tensor.col_indices(), tensor.crow_indices())
    elif tensor.layout == torch.sparse_coo:
        if tensor.ndim != 2:
            raise FormatError(f"operand {name} is a {tensor.ndim}-d sparse COO tensor; sparse operands from torch "
                              f"are matrices")
        _check_coo_bounds(name, tensor)
        tensor = tensor.coalesce()  # sorted, duplicates summed: what a COO operand must be
        buffers = (tensor.values(), tensor.indices()[0], tensor.indices()[1])
    else:
        raise FormatError(f"operand {name} has layout {tensor.layout}; torch sparse operands are sparse_csr or "
                          f"sparse_coo")
    arrays = [cupy().from_dlpack(b) if cuda else b.numpy() for b in buffers]
    if cuda:
        import cupyx.scipy.sparse as module
    else:
        import scipy.sparse as module
    try:  # scipy's constructors check the structure first (a tensor built with check_invariants=False)
        if tensor.layout == torch.sparse_csr:
            return module.csr_matrix((arrays[0], arrays[1], arrays[2]), shape=tuple(tensor.shape))
        if cuda:
            return module.coo_matrix((arrays[0], (arrays[1], arrays[2])), shape=tuple(tensor.shape))
        return _coalesced_coo(arrays, tuple(tensor.shape))
    except (ValueError, IndexError, TypeError) as exc:
        layout = str(tensor.layout).removeprefix("torch.")
        raise InvalidIndicesError(f"operand {name} is a torch {layout} tensor with invalid indices: {exc}") from None


def _check_coo_bounds(name: str, tensor: Any) -> None:
    """Refuse coordinates outside the shape before ``coalesce``, which folds them into linear indices (row 5 of
    3 rows, or -1, came out as some other in-range entry or as scipy's bare ``ValueError``)."""
    indices = tensor._indices()  # uncoalesced: ``indices()`` refuses them
    if indices.numel() == 0:
        return
    low = indices.amin(dim=1).tolist()
    high = indices.amax(dim=1).tolist()
    for dim, (lo, hi, size) in enumerate(zip(low, high, tensor.shape)):
        if lo < 0 or hi >= size:
            raise InvalidIndicesError(f"operand {name}: torch COO tensor has a coordinate in [{lo}, {hi}] along "
                                      f"dimension {dim}, outside [0, {size})")


def _coalesced_coo(arrays: list[Any], shape: tuple[int, ...]) -> Any:
    """A scipy COO matrix over a coalesced tensor's buffers, flagged canonical (row-major sorted, no duplicates:
    what ``coalesce`` made it), so it is not sorted again; its bounds are checked like any scipy operand's."""
    import scipy.sparse

    matrix = scipy.sparse.coo_matrix((arrays[0], (arrays[1], arrays[2])), shape=shape)
    matrix.has_canonical_format = True
    return matrix


def to_torch(result: Any, torch: Any) -> Any:
    """``result`` over the same memory as torch: dense arrays as tensors, CSR results as sparse CSR tensors."""
    if isinstance(result, np.ndarray):
        return torch.from_numpy(result)
    if type(result).__module__.split(".")[0] == "cupy":
        return torch.from_dlpack(result)
    fmt = getattr(result, "format", None)
    if fmt is not None and getattr(fmt, "name", "") == "csr" and isinstance(result.buffers[0], np.ndarray):
        # the result is the caller's alone (the SparseTensor wrapper is dropped), so its buffers may be writable;
        # it was built by the kernel, so torch's invariant checks would only repeat ours
        pos, crd, values = (torch.from_numpy(_writable(b)) for b in result.buffers)
        return torch.sparse_csr_tensor(pos, crd, values, size=tuple(result.shape), check_invariants=False)
    return result  # other sparse formats stay SparseTensor / DeviceSparseTensor


def _writable(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:
        try:
            array.flags.writeable = True
        except ValueError:  # memory it does not own: copy once
            array = array.copy()
    return array

