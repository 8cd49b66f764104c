"""Every environment setting of sparse_mlir, declared once (``SPARSE_MLIR_*``).

Read at use time, not import time, so tests can set them per test.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["knobs"]


class _Knobs:
    """Typed accessors for the environment variables the package reads."""

    @staticmethod
    def cache_dir() -> Path:
        """``SPARSE_MLIR_CACHE_DIR``, else ``$XDG_CACHE_HOME/sparse_mlir``, else ``~/.cache/sparse_mlir``."""
        explicit = os.environ.get("SPARSE_MLIR_CACHE_DIR")
        if explicit:
            return Path(explicit)
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "sparse_mlir"

    @staticmethod
    def cpu() -> str:
        """``SPARSE_MLIR_CPU``: the ``-mcpu`` of JIT-compiled kernels (default ``native``)."""
        return os.environ.get("SPARSE_MLIR_CPU", "native")


    @staticmethod
    def num_threads() -> int:
        """``SPARSE_MLIR_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the cores this process may use."""
        for name in ("SPARSE_MLIR_NUM_THREADS", "OMP_NUM_THREADS"):
            value = os.environ.get(name, "").split(",")[0].strip()
            if value.isdigit() and int(value) > 0:
                return int(value)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    @staticmethod
    def parallel() -> bool:
        """``SPARSE_MLIR_PARALLEL=0`` compiles serial kernels (no OpenMP runtime needed)."""
        return os.environ.get("SPARSE_MLIR_PARALLEL", "1") not in ("0", "false", "no")


    @staticmethod
    def max_loaded_kernels() -> int:
        """``SPARSE_MLIR_MAX_LOADED_KERNELS``: compiled libraries kept loaded per process (LRU), default 256."""
        value = os.environ.get("SPARSE_MLIR_MAX_LOADED_KERNELS", "")
        return max(1, int(value)) if value.isdigit() else 256


knobs = _Knobs()
