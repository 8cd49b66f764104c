"""Tensor files: Matrix Market, DLMC ``.smtx`` and scipy ``.npz`` (``matrix_files``), and the exact ``.smt`` (``smt``)."""

from sparse_mlir.io.matrix_files import (
    file_kind,
    load_any,
    read_matrix,
    read_mtx,
    read_npz,
    read_smtx,
    save_any,
    write_mtx,
    write_npz,
    write_smtx,
)
from sparse_mlir.io.smt import load_tensor, save_tensor

__all__ = ["file_kind", "load_any", "read_matrix", "read_mtx", "read_npz", "read_smtx", "save_any", "write_mtx",
           "write_npz", "write_smtx", "load_tensor", "save_tensor"]
