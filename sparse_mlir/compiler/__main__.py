"""``python -m sparse_mlir.compiler``: the compiler process (see ``process``), started by ``process.call``."""

from sparse_mlir.compiler.process import serve

serve()
