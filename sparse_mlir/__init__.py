"""sparse_mlir: sparse tensor kernels generated through MLIR's sparse_tensor dialect."""

__version__ = "0.1.0"

from . import errors, formats  # noqa: E402
from .api import compile  # noqa: E402
from .export import export  # noqa: E402
from .formats import BSR, COO, CSC, CSF, CSR, DCSR, NM, Dense, Format, parse_format  # noqa: E402
from .runtime.artifact import load_kernel  # noqa: E402
from .tensor import SparseTensor  # noqa: E402
from .tensor_file import load_tensor, save_tensor  # noqa: E402

__all__ = ["errors", "formats", "Format", "parse_format", "CSR", "CSC", "COO", "DCSR", "CSF", "Dense", "BSR",
           "NM", "SparseTensor", "compile", "export", "load_kernel", "save_tensor", "load_tensor"]
