"""Our own OpenMP runtime for the kernels: ``kmp_pool.c``, a thread pool behind the ``__kmpc_*`` entry points.

A threaded kernel call wakes the pool's sleeping workers, and libiomp5 pays
for two wake-ups at each fork (a condition variable signalled under the
mutex the woken worker must take next) and often one more at the join; on
the 2-core VMs measured here each costs 20-40 us while the caller is busy.
``kmp_pool.c`` wakes with one futex call, lets the calling thread start at
once, and closes each region to workers that arrive after the caller has
finished its share (the kernels claim their work from shared counters, so
whoever is there does all of it).  A DLMC 512 x 512 SpMM at N=128 under
``KMP_BLOCKTIME=0``, two threads: 160-187 us on libiomp5, 57-77 on this
pool (100 on one thread).

Kernels compiled in this process link it (``threads.kernel_runtime``) unless
``SPARSE_MLIR_OWN_POOL=0`` or it cannot be built (no C compiler): then they
link libiomp5.  Exported kernels (``sparse_mlir.export``) keep libiomp5,
which an application links without us.

No MLIR here; the library is built once per machine into the kernel cache.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from sparse_mlir.compiler import driver
from sparse_mlir.errors import SparseMLIRError
from sparse_mlir.runtime.gomp_bridge import KMP_VERSION

__all__ = ["SOURCE", "library"]

SOURCE = Path(__file__).with_name("kmp_pool.c")


@functools.cache
def library() -> tuple[Path, ctypes.CDLL] | None:
    """The pool library's path and handle (built into the cache on first use), or ``None`` when it cannot be
    built or loaded here (kernels then link libiomp5)."""
    try:
        path = driver.c_library(SOURCE, "kmp_pool", ("pthread",), KMP_VERSION)
        handle = ctypes.CDLL(str(path))
    except (SparseMLIRError, OSError):  # no C compiler; a cache on a file system that may not map code
        return None
    handle.omp_set_num_threads.argtypes = [ctypes.c_int]
    handle.kmp_set_blocktime.argtypes = [ctypes.c_int]
    return path, handle
