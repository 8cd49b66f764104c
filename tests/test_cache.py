"""The persistent kernel cache: reuse across processes, integrity, privacy, concurrency."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, time, numpy as np
    import sparse_mlir as sm
    from sparse_mlir.compiler.driver import stats
    a = np.zeros((16, 12)); a[::3, ::2] = 1.5
    start = time.perf_counter()
    k = sm.compile("y[i] = A[i,j] * x[j] * 3", formats={"A": "csr"})
    y = k(A=sm.SparseTensor.from_dense(a, "csr"), x=np.ones(12))
    elapsed = time.perf_counter() - start
    assert np.array_equal(y, a @ np.ones(12) * 3)
    print(json.dumps({**stats, "ms": elapsed * 1e3}))
""")


def run(cache: Path) -> dict:
    env = {**os.environ, "SPARSE_MLIR_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kernel_libraries(cache: Path) -> list[Path]:
    """The kernels' libraries in a cache (which also holds the C call path's module, ``ext-*``, and the OpenMP pool,
    ``lib-*``)."""
    return [p for p in cache.rglob("*.so") if not p.name.startswith(("ext-", "lib-"))]


def test_second_process_reuses_the_first_ones_kernel(tmp_path):
    first, second = run(tmp_path / "c"), run(tmp_path / "c")
    assert first["compiled"] == 1 and second["compiled"] == 0 and second["loaded"] == 1
    assert second["ms"] < first["ms"]


def test_cache_dir_is_private(tmp_path):
    run(tmp_path / "c")
    for folder in [tmp_path / "c", *(p for p in (tmp_path / "c").iterdir() if p.is_dir())]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_corrupted_entries_are_rebuilt(tmp_path):
    run(tmp_path / "c")
    libs = _kernel_libraries(tmp_path / "c")
    assert len(libs) == 1
    libs[0].write_bytes(b"garbage")  # a truncated or corrupted library fails its checksum
    assert run(tmp_path / "c")["compiled"] == 1
    meta = next(p for p in (tmp_path / "c").rglob("*[0-9a-f].json") if not p.name.startswith(("ext-", "lib-")))
    meta.write_text("{ truncated")
    assert run(tmp_path / "c")["compiled"] == 1
    assert run(tmp_path / "c")["compiled"] == 0
    assert json.loads(meta.read_text())["sha256"]


def test_concurrent_processes_compile_once(tmp_path):
    env = {**os.environ, "SPARSE_MLIR_CACHE_DIR": str(tmp_path / "c")}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["compiled"] for r in results) == 1
    assert len(_kernel_libraries(tmp_path / "c")) == 1
    assert len(list((tmp_path / "c").rglob("ext-*.so"))) <= 1  # the C call path's module: built once too
