"""Kernels on torch's thread pool (``runtime.gomp_bridge``): with libgomp in the process, threaded kernels link the
bridge and run their parallel loops as libgomp regions; every OpenMP entry point they import is the bridge's.

Each case runs in a fresh interpreter: which runtime kernels link is decided per process, at compile time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

# libgomp's workers spin after torch's operators unless told otherwise: the bridge serves only that case
_CHILD_ENV = {**{k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")},
              "SPARSE_MLIR_NUM_THREADS": "2"}


def _run(code: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**_CHILD_ENV, **env}, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_KERNELS = """
    import json, numpy as np, scipy.sparse as sp, torch
    import sparse_mlir as sm
    from sparse_mlir.runtime import threads
    rng = np.random.default_rng(0)
    A = sp.random(3000, 2000, density=0.02, format="csr", random_state=1, dtype=np.float64)
    S = sp.random(600, 500, density=0.05, format="csr", random_state=2, dtype=np.float64)
    x, B = rng.standard_normal(2000), rng.standard_normal((2000, 64))
    P, Q = rng.standard_normal((600, 16)), rng.standard_normal((16, 500))
    W = sp.random(300, 200, density=0.1, format="csr", random_state=3, dtype=np.float64)
    X = rng.standard_normal((700, 200))
    cases = {
        "spmv": (sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}), dict(A=A, x=x), A @ x),
        "spmm": (sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"}), dict(A=A, B=B), A @ B),
        "linear": (sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={"W": "csr"}), dict(X=X, W=W), X @ W.T),
        "sddmm": (sm.compile("C[i,j] = S[i,j] * P[i,k] * Q[k,j]", formats={"S": "csr", "C": "csr"}),
                  dict(S=S, P=P, Q=Q), S.multiply(P @ Q).toarray()),
        "spgemm": (sm.compile("C[i,j] = A[i,k] * D[k,j]", formats={"A": "csr", "D": "csr", "C": "csr"}),
                   dict(A=A, D=A.T.tocsr()), (A @ A.T).toarray()),
    }
    errors, libraries = {}, set()
    for name, (kernel, operands, want) in cases.items():
        with threads.fixed(2):
            got = kernel(**operands)
        got = got.toarray() if hasattr(got, "toarray") else np.asarray(got)
        errors[name] = float(np.abs(got - want).max())
    from sparse_mlir.runtime import kmp_pool
    print(json.dumps({"errors": errors, "runtime": str(threads.kernel_runtime()),
                      "loaded": [str(p) for p in threads._loaded], "pool": str(kmp_pool.library()[0])}))
"""


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
    found = _run(_KERNELS + """
    import subprocess
    from sparse_mlir.compiler import cache
    exported = subprocess.run(["nm", "-D", "--defined-only", threads.kernel_runtime()], capture_output=True,
                              text=True, check=True).stdout
    names = {line.split()[-1].split("@")[0] for line in exported.splitlines()}
    imported = set()
    for path in cache.cache_dir().rglob("*.so"):
        out = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True).stdout
        imported |= {line.split()[-1].split("@")[0] for line in out.splitlines()
                     if "__kmpc_" in line or " omp_" in line}
    print(json.dumps({"missing": sorted(imported - names), "imported": sorted(imported)}))
    """, SPARSE_MLIR_CACHE_DIR=str(tmp_path / "cache"))
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
