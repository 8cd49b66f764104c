"""``DeviceSparseTensor``: a sparse tensor whose level buffers are CuPy arrays on the GPU.

The CUDA counterpart of ``SparseTensor``, with the same format, shape,
dtype and buffer order, so a kernel compiled for ``target="cuda"`` takes its
buffers as they are.  Built by ``SparseTensor.to("cuda")`` (validated on the
host, then copied once) or from ``cupyx.scipy.sparse`` matrices (validated
on the device: a few reductions whose one result is read back, at
construction only, never in a kernel call).  CuPy is imported when one is
made, never at package import.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from sparse_mlir.dtypes import check_dtype, index_dtype
from sparse_mlir.errors import DeviceError, FormatError, InvalidIndicesError, PatternError
from sparse_mlir.formats import CSR, NM, Format, parse_format
from sparse_mlir.tensor.host import LevelBuffers, SparseTensor, register_device

__all__ = ["DeviceSparseTensor", "cupy"]


@functools.cache
def cupy() -> Any:
    """The ``cupy`` module, or ``DeviceError`` saying how to get it (checked once per process)."""
    try:
        import cupy as cp
    except ImportError as exc:
        raise DeviceError("running on the GPU needs CuPy: pip install 'sparse_mlir[cuda]' "
                          "(cupy-cuda12x or cupy-cuda13x)") from exc
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise DeviceError("CuPy found no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError as exc:
        raise DeviceError(f"CuPy found no usable CUDA device: {exc}") from exc
    return cp


class DeviceSparseTensor(LevelBuffers):
    """Level buffers on the GPU (read-only by convention: kernels never write inputs)."""

    __slots__ = ("format", "shape", "dtype", "buffers", "longest_row", "derived", "__weakref__")

    def __init__(self, fmt: Format, shape: tuple[int, ...], buffers: tuple[Any, ...], longest_row: int | None = None):
        held = {"format": fmt, "shape": tuple(int(s) for s in shape), "buffers": buffers,
                "dtype": np.dtype(buffers[-1].dtype),
                # entries of the longest row (CSR), known when the tensor was checked: lets the runtime pick a
                # row-splitting kernel for skewed rows without reading the device
                "longest_row": longest_row,
                # device data kernels derive from these buffers alone (the 2:4 wgmma metadata in the instruction's
                # layout), made by the first call that needs it and kept while the buffers are the same
                "derived": {}}
        for name, value in held.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:  # as a SparseTensor: what was checked stays so
        raise AttributeError(f"a DeviceSparseTensor cannot be changed once checked ({name}); build a new one")

    @classmethod
    def from_host(cls, tensor: SparseTensor) -> DeviceSparseTensor:
        """Copy a (validated) ``SparseTensor`` to the current device."""
        cp = cupy()
        longest = None
        if tensor.format.with_widths(32, 32) == CSR and tensor.shape[0]:
            longest = int(np.diff(tensor.buffers[0]).max())
        return cls(tensor.format, tensor.shape, tuple(cp.asarray(b) for b in tensor.buffers), longest)

    @classmethod
    def from_cupyx(cls, matrix: Any, format: Format | str = "csr") -> DeviceSparseTensor:
        """Wrap a ``cupyx.scipy.sparse`` CSR matrix (zero-copy), after checking its indices on the device."""
        cp = cupy()
        fmt = parse_format(format) if isinstance(format, str) else format
        if getattr(matrix, "format", None) != "csr" or fmt.with_widths(32, 32) != CSR:
            raise FormatError(f"from_cupyx takes a cupyx CSR matrix as CSR, got {getattr(matrix, 'format', None)} "
                              f"as {fmt}; convert with .tocsr()")
        rows, cols = matrix.shape
        indptr, indices, data = matrix.indptr, matrix.indices, matrix.data
        if any(b.ndim != 1 for b in (indptr, indices, data)) or any(
                np.dtype(b.dtype) not in (np.int32, np.int64) for b in (indptr, indices)):
            raise InvalidIndicesError(f"cupyx CSR buffers must be 1-d, with int32 or int64 indices; got indptr "
                                      f"{indptr.dtype}{tuple(indptr.shape)}, indices {indices.dtype}"
                                      f"{tuple(indices.shape)}, data {tuple(data.shape)}")
        check_dtype(data.dtype, "cupyx CSR values")
        nnz = int(indices.size)
        if data.size != nnz:  # a kernel would read values past the end
            raise InvalidIndicesError(f"cupyx CSR matrix has {nnz} column indices but {data.size} values")
        if indptr.size != rows + 1:
            raise InvalidIndicesError(f"indptr has {indptr.size} entries, expected {rows + 1}")
        steps = cp.diff(indptr)
        gaps = cp.diff(indices)
        # a new row starts where the previous one ended: a decrease in indices is allowed only there
        starts = cp.zeros(max(nnz - 1, 0), dtype=bool)
        if nnz > 1:
            inner = indptr[1:-1]
            inner = inner[(inner > 0) & (inner < nnz)]
            starts[inner - 1] = True
        bad = cp.stack([indptr[0] != 0, indptr[-1] != nnz, cp.any(steps < 0),
                        cp.any(indices < 0) if nnz else cp.bool_(False),
                        cp.any(indices >= cols) if nnz else cp.bool_(False),
                        cp.any((gaps <= 0) & ~starts) if nnz > 1 else cp.bool_(False)]).astype(cp.int64)
        longest = cp.max(steps) if rows else cp.zeros((), cp.int64)
        *problems, longest_row = cp.concatenate([bad, longest.astype(cp.int64).reshape(1)]).get()  # one read-back
        names = ["indptr[0] != 0", "indptr[-1] != nnz", "indptr decreases", "negative column indices",
                 f"column indices >= {cols}", "unsorted or duplicate column indices within a row"]
        found = [n for n, p in zip(names, problems) if p]
        if found:
            raise InvalidIndicesError(f"cupyx CSR matrix is not canonical: {', '.join(found)} "
                                      f"(call .sum_duplicates() / .sort_indices())")
        width = 32 if indptr.dtype == np.int32 and indices.dtype == np.int32 else 64
        return cls(fmt.with_widths(width, width), (rows, cols),
                   (indptr.astype(f"int{width}", copy=False), indices.astype(f"int{width}", copy=False), data),
                   int(longest_row))

    @classmethod
    def from_dense_nm(cls, array: Any, n: int = 2, m: int = 4, *, prune: bool = False) -> DeviceSparseTensor:
        """Compress a 2-d CuPy array to ``NM(n, m)`` on the device: values plus in-group offsets (8-bit up to
        ``m = 128``, as ``NM`` stores them).

        Each group of ``m`` along a row keeps its nonzeros (in order, padded
        with stored zeros to ``n``); a group with more than ``n`` raises
        ``PatternError`` (one flag read back), unless ``prune=True`` keeps the
        ``n`` largest magnitudes instead (ties: the first).
        """
        cp = cupy()
        fmt = NM(n, m)  # checks n and m first (m=0 was a ZeroDivisionError below)
        if array.ndim != 2 or array.shape[1] % m:
            raise FormatError(f"NM({n},{m}) needs a 2-d array with a multiple of {m} columns, got {array.shape}")
        rows, cols = array.shape
        groups = array.reshape(rows, cols // m, m)
        if prune:
            keep = cp.argsort(-cp.abs(groups), axis=2, kind="stable")[:, :, :n]
        else:
            if bool(cp.any(cp.count_nonzero(groups, axis=2) > n)):
                raise PatternError(f"a group of {m} has more than {n} nonzeros: not an {n}:{m} matrix "
                                   f"(prune=True keeps the {n} largest)")
            keep = cp.argsort(groups == 0, axis=2, kind="stable")[:, :, :n]  # nonzeros first, in order
        offsets = cp.sort(keep, axis=2)
        values = cp.take_along_axis(groups, offsets, axis=2).reshape(-1)
        # offsets at the format's width: int8 held 150 as -106 where m > 128 (the format says 32 bits there)
        offsets = offsets.astype(index_dtype(fmt.crd_width)).reshape(-1)
        return cls(fmt, (rows, cols), (offsets, cp.ascontiguousarray(values)))

    def to(self, device: str) -> DeviceSparseTensor | SparseTensor:
        """``"cpu"``: a ``SparseTensor`` with host copies of the buffers; ``"cuda"``: ``self``."""
        if device == "cuda":
            return self
        if device != "cpu":
            raise DeviceError(f"unknown device {device!r}; devices: cpu, cuda")
        return SparseTensor(self.format, self.shape, tuple(b.get() for b in self.buffers), validate=False)

    def __repr__(self) -> str:
        return f"DeviceSparseTensor({self.format}, shape={self.shape}, nnz={self.nnz}, dtype={self.dtype})"


def _copy_to_device(tensor: SparseTensor) -> DeviceSparseTensor:
    return DeviceSparseTensor.from_host(tensor)  # looked up per call, so a patched ``from_host`` is the one used


register_device("cuda", _copy_to_device)  # ``SparseTensor.to("cuda")``
