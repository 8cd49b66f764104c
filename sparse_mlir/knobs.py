"""Every environment setting of sparse_mlir, declared once (``SPARSE_MLIR_*``, and the few of other tools it
honours: ``CC``, ``CUDA_HOME``/``CUDA_PATH``, ``LD_LIBRARY_PATH``, ``KMP_BLOCKTIME``, ``OMP_NUM_THREADS``, ``XDG_*``).

Read at use time, not import time, so tests can set them per test; no other module reads ``os.environ``
(``tests/test_knobs.py`` checks), except to pass it on to a child process.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

from sparse_mlir.files import checkout_root

__all__ = ["is_count", "knobs"]

# ``os.environ`` keeps the environment in a dict of encoded keys; ``os.environ.get`` encodes the name and, for an
# unset variable (the usual case), raises and catches a KeyError: 0.4-0.8 us a read.  Every threaded kernel call
# reads three variables (the thread count's two names, the blocktime), 2.4 of its 4.7 us of Python before the
# kernel, so names are encoded once and looked up in that dict, which ``os.environ`` (and pytest's ``setenv``)
# updates on every change.  Where an interpreter keeps no such dict, ``os.environ.get``.
_RAW = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)
_FAST = isinstance(_RAW, dict) and callable(_ENCODE) and callable(_DECODE)
_KEYS: dict[str, object] = {}


def _env(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, at a dict look-up's cost."""
    if not _FAST:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE(name)
    raw = _RAW.get(key)
    return default if raw is None else _DECODE(raw)


class _Knobs:
    """Typed accessors for the environment variables the package reads."""

    @staticmethod
    def cache_dir() -> Path:
        """``SPARSE_MLIR_CACHE_DIR``, else ``$XDG_CACHE_HOME/sparse_mlir``, else ``~/.cache/sparse_mlir``."""
        explicit = _env("SPARSE_MLIR_CACHE_DIR")
        if explicit:
            return Path(explicit)
        base = _env("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "sparse_mlir"

    @staticmethod
    def cpu() -> str:
        """``SPARSE_MLIR_CPU``: the ``-mcpu`` of JIT-compiled kernels (default ``native``)."""
        return _env("SPARSE_MLIR_CPU", "native")


    @staticmethod
    def num_threads() -> int:
        """``SPARSE_MLIR_NUM_THREADS``, else ``OMP_NUM_THREADS``, else the cores this process may use."""
        for name in ("SPARSE_MLIR_NUM_THREADS", "OMP_NUM_THREADS"):
            value = _env(name, "").split(",")[0].strip()
            if is_count(value) and int(value) > 0:
                return int(value)
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    @staticmethod
    def parallel() -> bool:
        """``SPARSE_MLIR_PARALLEL=0`` compiles serial kernels (no OpenMP runtime needed)."""
        return _env("SPARSE_MLIR_PARALLEL", "1") not in ("0", "false", "no")


    @staticmethod
    def max_loaded_kernels() -> int:
        """``SPARSE_MLIR_MAX_LOADED_KERNELS``: compiled libraries kept loaded per process (LRU), default 256."""
        value = _env("SPARSE_MLIR_MAX_LOADED_KERNELS", "")
        return max(1, int(value)) if is_count(value) else 256

    @staticmethod
    def dense_budget() -> int:
        """Bytes a dense copy made by this package may take: ``SPARSE_MLIR_DENSE_BUDGET``, else
        ``DENSE_BUDGET_FRACTION`` of the memory available now (``MemAvailable``, lowered to what the cgroup's
        limit leaves).  Dense copies that do not fit are never planned: ``schedule="auto"`` leaves out its dense
        candidate and a refused compile is not retried densified."""
        text = _env("SPARSE_MLIR_DENSE_BUDGET", "").strip()
        if text:
            if is_count(text):
                return int(text)
            warnings.warn(f"SPARSE_MLIR_DENSE_BUDGET={text!r} is not a number of bytes; using the default",
                          RuntimeWarning, stacklevel=2)
        return int(_available_memory() * DENSE_BUDGET_FRACTION)

    @staticmethod
    def compile_timeout() -> float | None:
        """``SPARSE_MLIR_COMPILE_TIMEOUT``: seconds one compile may take before its process is stopped (unset: none)."""
        text = _env("SPARSE_MLIR_COMPILE_TIMEOUT", "").strip()
        if not text:
            return None
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            warnings.warn(f"SPARSE_MLIR_COMPILE_TIMEOUT={text!r} is not a positive number of seconds; ignored",
                          RuntimeWarning, stacklevel=3)
            return None
        return value

    @staticmethod
    def compile_in_process() -> bool:
        """``SPARSE_MLIR_COMPILE_IN_PROCESS=1`` compiles in this process (debugging; no crash isolation, no timeout)."""
        return _env("SPARSE_MLIR_COMPILE_IN_PROCESS") == "1"

    @staticmethod
    def hopper() -> bool:
        """``SPARSE_MLIR_HOPPER=1`` lets arch-specific code (the sm_90a TMA + wgmma GEMMs) run where it applies.

        They pass ptxas but have not yet been checked on a GPU
        (``benchmarks/gpu/tensor_core_check.py`` does that and sets it); until
        a device run confirms them, every chip runs the portable kernels.
        """
        return _env("SPARSE_MLIR_HOPPER", "0") == "1"

    @staticmethod
    def share_pool() -> bool:
        """``SPARSE_MLIR_SHARE_POOL=0`` keeps our kernels on their own pool even where libgomp (torch's) is
        loaded with spinning workers; by default kernels compiled then run on its pool (``runtime.gomp_bridge``)."""
        return _env("SPARSE_MLIR_SHARE_POOL", "1") not in ("0", "false", "no")

    @staticmethod
    def own_pool() -> bool:
        """``SPARSE_MLIR_OWN_POOL=0`` links threaded kernels against libiomp5 instead of our own pool
        (``runtime.kmp_pool``)."""
        return _env("SPARSE_MLIR_OWN_POOL", "1") not in ("0", "false", "no")

    @staticmethod
    def gomp_workers_spin() -> bool:
        """Whether libgomp's idle workers spin after a region (its default) rather than sleep at once
        (``OMP_WAIT_POLICY=passive`` or ``GOMP_SPINCOUNT=0``, which the efficiency-gap benchmark sets)."""
        if _env("OMP_WAIT_POLICY", "").strip().lower() == "passive":
            return False
        return _env("GOMP_SPINCOUNT", "").strip() not in ("0", "0k", "0M", "0G", "0T")

    @staticmethod
    def fast_call() -> bool:
        """``SPARSE_MLIR_FAST_CALL=0`` turns off the C-level call path of shape-generic CPU kernels
        (``runtime.fast_call``): every call then goes through the Python checks and ctypes, as before it existed.
        """
        return _env("SPARSE_MLIR_FAST_CALL", "1") != "0"

    @staticmethod
    def merge_spmv() -> bool:
        """``SPARSE_MLIR_MERGE_SPMV=1`` runs the merge-path kernel for skewed rows in deterministic CSR SpMV.

        It is checked on the CPU emulation and by ptxas but not yet timed on
        a GPU (``benchmarks/gpu/device_check.py`` does that and sets it);
        until then skewed rows run the lanes-per-row kernel, as balanced ones.
        Read at each call, by the runtime: the compiled program holds both.
        """
        return _env("SPARSE_MLIR_MERGE_SPMV", "0") == "1"

    @staticmethod
    def data_dir() -> Path:
        """``SPARSE_MLIR_DATA``: the folder of benchmark matrices (``dlmc/``, ``suitesparse/``).

        Default: ``../shared/data`` beside the source checkout the package runs
        from, else ``$XDG_DATA_HOME/sparse_mlir`` (``~/.local/share/sparse_mlir``).
        A missing folder is no error: the workloads that need it are skipped.
        """
        explicit = _env("SPARSE_MLIR_DATA")
        if explicit:
            return Path(explicit)
        root = checkout_root()
        if root is not None:
            return root.parent / "shared" / "data"
        base = _env("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(base) / "sparse_mlir"

    # -- settings of other tools, read here like ours ----------------------------------------------

    @staticmethod
    def c_compiler() -> str | None:
        """``CC``: the C compiler that links kernels and exported libraries (unset: ``cc``, ``gcc``, ``clang``)."""
        return _env("CC") or None

    @staticmethod
    def cuda_roots() -> tuple[Path, ...]:
        """``CUDA_HOME`` then ``CUDA_PATH``: CUDA toolkit folders searched first for ``ptxas`` and ``libdevice``."""
        return tuple(Path(value) for value in map(_env, ("CUDA_HOME", "CUDA_PATH")) if value)

    @staticmethod
    def library_path() -> tuple[Path, ...]:
        """``LD_LIBRARY_PATH``: folders searched for the OpenMP runtime, after the Python installation's own."""
        return tuple(Path(p) for p in _env("LD_LIBRARY_PATH", "").split(os.pathsep) if p)

    @staticmethod
    def kmp_blocktime() -> str | None:
        """``KMP_BLOCKTIME``: when set, the OpenMP runtime's own idle spin time is left alone (else 5 ms)."""
        return _env("KMP_BLOCKTIME")


DENSE_BUDGET_FRACTION = 0.25  # of the memory available now: a dense copy must leave room for everything else


def is_count(text: str) -> bool:
    """Whether ``text`` is a whole number ``int`` reads: ASCII digits only (``"²".isdigit()`` is true, and
    ``int("²")`` a ValueError on every kernel call)."""
    return text.isascii() and text.isdigit()


def _available_memory() -> int:
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as f:
        available = int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):  # cgroup v2: the container's own limit, when it has one
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, max(0, int(limit) - used))
    return available


knobs = _Knobs()
