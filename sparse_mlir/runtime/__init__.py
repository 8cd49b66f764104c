"""Loading and calling compiled kernels (no MLIR here): every kind follows ``runtime.kernel.Kernel``."""
