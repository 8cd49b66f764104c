"""Concurrency and memory under load: threads, the GIL, RSS growth, the LRU of loaded kernels."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import sparse_mlir as sm
from sparse_mlir.compiler import driver


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_eight_threads_compile_each_distinct_kernel_once():
    a = np.arange(30.0).reshape(5, 6) % 4
    A = sm.SparseTensor.from_dense(a, "csr")
    x = np.arange(6.0)
    factors = [101, 103, 107]  # three distinct kernels, new to this process
    before = driver.stats["compiled"]
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(t: int) -> None:
        try:
            barrier.wait()
            for r in range(6):
                f = factors[(t + r) % 3]
                k = sm.compile(f"y[i] = A[i,j] * x[j] * {f}", formats={"A": "csr"})
                np.testing.assert_array_equal(k(A=A, x=x), a @ x * f)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert driver.stats["compiled"] - before <= 3  # fewer if an earlier run left them on disk


def test_calls_release_the_gil():
    k = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"})
    k(A=sm.SparseTensor.from_dense(np.eye(3), "csr"), x=np.ones(3))
    library = k.specializations[0].native.library
    assert isinstance(library, ctypes.CDLL) and not isinstance(library, ctypes.PyDLL)


def test_many_calls_do_not_grow_memory():
    k = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"})
    A = sm.SparseTensor.from_dense(np.eye(8), "csr")
    B = np.ones((8, 4))
    add = sm.compile("C[i,j] = A[i,j] + B[i,j]", formats={"A": "csr", "B": "csr", "C": "csr"})
    for _ in range(2000):  # warm up allocator pools
        k(A=A, B=B)
        add(A=A, B=A)
    start = rss_bytes()
    for _ in range(50_000):
        k(A=A, B=B)
        add(A=A, B=A)  # sparse results own malloc-ed buffers: they must be freed
    growth = rss_bytes() - start
    assert growth < 5 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 100,000 calls"


LRU_SCRIPT = textwrap.dedent("""
    import json, numpy as np, sparse_mlir as sm
    from sparse_mlir.compiler import driver
    from sparse_mlir.runtime import cpu as rk
    A = sm.SparseTensor.from_dense(np.eye(4), "csr")
    kernels = [sm.compile(f"y[i] = A[i,j] * x[j] + {n}", formats={"A": "csr"}) for n in range(COUNT)]
    for n, k in enumerate(kernels):
        assert np.array_equal(k(A=A, x=np.ones(4)), np.ones(4) + n)
    loaded = len(rk._loaded)
    compiled = driver.stats["compiled"]
    assert np.array_equal(kernels[0](A=A, x=np.ones(4)), np.ones(4))  # evicted: reloaded from disk
    print(json.dumps({"loaded": loaded, "compiled": compiled, "recompiled": driver.stats["compiled"] - compiled,
                      "rss": int(open("/proc/self/statm").read().split()[1]) * 4096}))
""")


def run_lru(count: int, limit: int, cache) -> dict:
    env = {**os.environ, "SPARSE_MLIR_MAX_LOADED_KERNELS": str(limit), "SPARSE_MLIR_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", LRU_SCRIPT.replace("COUNT", str(count))], capture_output=True,
                         text=True, env=env, timeout=3600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loaded_kernels_are_bounded(tmp_path):
    result = run_lru(8, 3, tmp_path)
    assert result["loaded"] == 3 and result["compiled"] == 8 and result["recompiled"] == 0


@pytest.mark.slow
def test_five_hundred_kernels_stay_bounded(tmp_path):
    result = run_lru(500, 64, tmp_path)
    assert result["loaded"] == 64 and result["rss"] < 600 * 2**20
