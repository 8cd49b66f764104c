"""MLIR-level definitions: encodings of formats and the builders that emit kernels.

Installed as ``sparse_mlir.dialects``; importing it needs the MLIR Python bindings.
"""
