"""Pass pipelines and rewrites from kernel modules to native code.

Installed as ``sparse_mlir.lowering``; importing it needs the MLIR Python bindings.
"""
