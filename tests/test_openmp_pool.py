"""Kernels on torch's thread pool (``runtime.gomp_bridge``): with libgomp in the process, threaded kernels link the
bridge and run their parallel loops as libgomp regions; every OpenMP entry point they import is the bridge's.

Each case runs in a fresh interpreter: which runtime kernels link is decided per process, at compile time.
"""

from __future__ import annotations

import os

import pytest
from support.processes import ENTRY_POINTS, run_python, threaded_kernels

pytest.importorskip("torch")

# libgomp's workers spin after torch's operators unless told otherwise: the bridge serves only that case
_CHILD_ENV = {**{k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")},
              "SPARSE_MLIR_NUM_THREADS": "2"}


def _run(code: str, **env: str) -> dict:
    return run_python(code, {**_CHILD_ENV, **env})


_KERNELS = threaded_kernels((2,), with_torch=True)


def test_with_torch_loaded_threaded_kernels_run_on_its_pool_and_agree_with_scipy():
    found = _run(_KERNELS)
    assert all(error < 1e-9 for error in found["errors"].values()), found["errors"]
    assert "libiomp5" not in found["runtime"] and found["loaded"] == [found["runtime"]]


def test_the_pool_can_be_kept_apart():
    found = _run(_KERNELS, SPARSE_MLIR_SHARE_POOL="0")
    assert all(error < 1e-9 for error in found["errors"].values()), found["errors"]
    assert found["runtime"] == found["pool"]


@pytest.mark.parametrize("setting", [{"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "passive"}])
def test_when_torchs_workers_sleep_at_once_kernels_keep_our_pool(setting):
    """Then sharing gains no awake workers, and our pool's forks cost less than libgomp's regions."""
    found = _run(_KERNELS, **setting)
    assert all(error < 1e-9 for error in found["errors"].values()), found["errors"]
    assert found["runtime"] == found["pool"]


def test_every_openmp_entry_point_the_kernels_import_is_the_bridges(tmp_path):
    """The bridge stands in for libiomp5 only as far as the entry points it defines: a kernel importing another
    one would call libiomp5's inside a libgomp region.  Checked on every library the kernels above built into a
    fresh cache (SpMV, SpMM, Linear, SDDMM, SpGEMM: hand-scheduled and sparsified parallel loops)."""
    found = _run(_KERNELS + ENTRY_POINTS, SPARSE_MLIR_CACHE_DIR=str(tmp_path / "cache"))
    assert found["imported"] and not found["missing"], found


def test_without_libgomp_the_bridge_does_not_bind_and_runs_regions_serially():
    found = _run("""
    import ctypes, json
    from sparse_mlir.compiler import driver
    from sparse_mlir.runtime import gomp_bridge
    assert not gomp_bridge.libgomp_loaded()
    lib = ctypes.CDLL(str(driver.c_library(gomp_bridge.SOURCE, "kmp_on_gomp", ("dl",), gomp_bridge.KMP_VERSION)))
    # a microtask counting its runs through the region
    runs = []
    TASK = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p)
    task = TASK(lambda gtid, btid, shared: runs.append((gtid[0], shared)))
    lib.omp_set_num_threads(4)
    lib.__kmpc_fork_call(None, 1, task, ctypes.c_void_p(1234))
    print(json.dumps({"bound": lib.sparse_mlir_bind_libgomp(), "runs": runs, "bridge": gomp_bridge.bridge()}))
    """)
    assert found == {"bound": 0, "runs": [[0, 1234]], "bridge": None}


def test_a_forked_child_runs_its_kernels_without_waiting_for_the_parents_pool():
    """libgomp's workers do not exist in a forked child: a region there would wait for them for ever.  The child
    runs the parent's bridge-linked kernel on one thread and compiles new kernels against our own pool."""
    found = _run("""
    import json, os, numpy as np, scipy.sparse as sp, torch
    import sparse_mlir as sm
    from sparse_mlir.runtime import threads
    A = sp.random(3000, 2000, density=0.02, format="csr", random_state=1)
    B = np.random.default_rng(0).standard_normal((2000, 64))
    spmm = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"})
    with threads.fixed(2):
        spmm(A=A, B=B)  # the pool's workers now exist in this process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        with threads.fixed(2):
            ok = np.allclose(spmm(A=A, B=B), A @ B)
            spmv = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})
            ok = ok and np.allclose(spmv(A=A, x=np.ones(2000)), A @ np.ones(2000))
        os.write(write, json.dumps([ok, str(threads.kernel_runtime())]).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    ok, runtime = json.loads(os.read(read, 4096))
    from sparse_mlir.runtime import kmp_pool
    print(json.dumps({"status": os.waitstatus_to_exitcode(status), "ok": ok, "child_runtime": runtime,
                      "pool": str(kmp_pool.library()[0])}))
    """)
    assert found["status"] == 0 and found["ok"], found
    assert found["child_runtime"] == found["pool"]
