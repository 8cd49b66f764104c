"""Compile everything the one GPU device run needs, here (MLIR is not on the device).

Writes ``OUT/`` (default ``benchmarks/gpu/bundle``, git-ignored):

* ``sparse_mlir-*.whl``: the package as a pure-Python wheel (the device
  script imports it straight from the zip, without pip);
* ``kernels/<name>/``: exported PTX/cubin + manifests, one per kernel and
  shape the device script runs (the shape-generic SpMV and SpMM also once
  without shapes, run at several sizes), in both emitters where they differ
  (``auto``: the load-balanced kernels, ``sparsifier``: the mapped
  sparsified loops) so the device run picks the faster without recompiling;
* ``kernels/sddmm_<dtype>/``: the SDDMM with a CSR result, shape-generic;
* ``dlmc/``: the DLMC transformer matrices at 90% sparsity (``$SPARSE_MLIR_DATA``,
  ``knobs.data_dir()``: ``../shared/data`` by default; the package's one DLMC matrix when neither has them);
* ``device_check.py``: the script to run there.

Usage: ``python benchmarks/gpu/prepare_bundle.py [OUT] [--small]``, then on
the device ``python OUT/device_check.py OUT``.  ``--small`` shrinks every
shape (a rehearsal of the script, e.g. against the tests' CuPy stand-in).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import sparse_mlir as sm
from sparse_mlir.knobs import knobs

ROOT = Path(__file__).resolve().parents[2]
DLMC = Path("dlmc") / "transformer" / "magnitude_pruning" / "0.9"  # in knobs.data_dir()
BUILT_IN = Path(sm.__file__).parent / "data"  # one DLMC matrix ships with the package

# correctness: every format through SpMV and SpMM, on small fixed shapes
CHECK_FORMATS = ("csr", "csc", "coo", "dcsr", "bsr2x2", "2:4")
CHECK_SHAPES = {"spmv": {"A": (96, 64), "x": (64,)}, "spmm": {"A": (96, 64), "B": (64, 40)},
                "spmm_bias": {"A": (96, 64), "B": (64, 40), "b": (40,)}, "linear": {"A": (96, 64), "X": (40, 64)}}
EXPRESSIONS = {"spmv": "y[i] = A[i,j]*x[j]", "spmm": "C[i,j] = A[i,k]*B[k,j]",
               "spmm_bias": "C[i,j] = A[i,k]*B[k,j] + b[j]", "linear": "Y[b,o] = X[b,i]*A[o,i]",
               "sum": "s[] = A[i,j]", "dot": "s[] = A[i,j]*x[j]"}
# the parallel kernels of other formats (issue 13.3): deterministic variants and total reductions, checked; SpMV with
# COO, CSC and DCSR operands timed against cupyx's CSR SpMV on the same 50M-nonzero matrix
FORMAT_CHECKS = [("spmv", "coo", True), ("spmv", "dcsr", True), ("spmm", "coo", True), ("sum", "csr", False),
                 ("sum", "coo", False), ("sum", "csc", False), ("sum", "dcsr", True), ("dot", "csr", False),
                 ("dot", "coo", True), ("dot", "dcsr", False)]
SPMV_FORMATS = ("coo", "csc", "dcsr")
TENSOR_CORE = 8192  # 2:4 float16 SpMM and its dense Tensor Core reference, 8192^3
SPMV_BIG = (2_000_000, 2_000_000)  # 25 nonzeros per row: 50M
SPMM_BIG = 4096
DLMC_N = 256
SDDMM = "C[i,j] = S[i,j] * A[i,k] * B[k,j]"
# SDDMM timings: [rows = cols, density, K]: the CPU benchmark's 4096^2 at 1% (benchmarks/sddmm.py), an attention
# mask's 10%, a graph's 0.1% at 65536^2
SDDMM_BENCH = [[4096, 0.01, 64], [4096, 0.1, 64], [4096, 0.01, 128], [65536, 0.001, 64]]
SDDMM_BENCH_SMALL = [[256, 0.05, 32]]


def smtx_shape(path: Path) -> tuple[int, int]:
    with gzip.open(path, "rt") as f:
        rows, cols, _ = (int(v) for v in f.readline().split(","))
    return rows, cols


def export(out: Path, name: str, kind: str, fmt: str | None, dtype: str, shapes: dict, emitter: str = "auto",
           out_dtype: str | None = None, deterministic: bool = False) -> str:
    kernel = sm.compile(EXPRESSIONS[kind], formats={"A": fmt} if fmt else {}, dtype=dtype, target="cuda",
                        out_dtype=out_dtype, deterministic=deterministic)
    if emitter != "auto":
        from sparse_mlir.runtime.cuda import CudaKernel

        kernel = CudaKernel(kernel.spec, emitter=emitter)
    sm.export(kernel, out / "kernels" / name, name, shapes=shapes)
    return name


def export_sddmm(out: Path, dtype: str) -> str:
    """The SDDMM with CSR ``S`` and ``C``, exported without shapes (every size at run time)."""
    name = f"sddmm_{dtype}"
    kernel = sm.compile(SDDMM, formats={"S": "csr", "C": "csr"}, dtype=dtype, target="cuda")
    sm.export(kernel, out / "kernels" / name, name)
    return name


def fresh_bundle(out: Path) -> None:
    """Empty ``out`` (with ``kernels/``) and put the package there as a pure-Python wheel.

    The wheel is built from a copy of the working tree without build output: setuptools reuses a
    ``build/`` folder and never deletes from it, so a module removed or turned into a package would
    otherwise ride along in the bundle.
    """
    shutil.rmtree(out, ignore_errors=True)
    (out / "kernels").mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="sparse_mlir_wheel_") as tmp:
        source = Path(tmp) / "src"
        shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "bundle",
            "tc_bundle", "tests", "examples"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(out), str(source)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=ROOT / "benchmarks" / "gpu" / "bundle", type=Path)
    parser.add_argument("--small", action="store_true", help="small shapes: rehearse the device script")
    args = parser.parse_args()
    out = args.out
    tensor_core, spmm_big, spmv_big = (128, 64, (2000, 2000)) if args.small else (TENSOR_CORE, SPMM_BIG, SPMV_BIG)
    start = time.perf_counter()
    fresh_bundle(out)
    plan: dict[str, list] = {"check": [], "spmv_big": [], "spmm_big": [], "dlmc": [], "tiny": [], "tensor_core": [],
                             "spmv_skewed": [], "spmv_formats": []}
    for kind, shapes in CHECK_SHAPES.items():
        for fmt in CHECK_FORMATS if kind not in ("spmm_bias", "linear") else ("csr",):
            for dtype in ("float32", "float64"):
                name = f"check_{kind}_{fmt.replace(':', 'of')}_{dtype}"
                plan["check"].append({"name": export(out, name, kind, fmt, dtype, shapes), "kind": kind,
                                      "format": fmt, "dtype": dtype})
    for kind, fmt, deterministic in FORMAT_CHECKS:
        dtype = "float64" if deterministic and kind != "spmm" else "float32"
        shapes = CHECK_SHAPES.get(kind, {"A": (96, 64), "x": (64,)} if kind == "dot" else {"A": (96, 64)})
        name = f"check_{kind}_{fmt}_{dtype}" + ("_deterministic" if deterministic else "")
        plan["check"].append({"name": export(out, name, kind, fmt, dtype, shapes, deterministic=deterministic),
                              "kind": kind, "format": fmt, "dtype": dtype})
    # float16: CSR kernels summing in float32, 2:4 on Sparse Tensor Cores, the dense Tensor Core GEMM; each also
    # keeping its float32 sums (out_dtype)
    for kind, fmt in (("spmv", "csr"), ("spmm", "csr"), ("spmm", "2:4"), ("spmm", None)):
        for out_dtype in ("float16", "float32"):
            name = f"check_{kind}_{(fmt or 'dense').replace(':', 'of')}_float16" + \
                ("_to_float32" if out_dtype == "float32" else "")
            shapes = {"A": (96, 64), "B": (64, 40)} if kind == "spmm" else CHECK_SHAPES["spmv"]
            plan["check"].append({"name": export(out, name, kind, fmt, "float16", shapes, out_dtype=out_dtype),
                                  "kind": kind, "format": fmt or "dense", "dtype": "float16",
                                  "out_dtype": out_dtype})
    n = tensor_core
    plan["tensor_core"] = [export(out, "tc_2of4", "spmm", "2:4", "float16", {"A": (n, n), "B": (n, n)}),
                           export(out, "tc_dense", "spmm", None, "float16", {"A": (n, n), "B": (n, n)})]
    # skewed rows: the row-splitting kernel (auto) against the one without atomics (deterministic)
    skewed_shape = (spmv_big[0] // 2, spmv_big[1] // 2)
    for deterministic in (False, True):
        name = f"spmv_skewed_{'deterministic' if deterministic else 'auto'}"
        kernel = sm.compile(EXPRESSIONS["spmv"], formats={"A": "csr"}, dtype="float32", target="cuda",
                            deterministic=deterministic)
        sm.export(kernel, out / "kernels" / name, name, shapes={"A": skewed_shape, "x": (skewed_shape[1],)})
        plan["spmv_skewed"].append(name)
    for emitter in ("auto", "sparsifier"):
        plan["spmv_big"].append(export(out, f"spmv_big_{emitter}", "spmv", "csr", "float32",
                                       {"A": spmv_big, "x": (spmv_big[1],)}, emitter))
        plan["spmm_big"].append(export(out, f"spmm_big_{emitter}", "spmm", "csr", "float32",
                                       {"A": (spmm_big, spmm_big), "B": (spmm_big, spmm_big)}, emitter))
    for fmt, deterministic in [*((f, False) for f in SPMV_FORMATS), ("coo", True)]:
        name = f"spmv_big_{fmt}" + ("_deterministic" if deterministic else "")
        plan["spmv_formats"].append(export(out, name, "spmv", fmt, "float32", {"A": spmv_big, "x": (spmv_big[1],)},
                                           deterministic=deterministic))
    (out / "dlmc").mkdir()
    shapes_done: dict[tuple[int, int], str] = {}
    matrices = sorted((knobs.data_dir() / DLMC).glob("*.smtx.gz")) or sorted(BUILT_IN.glob("dlmc_*.smtx.gz"))
    for path in matrices[:3 if args.small else None]:
        shutil.copy(path, out / "dlmc" / path.name)
        shape = smtx_shape(path)
        if shape not in shapes_done:
            shapes_done[shape] = export(out, f"dlmc_{shape[0]}x{shape[1]}", "spmm", "csr", "float32",
                                        {"A": shape, "B": (shape[1], DLMC_N)})
        plan["dlmc"].append({"file": path.name, "kernel": shapes_done[shape]})
    plan["tiny"].append(export(out, "tiny_spmv", "spmv", "csr", "float32", {"A": (64, 64), "x": (64,)}))
    # shape-generic: one export without shapes, run by the device script at several sizes (device_check.check_generic)
    plan["generic"] = [{"name": export(out, f"generic_{kind}_{dtype}", kind, "csr", dtype, {}), "kind": kind}
                       for kind in ("spmv", "spmm_bias") for dtype in ("float32", "float16")]
    # the SDDMM with a CSR result (C takes S's pattern): shape-generic, checked at several sizes and timed
    plan["sddmm"] = [export_sddmm(out, dtype) for dtype in ("float32", "float64", "float16")]
    plan["sddmm_bench"] = SDDMM_BENCH_SMALL if args.small else SDDMM_BENCH
    (out / "plan.json").write_text(json.dumps({**plan, "dlmc_n": DLMC_N}, indent=1))
    shutil.copy(Path(__file__).with_name("device_check.py"), out / "device_check.py")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"bundle {out}: {size / 2**20:.1f} MiB, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
