"""The OpenMP runtime that threaded kernels use, and their thread count.

Kernels are lowered through MLIR's OpenMP dialect, which emits calls to the
``__kmpc_*`` ABI of LLVM's and Intel's OpenMP runtimes.  In this process they
link our own pool (``kmp_pool``), or torch's (``gomp_bridge``), or
``libiomp5.so`` from PyPI's ``intel-openmp`` (or an LLVM ``libomp.so``
found on the usual paths): ``kernel_runtime``.  The thread count is read at call time
(``SPARSE_MLIR_NUM_THREADS``, ``OMP_NUM_THREADS``, the usable cores) and set
with ``omp_set_num_threads`` only when it changes for the calling thread;
idle pool threads spin ``BLOCKTIME_MS`` before sleeping unless
``KMP_BLOCKTIME`` is set.  Small calls run on the calling thread alone:
always below ``SERIAL_BELOW`` entries, and below ``COLD_SERIAL_BELOW``
when the workers have gone to sleep since this thread's last call (an
isolated call, or any call under ``KMP_BLOCKTIME=0``), since waking them
costs more than such a call's work.  That last rule is only the first
guess of each kernel's ``thread_choice.ThreadChoice``, which times both.
"""

from __future__ import annotations

import ctypes
import functools
import math
import site
import sys
import threading
import time
from pathlib import Path

from sparse_mlir.knobs import is_count, knobs
from sparse_mlir.runtime import gomp_bridge, kmp_pool

__all__ = ["blocktime", "blocktime_seconds", "fixed", "for_work", "kernel_runtime", "load_runtime", "openmp_library",
           "set_threads", "wait_until_idle", "work_threads"]

_NAMES = ("libiomp5.so", "libomp.so", "libomp.so.5")
_local = threading.local()


def _search_dirs(library_path: tuple[Path, ...]) -> list[Path]:
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    dirs += [Path(p).parents[2] / "lib" for p in site.getsitepackages() if len(Path(p).parents) > 2]
    dirs += library_path
    dirs += [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/llvm-14/lib"), Path("/usr/local/lib")]
    return dirs


def openmp_library() -> Path | None:
    """Path of the OpenMP runtime threaded kernels link against, or ``None`` (then kernels are serial).

    Follows ``SPARSE_MLIR_PARALLEL`` and ``LD_LIBRARY_PATH`` as they are now;
    the search itself is remembered per ``LD_LIBRARY_PATH`` (this runs on every compile).
    """
    if not knobs.parallel():
        return None
    return _find_openmp(knobs.library_path())


@functools.lru_cache(maxsize=16)
def _find_openmp(library_path: tuple[Path, ...]) -> Path | None:
    for folder in _search_dirs(library_path):
        for name in _NAMES:
            if (folder / name).is_file():
                return (folder / name).resolve()
    return None


# below this many stored operand entries a fork costs more than it saves.  For SpMV the entries are A's values plus
# x.  Placed on a quiet 2-core Intel Xeon (benchmarks/short_rows.py, session 9): 1 thread / 2 threads was 0.89 at
# 10k entries and 1.09 at 20k with 4 a row, 0.92 at 8.4k and 1.03 at 16.9k with 32 a row.  (Session 6's Zen 5,
# shared at load average 5, never gained from a second thread: that host could not place it.)
SERIAL_BELOW = 16384
# below this many entries a call runs on the calling thread when the pool's workers sleep (``_pool_awake``): a fork
# then waits for them to wake, longer than the work.  Placed on a 2-core Xeon VM with our own pool (``kmp_pool``,
# session 20, ``benchmarks/short_rows.py --part cold``), ratio 1 thread / 2 threads: back to back with a blocktime
# of 0 (the efficiency-gap benchmark's regime) SpMM N=128 0.84 at 64k entries, 1.08 at 92k, 1.50 at 157k, SpMV 8 a
# row 0.98 at 72k, 1.46 at 144k; after a 7 ms pause (the idle vCPU halts too) SpMM 1.17 at 64k, 1.00 at 92k,
# 1.14 at 157k, SpMV 1.08 at 72k, 0.94 at 144k.  (With libiomp5, whose forks cost two wake-ups, the line was at
# 131072: SpMM 0.65-0.86 at 64-92k back to back, session 10.)
COLD_SERIAL_BELOW = 65536


_loaded: dict[Path, ctypes.CDLL] = {}
_generation = 0  # runtimes loaded so far: a thread's applied count is stale when a runtime joined since


def kernel_runtime() -> Path | None:
    """The OpenMP runtime kernels compiled now link; ``None``: serial kernels (``SPARSE_MLIR_PARALLEL=0``).

    In order: the libgomp bridge (``gomp_bridge``: torch's pool) when libgomp
    is in this process with workers that spin after torch's operators, and
    ``SPARSE_MLIR_SHARE_POOL`` allows (our workers would fight them for the
    cores); else our own pool (``kmp_pool``) unless ``SPARSE_MLIR_OWN_POOL=0``;
    else the installed runtime (``openmp_library``).  With libgomp's workers
    asleep at once, our pool's forks cost less than its regions.
    """
    if not knobs.parallel():
        return None
    if knobs.share_pool() and knobs.gomp_workers_spin():
        found = gomp_bridge.bridge()
        if found is not None:
            return _remember(*found)
    if knobs.own_pool():
        found = kmp_pool.library()
        if found is not None:
            return _remember(*found)
    return openmp_library()


def _remember(path: Path, library: ctypes.CDLL) -> Path:
    """Count ``library`` (at ``path``) among the loaded runtimes (``set_threads`` sets each one's thread count);
    returns ``path``."""
    global _generation
    _loaded.setdefault(path, library)
    _generation = len(_loaded)
    return path


def load_runtime(path: Path | None = None) -> ctypes.CDLL:
    """Load the OpenMP runtime at ``path`` (once per runtime) before a threaded kernel library that links it.

    Loaded locally: the kernel finds it as its dependency, and no library
    loaded later resolves its own OpenMP calls against it.  ``path`` ``None``:
    the one ``openmp_library`` names now, or when that is none
    (``SPARSE_MLIR_PARALLEL=0`` set since), the one loaded last, which the
    threaded kernels compiled before still use.
    """
    path = path or openmp_library()
    if path is None:
        assert _loaded, "threaded kernel without an OpenMP runtime"
        return next(reversed(_loaded.values()))
    lib = _loaded.get(path)
    if lib is None:
        lib = ctypes.CDLL(str(path))
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        _remember(path, lib)
    return _loaded[path]


# how long pool threads spin for more work after a call before they sleep, unless KMP_BLOCKTIME says otherwise:
# the runtimes' 200 ms kept a core busy after every call, and numpy's BLAS threads called within that window ran
# up to 10x slower here (2 cores); a few milliseconds still keep back-to-back kernel calls warm
BLOCKTIME_MS = 5


def set_threads(count: int) -> None:
    """Make the next kernel call on this Python thread use ``count`` threads (and this thread's blocktime)."""
    wanted = getattr(_local, "blocktime", BLOCKTIME_MS)
    if not _loaded:
        load_runtime()
    # every runtime loaded: the next kernel links one of them (our pool, libiomp5, or the bridge to libgomp)
    if getattr(_local, "applied_blocktime", None) != (wanted, _generation):  # first call here, a ``blocktime`` block
        if knobs.kmp_blocktime() is None:
            for runtime in list(_loaded.values()):
                if hasattr(runtime, "kmp_set_blocktime"):  # ours, libiomp5's; libgomp's spin as torch set
                    runtime.kmp_set_blocktime(wanted)  # per calling thread, like the thread count
        _local.applied_blocktime = (wanted, _generation)
    if getattr(_local, "count", None) != (count, _generation):
        for runtime in list(_loaded.values()):
            runtime.omp_set_num_threads(count)
        _local.count = (count, _generation)


def blocktime(ms: int) -> _ThisThread:
    """Let idle pool threads spin ``ms`` (0: sleep at once) after the kernel calls of this block on this Python
    thread, unless ``KMP_BLOCKTIME`` is set.

    For callers whose kernel calls alternate with another OpenMP pool on the
    same cores (``SparseLinear`` between torch operators): our spinning
    workers took cores from torch's threads after every call.
    """
    return _ThisThread("blocktime", ms, BLOCKTIME_MS)


def for_work(entries: int) -> int:
    """Threads for a call touching ``entries`` operand entries: the configured count, or 1 when tiny, or 1 when
    small and the pool's workers are asleep (``COLD_SERIAL_BELOW``)."""
    return work_threads(entries)[0]


def work_threads(entries: int) -> tuple[int, int | None]:
    """``for_work``'s count, and the configured count when this call finds the pool's workers asleep and could
    fork (else ``None``): then serial or threaded is open, and ``thread_choice.ThreadChoice`` measures which.

    Every call of at least ``SERIAL_BELOW`` entries counts as this thread's last call (``_pool_awake``).
    """
    fixed_count = getattr(_local, "fixed", None)
    if fixed_count is not None:
        return fixed_count, None
    if entries < SERIAL_BELOW:
        return 1, None
    count = knobs.num_threads()
    if count == 1:
        return 1, None
    now = time.monotonic()
    awake = _pool_awake(now)
    _local.last_call = now
    if awake:
        return count, None
    return (1 if entries < COLD_SERIAL_BELOW else count), count


def _pool_awake(now: float) -> bool:
    """Whether this Python thread called a kernel of at least ``SERIAL_BELOW`` entries within the blocktime: its
    pool's workers then still spin (or the calls come in a burst, and one wake-up serves the rest of it).

    Measured from the last call's start, which the C call path knows: after
    a call longer than the blocktime a small one runs serially though the
    workers may still spin; that costs less than a wake-up would.
    """
    last = getattr(_local, "last_call", None)
    return last is not None and now - last < blocktime_seconds()


def wait_until_idle(limit: float = 0.25) -> None:
    """Sleep for this Python thread's blocktime, as long as the pool's idle workers spin after a kernel call,
    when that is at most ``limit`` seconds: called right after kernel calls, before timing another library's
    threads, which spinning workers slow on a small machine (``schedule="auto"`` times dense BLAS after our
    kernels, once per operand structure).  The limit covers ``KMP_BLOCKTIME=200``, the runtimes' own default."""
    spin = blocktime_seconds()
    if 0 < spin <= limit:
        time.sleep(spin)


def blocktime_seconds() -> float:
    """How long idle workers of this thread's pool spin: ``KMP_BLOCKTIME`` (milliseconds, or with a ``us``,
    ``ms`` or ``s`` suffix, or ``infinite``) when set, else this thread's ``blocktime``."""
    text = knobs.kmp_blocktime()
    if text is None:
        return getattr(_local, "blocktime", BLOCKTIME_MS) / 1e3
    return _parse_blocktime(text)


@functools.lru_cache(maxsize=8)
def _parse_blocktime(text: str) -> float:
    """Seconds of a ``KMP_BLOCKTIME`` value (parsed once per value: this runs before every threaded call)."""
    text = text.strip().lower()
    for suffix, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0), ("", 1e-3)):
        if text.endswith(suffix) and is_count(text[:len(text) - len(suffix)]):
            return int(text[:len(text) - len(suffix)]) * scale
    return math.inf  # "infinite", or a form the runtime may read otherwise: assume the workers spin


def fixed(count: int) -> _ThisThread:
    """Run the kernel calls of this block, on this Python thread, with ``count`` threads."""
    return _ThisThread("fixed", count, None)


class _ThisThread:
    """``setting`` of this Python thread's kernel calls set to ``value`` for a ``with`` block, then back to what it
    was.  A class rather than ``contextlib.contextmanager``: ``SparseLinear`` enters one around every call, and
    the generator machinery cost 1.9 us of a 5 us call on a one-row batch."""

    __slots__ = ("default", "previous", "setting", "value")

    def __init__(self, setting: str, value: int, default: int | None):
        self.setting, self.value, self.default = setting, value, default
        self.previous: list[int | None] = []  # a stack: the same object may be entered again inside its block

    def __enter__(self) -> None:
        self.previous.append(getattr(_local, self.setting, self.default))
        setattr(_local, self.setting, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(_local, self.setting, self.previous.pop())
