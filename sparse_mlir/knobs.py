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


knobs = _Knobs()
