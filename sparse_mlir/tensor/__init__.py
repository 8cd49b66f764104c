"""Tensors in memory: ``SparseTensor`` on the host, ``DeviceSparseTensor`` on a GPU, and level-buffer packing."""

from sparse_mlir.dtypes import check_dtype

# imported for its registration: ``SparseTensor.to("cuda")`` copies through it (CuPy is imported only then)
from sparse_mlir.tensor.device import DeviceSparseTensor
from sparse_mlir.tensor.host import LevelBuffers, SparseTensor

__all__ = ["SparseTensor", "LevelBuffers", "DeviceSparseTensor", "check_dtype"]
