"""The one GPU run: correctness of every exported kernel, then the issue's benchmark, with CuPy alone.

Runs on the device from a bundle made by ``prepare_bundle.py`` (no MLIR,
no network, no scipy needed): ``python BUNDLE/device_check.py BUNDLE``.
Prints a table and writes ``$OUT/gpu_results.json`` (or ``BUNDLE/...``).
Exit status 1 when a correctness check fails.

Timing: CUDA events around repeated launches on one stream, median of
rounds, every system timed in the same process (cupyx/cuSPARSE, cupy
matmul with TF32 off, torch when present).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

BUNDLE = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent).resolve()
sys.path.insert(0, str(next(BUNDLE.glob("sparse_mlir-*.whl"))))  # a pure-Python wheel imports from the zip
os.environ.setdefault("CUPY_TF32", "0")

import cupy as cp  # noqa: E402
import cupyx.scipy.sparse as csp  # noqa: E402

import sparse_mlir as sm  # noqa: E402
from sparse_mlir.timing import gpu_seconds  # noqa: E402
from sparse_mlir.tensor.device import DeviceSparseTensor  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
PLAN = json.loads((BUNDLE / "plan.json").read_text())
RESULTS: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "checks": [], "bench": {}}


def kernel(name: str):
    return sm.load_kernel(BUNDLE / "kernels" / name / f"{name}.json")


def gpu_time(fn, repeat: int = 20, rounds: int = 5) -> float:
    """Median seconds per call over ``rounds`` of ``repeat`` back-to-back launches (CUDA events)."""
    return gpu_seconds(fn, cp, repeat, rounds)


def read_smtx(path: Path) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
    """Shape, row offsets and column indices of a DLMC ``.smtx.gz`` (values are not stored there)."""
    with gzip.open(path, "rt") as f:
        rows, cols, _ = (int(v) for v in f.readline().split(","))
        indptr = np.array(f.readline().split(), dtype=np.int32)
        indices = np.array(f.readline().split(), dtype=np.int32)
    return (rows, cols), indptr, indices


# -- correctness -------------------------------------------------------------------------------------------
def check_all() -> bool:
    rng = np.random.default_rng(0)
    ok = True
    for item in PLAN["check"]:
        name, kind, fmt, dtype = item["name"], item["kind"], item["format"], item["dtype"]
        out_dtype = item.get("out_dtype", dtype)  # float16 kernels may keep their float32 sums
        dense = (rng.standard_normal((96, 64)) * (rng.random((96, 64)) < 0.2)).astype(dtype)
        if fmt == "dense":
            dense = rng.standard_normal((96, 64)).astype(dtype)
        if fmt == "2:4":
            groups = rng.standard_normal((96, 16, 4))
            order = np.argsort(-np.abs(groups), axis=2)
            np.put_along_axis(groups, order[:, :, 2:], 0, axis=2)
            dense = groups.reshape(96, 64).astype(dtype)
        dense[5] = 0  # an empty row
        a = cp.asarray(dense) if fmt == "dense" else sm.SparseTensor.from_dense(dense, fmt).to("cuda")
        k = kernel(name)
        if kind == "spmv":
            x = rng.standard_normal(64).astype(dtype)
            got = k(A=a, x=cp.asarray(x))
            ref = (cp.asarray(dense, dtype=cp.float64) @ cp.asarray(x, dtype=cp.float64)).astype(out_dtype)
        elif kind in ("sum", "dot"):  # total reductions: a 0-d result
            x = rng.standard_normal(64).astype(dtype)
            got = k(A=a, x=cp.asarray(x)) if kind == "dot" else k(A=a)
            ref = cp.asarray(dense, dtype=cp.float64)
            ref = (ref @ cp.asarray(x, dtype=cp.float64) if kind == "dot" else ref).sum().astype(out_dtype)
        elif kind == "linear":  # Y = X W^T, torch.nn.Linear's orientation
            x = rng.standard_normal((40, 64)).astype(dtype)
            got = k(A=a, X=cp.asarray(x))
            ref = (cp.asarray(x, dtype=cp.float64) @ cp.asarray(dense, dtype=cp.float64).T).astype(out_dtype)
        else:
            b = rng.standard_normal((64, 40)).astype(dtype)
            args = {"A": a, "B": cp.asarray(b)}
            ref = (cp.asarray(dense, dtype=cp.float64) @ cp.asarray(b, dtype=cp.float64)).astype(out_dtype)
            if kind == "spmm_bias":
                bias = rng.standard_normal(40).astype(dtype)
                args["b"] = cp.asarray(bias)
                ref = ref + cp.asarray(bias)
            got = k(**args)
        err = float(cp.max(cp.abs(got.astype(cp.float64) - ref)) / max(float(cp.max(cp.abs(ref))), 1e-30))
        passed = err < {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[out_dtype] and got.dtype == out_dtype
        ok &= passed
        RESULTS["checks"].append({"kernel": name, "notes": k.function.program.notes, "rel_err": err,
                                  "ok": passed})
        print(f"{'ok  ' if passed else 'FAIL'} {name:40s} {','.join(k.function.program.notes):8s} err {err:.1e}")
    return ok


def check_generic() -> bool:
    """Each shape-generic export (no shapes: every size a run-time one) at sizes that pick different tilings."""
    rng = np.random.default_rng(1)
    ok = True
    for item in PLAN.get("generic", []):
        name, kind = item["name"], item["kind"]
        k = kernel(name)
        dtype = k.signature.inputs[0].dtype
        passed, worst = k.shape_generic, 0.0
        sizes = ((96, 64, 40), (1000, 37, 301), (3000, 200, 64), (2500, 50, 1000))
        for rows, inner, cols in sizes:
            dense = (rng.standard_normal((rows, inner)) * (rng.random((rows, inner)) < 0.1)).astype(dtype)
            dense[rows // 2] = rng.standard_normal(inner)  # one full row among short ones
            a = sm.SparseTensor.from_dense(dense, "csr").to("cuda")
            ref = cp.asarray(dense, dtype=cp.float64)
            if kind == "spmv":
                x = rng.standard_normal(inner).astype(dtype)
                got, ref = k(A=a, x=cp.asarray(x)), ref @ cp.asarray(x, dtype=cp.float64)
            else:
                b, bias = rng.standard_normal((inner, cols)).astype(dtype), rng.standard_normal(cols).astype(dtype)
                got = k(A=a, B=cp.asarray(b), b=cp.asarray(bias))
                ref = ref @ cp.asarray(b, dtype=cp.float64) + cp.asarray(bias, dtype=cp.float64)
            err = float(cp.max(cp.abs(got.astype(cp.float64) - ref)) / max(float(cp.max(cp.abs(ref))), 1e-30))
            worst = max(worst, err)
            passed &= err < {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype.name] and \
                got.shape == ref.shape
        ok &= passed
        RESULTS["checks"].append({"kernel": name, "notes": k.function.program.notes, "rel_err": worst,
                                  "ok": passed, "sizes": len(sizes)})
        print(f"{'ok  ' if passed else 'FAIL'} {name:40s} {len(sizes)} sizes, one build, err {worst:.1e}")
    return ok


def sddmm_operands(rng, rows: int, cols: int, inner: int, density: float, dtype) -> tuple:
    """A CSR ``S`` on the device (a few rows empty) and dense ``A`` ``[rows, inner]``, ``B`` ``[inner, cols]``."""
    mask = rng.random((rows, cols)) < density
    mask[rng.choice(rows, max(1, rows // 50), replace=False)] = False  # empty rows
    dense = (rng.uniform(-1, 1, (rows, cols)) * mask).astype(dtype)
    s = sm.SparseTensor.from_dense(dense, "csr").to("cuda")
    a = cp.asarray(rng.uniform(-1, 1, (rows, inner)).astype(dtype))
    b = cp.asarray(rng.uniform(-1, 1, (inner, cols)).astype(dtype))
    return s, a, b


def sddmm_reference(s: DeviceSparseTensor, a, b):
    """``S[i,j] * (A @ B)[i,j]`` at S's entries, in float64: each entry's dot product, gathered on the device."""
    indptr, indices, data = s.buffers
    rows = cp.searchsorted(indptr, cp.arange(indices.size), side="right") - 1  # the row of each entry
    products = (a.astype(cp.float64)[rows] * b.astype(cp.float64).T[indices]).sum(axis=1)
    return data.astype(cp.float64) * products


def check_sddmm() -> bool:
    """Each SDDMM export (shape-generic, CSR result) at several sizes: C keeps S's pattern, its values match."""
    rng = np.random.default_rng(2)
    ok = True
    for name in PLAN.get("sddmm", []):
        k = kernel(name)
        dtype = k.signature.inputs[0].dtype
        passed, worst = k.shape_generic, 0.0
        sizes = ((96, 64, 32, 0.2), (1000, 300, 33, 0.05), (2048, 2048, 64, 0.01), (513, 77, 1, 0.1))
        for rows, cols, inner, density in sizes:
            s, a, b = sddmm_operands(rng, rows, cols, inner, density, dtype)
            c = k(S=s, A=a, B=b)
            ref = sddmm_reference(s, a, b)
            scale = max(float(cp.max(cp.abs(ref))), 1e-30) if ref.size else 1.0
            err = float(cp.max(cp.abs(c.buffers[2].astype(cp.float64) - ref))) / scale if ref.size else 0.0
            worst = max(worst, err)
            same_pattern = all(bool(cp.array_equal(mine, theirs)) and mine.data.ptr != theirs.data.ptr
                               for mine, theirs in zip(c.buffers[:2], s.buffers[:2]))
            passed &= err < {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}[dtype.name] and same_pattern and \
                c.shape == s.shape and c.buffers[2].dtype == dtype
        ok &= passed
        RESULTS["checks"].append({"kernel": name, "notes": k.function.program.notes, "rel_err": worst,
                                  "ok": passed, "sizes": len(sizes)})
        print(f"{'ok  ' if passed else 'FAIL'} {name:40s} {len(sizes)} sizes, one build, err {worst:.1e}")
    return ok


# -- benchmarks --------------------------------------------------------------------------------------------
def csr_on_device(rows: int, cols: int, per_row: int, dtype=cp.float32, banded: bool = False
                  ) -> tuple[DeviceSparseTensor, object]:
    """Sorted, duplicate-free rows of ``per_row`` nonzeros (made on the device).

    Scattered: one per column band, so ``x`` is gathered from anywhere.
    ``banded``: within ``4 * per_row`` columns of the diagonal, as a mesh
    matrix in a good ordering, so ``x`` is read nearly in order.
    """
    if banded:
        window = 4 * per_row
        first = cp.minimum(cp.arange(rows, dtype=cp.int64) * cols // rows, cols - window)[:, None]
        picks = cp.arange(per_row, dtype=cp.int64) * 4 + cp.random.randint(0, 4, size=(rows, per_row))
        indices = (first + picks).astype(cp.int32).ravel()  # one of every 4 columns: sorted, no duplicates
        indptr = cp.arange(rows + 1, dtype=cp.int32) * per_row
        data = cp.random.standard_normal(rows * per_row, dtype=cp.float32).astype(dtype)
        return (DeviceSparseTensor(sm.CSR, (rows, cols), (indptr, indices, data)),
                csp.csr_matrix((data, indices, indptr), shape=(rows, cols)))
    band = cols // per_row
    offsets = cp.random.randint(0, band, size=(rows, per_row), dtype=cp.int32)
    indices = (offsets + cp.arange(per_row, dtype=cp.int32) * band).ravel()
    indptr = cp.arange(rows + 1, dtype=cp.int32) * per_row
    data = cp.random.standard_normal(rows * per_row, dtype=cp.float32).astype(dtype)
    tensor = DeviceSparseTensor(sm.CSR, (rows, cols), (indptr, indices, data))
    return tensor, csp.csr_matrix((data, indices, indptr), shape=(rows, cols))


def best_of(names: list[str], run) -> tuple[str, float]:
    timed = {n: gpu_time(run(kernel(n))) for n in names}
    name = min(timed, key=timed.get)
    return name, timed[name]


def bench_spmv_big() -> None:
    """50M nonzeros, scattered columns (x gathered from all of its 8 MB) and banded (x read nearly in order)."""
    rows, cols = PLAN_SHAPES["spmv_big"]
    for label, banded in (("spmv_50M", False), ("spmv_50M_banded", True)):
        a, ref = csr_on_device(rows, cols, 25, banded=banded)
        x = cp.random.standard_normal(cols, dtype=cp.float32)
        name, ours = best_of(PLAN["spmv_big"], lambda k: (lambda: k(A=a, x=x)))
        got = kernel(name)(A=a, x=x)
        err = float(cp.max(cp.abs(got - ref @ x)))
        lib = gpu_time(lambda: ref @ x)
        nbytes = a.nnz * 8 + (rows + 1) * 4 + cols * 4 + rows * 4
        RESULTS["bench"][label] = {"variant": name, "ours_s": ours, "cupyx_s": lib, "max_err": err,
                                   "roofline_pct": 100 * nbytes / ours / HBM_BYTES_PER_S, "speedup": lib / ours}
        print(f"SpMV {rows}x{cols} nnz {a.nnz / 1e6:.0f}M {'banded' if banded else 'scattered'}: ours "
              f"{ours * 1e3:.3f} ms ({name}), cupyx {lib * 1e3:.3f} ms, {lib / ours:.2f}x, "
              f"{100 * nbytes / ours / HBM_BYTES_PER_S:.0f}% of 4.3 TB/s, max err {err:.1e}")


def bench_spmv_skewed() -> None:
    """Zipf row lengths (a few rows with hundreds of thousands of entries): row splitting vs not vs cuSPARSE."""
    auto_k, exact_k = (kernel(n) for n in PLAN["spmv_skewed"])
    rows, cols = PLAN_SHAPES["spmv_skewed"]
    lengths = np.minimum(np.random.default_rng(3).zipf(1.6, rows), cols // 2).astype(np.int64)
    indptr = cp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    lengths_d = cp.asarray(lengths)
    starts = (cp.random.random_sample(rows) * (cols - lengths_d)).astype(cp.int64)  # a run of columns per row
    row_of = cp.repeat(cp.arange(rows), lengths_d)
    offsets = cp.arange(int(lengths.sum())) - cp.repeat(indptr[:-1].astype(cp.int64), lengths_d)
    indices = (starts[row_of] + offsets).astype(cp.int32)
    data = cp.random.standard_normal(indices.size, dtype=cp.float32)
    a = DeviceSparseTensor(sm.CSR, (rows, cols), (indptr, indices, data), int(lengths.max()))
    ref = csp.csr_matrix((data, indices, indptr), shape=(rows, cols))
    x = cp.random.standard_normal(cols, dtype=cp.float32)
    expect = ref @ x
    errors = [float(cp.max(cp.abs(k(A=a, x=x) - expect)) / cp.max(cp.abs(expect))) for k in (auto_k, exact_k)]
    split, exact = (gpu_time(lambda k=k: k(A=a, x=x)) for k in (auto_k, exact_k))
    # the deterministic program's merge path (knobs.merge_spmv), read at each call: on for these calls only
    os.environ["SPARSE_MLIR_MERGE_SPMV"] = "1"
    try:
        merged = exact_k(A=a, x=x)
        errors.append(float(cp.max(cp.abs(merged - expect)) / cp.max(cp.abs(expect))))
        repeat = bool(cp.all(exact_k(A=a, x=x) == merged))  # deterministic: bit-identical on a second run
        merge = gpu_time(lambda: exact_k(A=a, x=x))
    finally:
        del os.environ["SPARSE_MLIR_MERGE_SPMV"]
    lib = gpu_time(lambda: ref @ x)
    RESULTS["bench"]["spmv_skewed"] = {"nnz": int(lengths.sum()), "longest_row": int(lengths.max()),
                                       "split_s": split, "deterministic_s": exact, "merge_path_s": merge,
                                       "merge_path_repeatable": repeat, "cupyx_s": lib, "rel_err": errors,
                                       "merge_vs_cupyx": lib / merge}
    print(f"SpMV skewed {rows} rows, longest {int(lengths.max())}, nnz {int(lengths.sum()) / 1e6:.1f}M: "
          f"split {split * 1e3:.3f} ms, deterministic {exact * 1e3:.3f} ms, merge path {merge * 1e3:.3f} ms "
          f"({lib / merge:.2f}x cupyx, repeatable {repeat}), cupyx {lib * 1e3:.3f} ms "
          f"({lib / split:.2f}x), rel err {'/'.join(f'{e:.1e}' for e in errors)}")


def as_format(tensor: DeviceSparseTensor, fmt: str) -> DeviceSparseTensor:
    """The CSR ``tensor`` stored as COO, CSC or DCSR on the device (every row stored)."""
    rows, cols = tensor.shape
    pos, crd, values = tensor.buffers
    if fmt == "coo":
        row_of = cp.repeat(cp.arange(rows, dtype=cp.int32), cp.diff(pos).astype(cp.int64))
        return DeviceSparseTensor(sm.COO, (rows, cols), (cp.asarray([0, crd.size], cp.int32), row_of, crd, values))
    if fmt == "dcsr":
        stored = cp.arange(rows, dtype=cp.int32)
        return DeviceSparseTensor(sm.DCSR, (rows, cols), (cp.asarray([0, rows], cp.int32), stored, pos, crd, values))
    row_of = cp.repeat(cp.arange(rows, dtype=cp.int32), cp.diff(pos).astype(cp.int64))
    order = cp.lexsort(cp.stack([row_of, crd]))  # by column, then row
    counts = cp.bincount(crd, minlength=cols)
    indptr = cp.concatenate([cp.zeros(1, cp.int64), cp.cumsum(counts)]).astype(cp.int32)
    return DeviceSparseTensor(sm.CSC, (rows, cols), (indptr, row_of[order], values[order]))


def bench_spmv_formats() -> None:
    """SpMV with COO, CSC and DCSR operands against cupyx's CSR SpMV on the same matrix (target >= 0.8x)."""
    rows, cols = PLAN_SHAPES["spmv_big"]
    a, ref = csr_on_device(rows, cols, 25)
    x = cp.random.standard_normal(cols, dtype=cp.float32)
    expect = ref @ x
    lib = gpu_time(lambda: ref @ x)
    for name in PLAN["spmv_formats"]:
        label = name.removeprefix("spmv_big_")  # coo, csc, dcsr, coo_deterministic
        tensor, k = as_format(a, label.split("_")[0]), kernel(name)
        err = float(cp.max(cp.abs(k(A=tensor, x=x) - expect)) / cp.max(cp.abs(expect)))
        ours = gpu_time(lambda k=k, tensor=tensor: k(A=tensor, x=x))
        launched = [launch.kernel for launch in k.function.program.launches]
        RESULTS["bench"][f"spmv_50M_{label}"] = {"ours_s": ours, "cupyx_csr_s": lib, "vs_cupyx_csr": lib / ours,
                                                 "rel_err": err, "kernels": launched}
        print(f"SpMV {rows}x{cols} nnz {a.nnz / 1e6:.0f}M as {label} ({','.join(launched)}): ours "
              f"{ours * 1e3:.3f} ms, cupyx CSR {lib * 1e3:.3f} ms ({lib / ours:.2f}x), rel err {err:.1e}")


def bench_spmm_big() -> None:
    n = PLAN_SHAPES["spmm_big"]
    a, ref = csr_on_device(n, n, n // 10)
    b = cp.random.standard_normal((n, n), dtype=cp.float32)
    name, ours = best_of(PLAN["spmm_big"], lambda k: (lambda: k(A=a, B=b)))
    got = kernel(name)(A=a, B=b)
    expect = ref @ b
    err = float(cp.max(cp.abs(got - expect)) / cp.max(cp.abs(expect)))
    lib = gpu_time(lambda: ref @ b, repeat=5)
    dense_a = ref.toarray()
    dense = gpu_time(lambda: dense_a @ b, repeat=5)
    RESULTS["bench"]["spmm_4096_90"] = {"variant": name, "ours_s": ours, "cusparse_s": lib, "dense_s": dense,
                                        "rel_err": err, "vs_cusparse": lib / ours, "vs_dense": dense / ours}
    print(f"SpMM {n}^3 90%: ours {ours * 1e3:.2f} ms ({name}), cuSPARSE {lib * 1e3:.2f} ms ({lib / ours:.2f}x), "
          f"dense fp32 {dense * 1e3:.2f} ms ({dense / ours:.2f}x), rel err {err:.1e}")


def bench_dlmc() -> None:
    rng = np.random.default_rng(1)
    ratios = []
    n = PLAN["dlmc_n"]
    for item in PLAN["dlmc"]:
        (rows, cols), indptr, indices = read_smtx(BUNDLE / "dlmc" / item["file"])
        data = cp.asarray(rng.standard_normal(indices.size).astype(np.float32))
        indptr_d, indices_d = cp.asarray(indptr), cp.asarray(indices)
        a = DeviceSparseTensor(sm.CSR, (rows, cols), (indptr_d, indices_d, data))
        ref = csp.csr_matrix((data, indices_d, indptr_d), shape=(rows, cols))
        b = cp.random.standard_normal((cols, n), dtype=cp.float32)
        k = kernel(item["kernel"])
        err = float(cp.max(cp.abs(k(A=a, B=b) - ref @ b)) / cp.max(cp.abs(ref @ b)))
        ours, lib = gpu_time(lambda: k(A=a, B=b)), gpu_time(lambda: ref @ b)
        ratios.append(lib / ours)
        RESULTS["bench"].setdefault("dlmc", []).append({"file": item["file"], "ours_s": ours, "cusparse_s": lib,
                                                        "rel_err": err})
    geo = float(np.exp(np.mean(np.log(ratios))))
    RESULTS["bench"]["dlmc_geomean_vs_cusparse"] = geo
    print(f"DLMC 0.9 x{len(ratios)}, N={n}: geometric mean {geo:.2f}x cuSPARSE "
          f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x)")


def bench_tensor_cores() -> None:
    """2:4 on Sparse Tensor Cores vs the dense Tensor Core GEMM of the same tiling vs cuBLAS (cupy.matmul), float16."""
    sparse_k, dense_k = (kernel(n) for n in PLAN["tensor_core"])
    n = PLAN_SHAPES["tensor_core"]
    a_dense = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    a = DeviceSparseTensor.from_dense_nm(a_dense, 2, 4, prune=True)
    pruned_d = cp.zeros((n, n // 4, 4), dtype=cp.float16)  # the pruned matrix, expanded back on the device
    offsets = a.buffers[0].reshape(n, n // 4, 2).astype(cp.int64)
    pruned_d[cp.arange(n)[:, None, None], cp.arange(n // 4)[None, :, None], offsets] = a.buffers[1].reshape(
        n, n // 4, 2)
    pruned_d = pruned_d.reshape(n, n)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    got = sparse_k(A=a, B=b)
    ref = pruned_d @ b
    err = float(cp.max(cp.abs(got.astype(cp.float32) - ref.astype(cp.float32))) / cp.max(cp.abs(ref)))
    dense_err = float(cp.max(cp.abs(dense_k(A=pruned_d, B=b).astype(cp.float32) - ref.astype(cp.float32)))
                      / cp.max(cp.abs(ref)))
    ours = gpu_time(lambda: sparse_k(A=a, B=b), repeat=5)
    same_tiling = gpu_time(lambda: dense_k(A=pruned_d, B=b), repeat=5)
    cublas = gpu_time(lambda: pruned_d @ b, repeat=5)
    RESULTS["bench"]["tensor_core_8192"] = {"ours_2of4_s": ours, "ours_dense_s": same_tiling, "cublas_s": cublas,
                                            "rel_err": err, "dense_rel_err": dense_err,
                                            "vs_same_tiling": same_tiling / ours, "vs_cublas": cublas / ours}
    print(f"2:4 f16 {n}^3: {ours * 1e3:.2f} ms, dense TC same tiling {same_tiling * 1e3:.2f} ms "
          f"({same_tiling / ours:.2f}x), cuBLAS {cublas * 1e3:.2f} ms ({cublas / ours:.2f}x), rel err {err:.1e} "
          f"(dense kernel {dense_err:.1e})")


def bench_sddmm() -> None:
    """float32 SDDMM against the dense route (cupy matmul, TF32 off, then a gather at S's entries) and, where torch
    has CUDA, torch.sparse.sampled_addmm (which samples A @ B at S's pattern; S's values multiplied after).
    Ratios are their time over ours: above 1, ours is faster.  Ours includes making the result (copies of S's
    positions and coordinates, new values), as a call does."""
    k = kernel("sddmm_float32")
    rng = np.random.default_rng(3)
    try:
        import torch
        on_torch = torch.cuda.is_available()
    except ImportError:
        on_torch = False
    for n, density, inner in PLAN["sddmm_bench"]:
        label = f"sddmm_{n}_{density}_k{inner}"
        s, a, b = sddmm_operands(rng, n, n, inner, density, np.float32)
        indptr, indices, data = s.buffers
        rows = cp.searchsorted(indptr, cp.arange(indices.size), side="right") - 1
        ours = gpu_time(lambda: k(S=s, A=a, B=b))
        ref = sddmm_reference(s, a, b)
        scale = max(float(cp.max(cp.abs(ref))), 1e-30) if ref.size else 1.0
        err = float(cp.max(cp.abs(k(S=s, A=a, B=b).buffers[2] - ref))) / scale if ref.size else 0.0
        result = {"nnz": int(indices.size), "ours_s": ours, "rel_err": err}
        if n * n * 4 <= 2**31:  # the dense product fits comfortably
            dense = gpu_time(lambda: cp.matmul(a, b)[rows, indices] * data)
            result.update(dense_s=dense, dense_vs_ours=dense / ours)
        if on_torch:
            s_t = torch.sparse_csr_tensor(torch.from_dlpack(indptr.astype(cp.int64)),
                                          torch.from_dlpack(indices.astype(cp.int64)), torch.from_dlpack(data),
                                          size=(n, n))
            a_t, b_t, vals_t = torch.from_dlpack(a), torch.from_dlpack(b), torch.from_dlpack(data)
            torch_s = gpu_time(lambda: torch.sparse.sampled_addmm(s_t, a_t, b_t, beta=0.0).values() * vals_t)
            got = torch.sparse.sampled_addmm(s_t, a_t, b_t, beta=0.0).values() * vals_t
            result.update(torch_s=torch_s, torch_vs_ours=torch_s / ours,
                          torch_rel_err=float(cp.max(cp.abs(cp.from_dlpack(got) - ref))) / scale if ref.size else 0.0)
        RESULTS["bench"][label] = result
        print(f"SDDMM {n}^2 at {density:g}, K={inner}, nnz {indices.size}: ours {ours * 1e3:.3f} ms"
              + (f", dense route {result['dense_s'] * 1e3:.3f} ms ({result['dense_vs_ours']:.2f}x)"
                 if "dense_s" in result else "")
              + (f", torch sampled_addmm {result['torch_s'] * 1e3:.3f} ms ({result['torch_vs_ours']:.2f}x)"
                 if on_torch else ", no torch with CUDA") + f"; rel err {err:.1e} (ratios: theirs / ours)")


def bench_launch_overhead() -> None:
    k = kernel(PLAN["tiny"][0])
    a, _ = csr_on_device(64, 64, 4)
    x = cp.random.standard_normal(64, dtype=cp.float32)
    y = k(A=a, x=x)
    calls_by_label = {"launch_overhead_us": lambda: k(A=a, x=x), "launch_overhead_out_us": lambda: k(A=a, x=x, out=y)}
    for label, call in calls_by_label.items():
        cp.cuda.Device().synchronize()
        calls = 2000
        start = time.perf_counter()
        for _ in range(calls):
            call()
        cp.cuda.Device().synchronize()
        per_call = (time.perf_counter() - start) / calls
        RESULTS["bench"][label] = per_call * 1e6
        print(f"tiny SpMV, host time per call (checks + {'new' if label == 'launch_overhead_us' else 'given'} "
              f"output + launch): {per_call * 1e6:.1f} us")


def shapes_from_plan() -> dict:
    out = {}
    for key in ("spmv_big", "spmv_skewed", "spmm_big", "tensor_core"):
        manifest = json.loads((BUNDLE / "kernels" / PLAN[key][0] / f"{PLAN[key][0]}.json").read_text())
        shape = manifest["signature"]["operands"][0]["shape"]
        out[key] = tuple(shape) if key.startswith("spmv") else shape[0]
    return out


PLAN_SHAPES = shapes_from_plan()

if __name__ == "__main__":
    print(f"device: {RESULTS['device']}, CuPy {cp.__version__}")
    ok = check_all()
    ok &= check_generic()
    ok &= check_sddmm()
    for step in (bench_launch_overhead, bench_spmv_big, bench_spmv_formats, bench_spmv_skewed, bench_spmm_big,
                 bench_dlmc, bench_tensor_cores, bench_sddmm):
        try:
            step()
        except Exception as exc:  # report and go on: device time is too short to rerun
            RESULTS["bench"][step.__name__] = f"failed: {type(exc).__name__}: {exc}"
            print(f"{step.__name__} failed: {type(exc).__name__}: {exc}")
    out = Path(os.environ.get("OUT", BUNDLE))
    (out / "gpu_results.json").write_text(json.dumps(RESULTS, indent=1))
    sys.exit(0 if ok else 1)
