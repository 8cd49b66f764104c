"""sparse_mlir.dask: sharded products against scipy, kernels on workers without MLIR, failures, CG.

Most tests run on Dask's synchronous scheduler (fast, same code path for the
graphs); the worker-process behaviour (shipped exports, the shared disk
cache, a killed worker, errors crossing processes) runs on LocalClusters of
processes bound to 127.0.0.1 (the scheduler's HTTP routes too, on a free port).
"""

from __future__ import annotations

import gzip
import os
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from support.data import require

dask = require("dask")
distributed = require("distributed")
import dask.array as da  # noqa: E402
from dask.core import get_dependencies  # noqa: E402

import sparse_mlir as sm  # noqa: E402
import sparse_mlir.io.matrix_files  # noqa: E402,F401
from sparse_mlir.dask import ColumnShardedMatrix, RowShardedMatrix, cg, poisson3d  # noqa: E402
from sparse_mlir.errors import InvalidIndicesError, ShapeError, SparseMLIRError  # noqa: E402
from support.kernels import SPARSIFIED_SPMV

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "suitesparse"


@pytest.fixture
def sync():
    with dask.config.set(scheduler="sync"):
        yield


def _random(rng: np.random.Generator, rows: int, cols: int, density: float, dtype: str = "float64") -> sp.csr_matrix:
    m = sp.random(rows, cols, density=density, format="lil", dtype=dtype, random_state=rng)
    m[:, 0] = 1  # entries in the first and last columns on every row: every block's window is full width,
    m[:, -1] = 2  # so blocks of one row count share an export (fewer compiles, a faster test)
    m = m.tocsr()
    m.data[:] = rng.integers(1, 5, m.nnz)  # exact in every dtype: results compare exactly
    return m


# -- products against scipy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_row_sharded_spmv_and_spmm_match_scipy(sync, rng, dtype):
    m = _random(rng, 230, 170, 0.05, dtype)
    a = RowShardedMatrix.from_scipy(m, 60).persist()
    assert a.layout.row_chunks == (60, 60, 60, 50)
    x = rng.integers(-3, 4, 170).astype(dtype)
    b = rng.integers(-3, 4, (170, 6)).astype(dtype)
    y = a @ x
    assert y.chunks == ((60, 60, 60, 50),)
    np.testing.assert_array_equal(y.compute(), m @ x)
    np.testing.assert_array_equal((a @ da.from_array(x, chunks=45)).compute(), m @ x)
    np.testing.assert_array_equal((a @ b).compute(), m @ b)
    np.testing.assert_array_equal((a @ da.from_array(b, chunks=(40, 4))).compute(), m @ b)


def test_a_shape_generic_kernel_is_exported_once_for_blocks_of_every_shape(sync, rng):
    from sparse_mlir.distributed.kernels import make_plan

    m = sp.random(230, 170, density=0.05, format="csr", random_state=rng)  # windows differ from block to block
    a = RowShardedMatrix.from_scipy(m, 60).persist()
    keys = a.layout.block_keys()
    assert len({k[0] for k in keys}) > 1
    plan = make_plan("y[i] = A[i,k] * x[k]", "A", {"A": sm.CSR}, "float64", keys, ship="artifact")
    assert [k for k, _ in plan.artifacts] == [(None, 32, 32)]  # one export, not one per block shape
    x = rng.random(170)
    np.testing.assert_allclose((a @ x).compute(), m @ x, rtol=1e-12)
    per_shape = make_plan(SPARSIFIED_SPMV, "A", {"A": sm.CSC}, "float64", keys, ship="artifact")
    assert {k for k, _ in per_shape.artifacts} == keys  # a sparsifier kernel: one export per block shape


def test_banded_blocks_read_only_their_window(sync):
    p = poisson3d(6)  # bandwidth 36 over 216 rows
    a = RowShardedMatrix.from_scipy(p, 54)
    inner = a.layout.windows[1]
    assert inner == (54 - 36, 108 + 36)
    x = da.from_array(np.arange(216.0), chunks=54)
    y = a @ x
    # block 0's task reads only the x chunks its window overlaps (0 and 1), not all four
    graph = dict(y.dask)
    reads = set(get_dependencies(graph, (y.name, 0))) - {k for k in graph if "plan" in str(k)}
    assert reads == {(x.name, 0), (x.name, 1), a.blocks.__dask_keys__()[0][0]}
    np.testing.assert_allclose(y.compute(), p @ np.arange(216.0))


def test_transpose_is_a_tree_reduction(sync, rng):
    m = _random(rng, 250, 90, 0.05)
    a = RowShardedMatrix.from_scipy(m, 50)  # five blocks
    x = rng.integers(-3, 4, 250).astype("float64")
    y = a.T @ x
    sums = [k for k in dict(y.dask) if isinstance(k, tuple) and "-sum" in str(k[0])]
    assert len(sums) == 3 + 2 + 1  # pairs of 5, then of 3, then the root pair
    np.testing.assert_array_equal(y.compute(), m.T @ x)
    np.testing.assert_array_equal((a.T @ da.from_array(x, chunks=70)).compute(), m.T @ x)
    xs = rng.integers(-3, 4, (250, 3)).astype("float64")
    np.testing.assert_array_equal((a.T @ xs).compute(), m.T @ xs)
    c = ColumnShardedMatrix.from_scipy(m.T.tocsr(), 30)
    assert c.shape == (90, 250)
    np.testing.assert_array_equal((c @ x).compute(), m.T @ x)


def test_any_compiled_kernel_maps_over_row_blocks(sync, rng):
    m = _random(rng, 120, 80, 0.1)
    a = RowShardedMatrix.from_scipy(m, 50)
    x, bias, s = rng.normal(size=80), rng.normal(size=120), rng.normal(size=120)
    fused = sm.compile("y[i] = relu(A[i,j] * x[j] + b[i])", formats={"A": "csr"}, dtype="float64")
    np.testing.assert_allclose(a.map_kernel(fused, x=x, b=bias).compute(), np.maximum(m @ x + bias, 0))
    scaled = a.map_kernel(sm.compile("C[i,j] = A[i,j] * s[i]", formats={"A": "csr", "C": "csr"}, dtype="float64"),
                          s=da.from_array(s, chunks=40))
    assert isinstance(scaled, RowShardedMatrix)
    np.testing.assert_allclose(scaled.to_scipy().toarray(), (sp.diags(s) @ m).toarray())
    sampled = sm.compile("C[i,j] = A[i,j] * D[i,j]", formats={"A": "csr"}, dtype="float64")
    d = rng.normal(size=(120, 80))
    np.testing.assert_allclose(a.map_kernel(sampled, D=d).compute(), m.multiply(d).toarray())
    with pytest.raises(SparseMLIRError, match="first index"):
        a.map_kernel(sm.compile("y[j] = A[i,j] * x[i]", formats={"A": "csr"}, dtype="float64"), x=bias)


def test_from_file_reads_blocks_on_the_workers(sync, rng, tmp_path):
    m = _random(rng, 140, 90, 0.08)
    sm.io.write_mtx(m, tmp_path / "m.mtx.gz")
    sm.save_tensor(sm.SparseTensor.from_scipy(m), tmp_path / "m.smt", compression="none")
    x = rng.normal(size=90)
    for name in ("m.mtx.gz", "m.smt"):
        a = RowShardedMatrix.from_file(tmp_path / name, 32)
        assert a.layout.row_chunks == (32, 32, 32, 32, 12)
        assert (a.to_scipy() != m).nnz == 0
        np.testing.assert_allclose((a @ x).compute(), m @ x)


def test_from_blocks_takes_tensors_scipy_and_delayed(sync, rng):
    parts = [_random(rng, r, 50, 0.1) for r in (20, 35, 15)]
    whole = sp.vstack(parts, format="csr")
    chunks = [sm.SparseTensor.from_scipy(parts[0]), parts[1], dask.delayed(parts[2])]
    a = RowShardedMatrix.from_blocks(chunks, 50, row_sizes=[20, 35, 15], dtype="float64")
    x = rng.normal(size=50)
    np.testing.assert_allclose((a @ x).compute(), whole @ x)


def test_a_bad_chunk_raises_the_library_error_naming_it(sync, rng):
    good = _random(rng, 10, 30, 0.2)
    bad = _random(rng, 10, 30, 0.2)
    bad.indices[3] = 99  # out of range: scipy does not check, our conversion on the worker must
    a = RowShardedMatrix.from_blocks([good, bad, good])
    with pytest.raises(InvalidIndicesError, match=r"chunk 1 \(rows 10:20\)"):
        (a @ np.ones(30)).compute()
    lying = RowShardedMatrix.from_blocks([good, dask.delayed(good)], 30, row_sizes=[10, 12], dtype="float64")
    with pytest.raises(ShapeError, match=r"chunk 1 \(rows 10:22\).*\(10, 30\)"):
        (lying @ np.ones(30)).compute()
    with pytest.raises(SparseMLIRError, match=r"chunk \d \(rows \d+:\d+\): operand x has dtype float32"):
        # kernels never cast: the dtype error names the chunk too
        (RowShardedMatrix.from_blocks([good, good]) @ np.ones(30, np.float32)).compute()


# -- the conjugate-gradient solver ----------------------------------------------------------------------------

def _scipy_cg(m: sp.csr_matrix, b: np.ndarray, maxiter: int | None = None) -> tuple[np.ndarray, int]:
    count = [0]
    x, _ = sla.cg(m, b, rtol=1e-8, maxiter=maxiter, callback=lambda _: count.__setitem__(0, count[0] + 1))
    return x, count[0]


def test_cg_on_poisson_matches_scipy(sync):
    p = poisson3d(8)
    b = np.random.default_rng(3).normal(size=p.shape[0])
    result = cg(RowShardedMatrix.from_scipy(p, 256).persist(), b)
    reference, iterations = _scipy_cg(p, b)
    assert result.converged and result.residual < 1e-8
    assert abs(result.iterations - iterations) <= 1
    assert np.linalg.norm(result.x - reference) <= 1e-8 * np.linalg.norm(reference)
    assert np.linalg.norm(b - p @ result.x) <= 1.01e-8 * np.linalg.norm(b)


@pytest.mark.skipif(not (DATA / "bcsstk13.mtx.gz").exists(), reason="../shared/data has no bcsstk13")
def test_cg_on_bcsstk13_follows_scipy(sync):
    import scipy.io

    m = scipy.io.mmread(gzip.open(DATA / "bcsstk13.mtx.gz")).tocsr()
    d = sp.diags(1 / np.sqrt(m.diagonal()))
    m = (d @ m @ d).tocsr()  # unit diagonal: plain CG converges (1447 steps in the example), still SPD
    b = np.ones(m.shape[0])
    result = cg(RowShardedMatrix.from_scipy(m, 1002).persist(), b, maxiter=40)
    reference, iterations = _scipy_cg(m, b, maxiter=40)
    assert result.iterations == iterations == 40
    # condition number 6e5: rounding differences (sums in another order) grow by about that much
    assert np.linalg.norm(result.x - reference) <= 1e-9 * 6e5 * np.linalg.norm(reference)


# -- worker processes -------------------------------------------------------------------------------------------

def _cluster(n_workers: int, **kwargs):
    return distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                    dashboard_address="127.0.0.1:0", **kwargs)


def _worker_state() -> dict:
    """Run on a worker: MLIR modules loaded, whether a compiler process was started, kernel counters."""
    from sparse_mlir.compiler import process as worker
    from sparse_mlir.compiler import driver

    return {"mlir": sorted(m for m in sys.modules if m == "mlir" or m.startswith("mlir.")),
            "compiler": worker._compiler is not None, "stats": dict(driver.stats)}


@pytest.fixture(scope="module")
def no_mlir_client(tmp_path_factory):
    """Two worker processes that cannot use MLIR: ``import mlir`` fails in them and in any compiler they start."""
    folder = tmp_path_factory.mktemp("no_mlir")
    (folder / "mlir").mkdir()
    (folder / "mlir" / "__init__.py").write_text("raise ImportError('this worker has no MLIR')\n")
    preload = folder / "block_mlir.py"
    preload.write_text(f"import sys\nsys.path.insert(0, {str(folder)!r})\n"
                       "for name in [m for m in sys.modules if m == 'mlir' or m.startswith('mlir.')]:\n"
                       "    del sys.modules[name]\n")
    with _cluster(2, preload=[str(preload)]) as cluster, distributed.Client(cluster) as client:
        yield client


def test_workers_without_mlir_run_shipped_exports(no_mlir_client, rng):
    client = no_mlir_client
    m = _random(rng, 300, 200, 0.05)
    a = RowShardedMatrix.from_scipy(m, 100).persist()  # three 100-row blocks: one export per window shape
    x = rng.integers(-3, 4, 200).astype("float64")
    np.testing.assert_array_equal((a @ x).compute(), m @ x)
    np.testing.assert_array_equal((a.T @ np.ones(300)).compute(), m.T @ np.ones(300))
    for state in client.run(_worker_state).values():
        assert state == {"mlir": [], "compiler": False, "stats": {"compiled": 0, "loaded": 0, "densified": 0}}
    # the same workers cannot compile: the shipped exports were all they ran
    compiling = RowShardedMatrix.from_scipy(m[:100], 100, ship="compile")  # one block: one failed compile
    with pytest.raises(SparseMLIRError, match=r"chunk 0 \(rows 0:100\)"):
        (compiling @ x).compute()


def test_a_bad_chunk_error_crosses_processes_with_its_class_and_chunk(no_mlir_client, rng):
    good, bad = _random(rng, 10, 30, 0.2), _random(rng, 10, 30, 0.2)
    bad.indptr[4] = bad.indptr[6]  # positions that go back down: refused on the worker, before any kernel
    with pytest.raises(InvalidIndicesError, match=r"chunk 2 \(rows 20:30\)"):
        (RowShardedMatrix.from_blocks([good, good, bad]) @ np.ones(30)).compute()


def test_a_killed_worker_is_retried_without_a_wrong_result(no_mlir_client, rng, tmp_path):
    client = no_mlir_client
    marker = tmp_path / "killed"
    m = _random(rng, 400, 400, 0.03)
    a = RowShardedMatrix.from_scipy(m, 100).persist()
    distributed.wait(a.blocks)

    def die_once(chunk: np.ndarray) -> np.ndarray:
        distributed.get_worker()  # raises anywhere but on a worker: never end the test's own process
        try:  # created atomically: with two workers racing here, exactly one of them dies
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return chunk
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os._exit(1)  # the worker process ends mid-computation, holding some of A's blocks

    x = da.from_array(rng.normal(size=400), chunks=100)
    for attempt in range(3):
        product = a @ x.map_blocks(die_once, meta=np.empty(0, x.dtype))
        try:
            y = product.compute()
            break
        except distributed.client.FutureCancelledError:
            # the persisted blocks the dead worker held are lost for good ("lost dependencies"): persist again
            a = RowShardedMatrix.from_scipy(m, 100).persist()
            # a race in distributed itself: when the dying worker held the persisted blocks, the scheduler may
            # cancel the whole graph ("already forgotten") instead of rerunning it; the caller then gets an
            # error, never a wrong or partial result, and the same graph runs again. (The plan is scattered to
            # every worker, so it survives one death; before the marker was atomic, both workers could die
            # and take every copy with them, which no retry recovers: CI saw that once.)
            if attempt == 2:
                raise
    np.testing.assert_allclose(y, m @ x.compute())
    killed = int(marker.read_text())  # the kill happened, and its worker is gone (the nanny started another)
    assert killed not in client.run(os.getpid).values()
    assert not psutil.pid_exists(killed)


def test_workers_with_the_compiler_share_the_disk_cache(rng):
    m = _random(rng, 200, 120, 0.05)
    a = RowShardedMatrix.from_scipy(m, 100, ship="compile")
    spmv = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}, dtype="float64")
    with dask.config.set(scheduler="sync"):
        for block in dask.compute(*a.block_list()):
            spmv(A=block, x=np.zeros(block.shape[1]))  # the client compiles each block shape into the disk cache
    x = rng.normal(size=120)
    with _cluster(1) as cluster, distributed.Client(cluster) as client:
        np.testing.assert_allclose((a @ x).compute(), m @ x)
        (state,) = client.run(_worker_state).values()
    assert state["stats"]["compiled"] == 0 and state["stats"]["loaded"] >= 1


def test_bad_chunks_operands_and_solver_breakdowns_are_refused(sync):
    """An attacker's audit: a 0-row chunk was dropped by dask's concatenate and the blocks paired with the wrong
    rows ("Missing dependency"); CG divided by zero on a matrix that is not positive definite and reported a
    complex right-hand side "converged" with its imaginary part dropped; a list operand was an AttributeError."""
    from sparse_mlir.errors import DTypeError, OperandError

    m = sp.random(10, 8, density=0.4, format="csr", random_state=0)
    for chunks in ((6, 0, 4), (2.5, 7.5), True, "3"):
        with pytest.raises(ShapeError, match="chunks"):
            RowShardedMatrix.from_scipy(m, chunks)
    assert RowShardedMatrix.from_scipy(m, np.int64(4)).layout.row_chunks == (4, 4, 2)
    with pytest.raises(OperandError, match="numpy or Dask"):
        RowShardedMatrix.from_scipy(m, 4) @ [1.0] * 8
    square = sp.csr_matrix((3, 3))
    with pytest.raises(OperandError, match="positive definite"):
        cg(RowShardedMatrix.from_scipy(square, 2), np.ones(3))
    p = poisson3d(3)
    with pytest.raises(DTypeError, match="complex128"):
        cg(RowShardedMatrix.from_scipy(p, 7), np.ones(27) * (1 + 1j))
    exact = cg(RowShardedMatrix.from_scipy(p, 7), np.ones(27), rtol=0.0)
    assert exact.converged and exact.residual == 0.0  # rtol=0 reached an exact zero, then divided by it
