"""sparse_mlir: sparse tensor kernels generated through MLIR's sparse_tensor dialect."""

from sparse_mlir import errors, formats
from sparse_mlir._version import __version__ as __version__  # the face re-exports it
from sparse_mlir.api import compile
from sparse_mlir.export.artifacts import export
from sparse_mlir.formats import BSR, COO, CSC, CSF, CSR, DCSR, NM, Dense, Format, parse_format
from sparse_mlir.runtime.artifact import load_kernel
from sparse_mlir.tensor.host import SparseTensor
from sparse_mlir.io.smt import load_tensor, save_tensor

__all__ = ["errors", "formats", "Format", "parse_format", "CSR", "CSC", "COO", "DCSR", "CSF", "Dense", "BSR",
           "NM", "SparseTensor", "compile", "export", "load_kernel", "save_tensor", "load_tensor"]
