"""The compiler: spec + formats + shapes + target + options -> a cached artifact (``driver.build``).

``driver`` owns the cache key, the disk cache and the hop to the compiler process; ``build`` runs
inside that process and is the only code that imports ``sparse_mlir.dialects`` and ``sparse_mlir.lowering``.
"""
