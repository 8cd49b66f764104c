"""What a compiled kernel looks like from outside, as plain data: its C signature and its GPU launch program.

Both are shared by the compiler (which produces them), the runtime (which calls through them), and
exports (which write them into headers and manifests); nothing here imports MLIR.
"""
