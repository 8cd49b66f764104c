"""Kernels on torch's thread pool: the LLVM OpenMP entry points they call, run by the process's libgomp.

torch's CPU wheel runs its operators on GCC's libgomp; our kernels are
lowered to LLVM's OpenMP interface (``__kmpc_*``) and link our own pool (``kmp_pool``).
With both in one process, two pools share the cores: libgomp's workers spin
for milliseconds after each torch operator on the cores our workers need, and
ours sleep between calls and must be woken (MiniLM 90%, 2 threads: 230 ms
against 187 with one pool, session 16).  ``kmp_on_gomp.c`` implements the
entry points the kernels import on the libgomp already loaded, so a kernel's
parallel loop is a region of torch's pool, whose workers are still awake
from the operator before.  Kernels compiled while libgomp is in the process
with spinning workers link this library instead of our pool (``kmp_pool``;
``threads.kernel_runtime``); it is
loaded locally, as their dependency, so no other library's lookups see it.
``SPARSE_MLIR_SHARE_POOL=0`` keeps our own pool.

No MLIR here; the library is built once per machine into the kernel cache.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from pathlib import Path

from sparse_mlir.compiler import driver
from sparse_mlir.errors import SparseMLIRError

__all__ = ["SOURCE", "bridge", "libgomp_loaded"]

SOURCE = Path(__file__).with_name("kmp_on_gomp.c")
# the symbol version libiomp5 gives its entry points: the kernels' references name it
KMP_VERSION = "VERSION"

_lock = threading.Lock()
_found_libgomp = False
_modules_seen = -1  # len(sys.modules) when the mappings were last read
_forked = False  # this process is a fork of one that may have run libgomp regions


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def libgomp_loaded() -> bool:
    """Whether GCC's OpenMP runtime is mapped into this process (torch imported, or any other user of it).

    Looked up again only after new modules were imported (an extension
    module is what brings libgomp in): reading the process's mappings on
    every ``compile`` of a torch-free program would cost more than planning.
    """
    global _found_libgomp, _modules_seen
    if not _found_libgomp and len(sys.modules) != _modules_seen:
        _modules_seen = len(sys.modules)
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                _found_libgomp = any("libgomp" in line for line in maps)
        except OSError:
            return False
    return _found_libgomp


@functools.cache
def _built_and_bound() -> tuple[Path, ctypes.CDLL] | None:
    try:
        path = driver.c_library(SOURCE, "kmp_on_gomp", ("dl",), KMP_VERSION)
        library = ctypes.CDLL(str(path))
    except (SparseMLIRError, OSError):  # no C compiler; a cache on a file system that may not map code
        return None
    if library.sparse_mlir_bind_libgomp() != 1:
        return None
    library.omp_set_num_threads.argtypes = [ctypes.c_int]
    return path, library


def bridge() -> tuple[Path, ctypes.CDLL] | None:
    """The bridge library's path and handle, bound to this process's libgomp; ``None`` when libgomp is not
    loaded, the library cannot be built or bound here, or this process is a fork (kernels then link our pool).

    Why not in a fork: libgomp's pool threads do not exist in the child, and
    a region there waits for them for ever (torch too runs its operators on
    one thread after a fork).  A bridge loaded before the fork runs its
    regions on the calling thread in the child (``kmp_on_gomp.c``).
    """
    if _forked or not libgomp_loaded():
        return None
    with _lock:
        return _built_and_bound()
