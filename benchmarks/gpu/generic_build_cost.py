"""What a shape-generic GPU build costs to compile against a per-shape one (no GPU needed: MLIR to PTX only).

A shape-generic program is built once per index widths and then serves
every size; a per-shape one is built again for each new shape.  This times,
in one process, building the program (MLIR module, NVVM, PTX for every chip
of ``CHIPS``) of the generic variant and of one per-shape variant of the same
kernel, interleaved (which goes first alternates), median of ``--rounds``;
ratio generic / per-shape (above 1: the generic build takes longer, e.g. the
SpMM's eight tiling kernels against one).  Also prints each program's PTX
size for sm_90.  Timings are wall clock on whatever machine runs it (the
host is printed); run it with nothing else heavy going on.

Usage: ``python benchmarks/gpu/generic_build_cost.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from mlir import ir

import sparse_mlir as sm
from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.abi.gpu_program import CHIPS
from sparse_mlir.compiler import build, driver

KERNELS = [("CSR SpMV", "y[i] = A[i,j]*x[j]", "csr", {"A": (4096, 4096), "x": (4096,), "y": (4096,)}),
           ("CSR SpMM + bias", "C[i,j] = A[i,k]*B[k,j] + b[j]", "csr",
            {"A": (4096, 4096), "B": (4096, 64), "b": (64,), "C": (4096, 64)}),
           ("COO SpMV", "y[i] = A[i,j]*x[j]", "coo", {"A": (4096, 4096), "x": (4096,), "y": (4096,)})]


def build_seconds(spec: sm.dsl.plan.KernelSpec, shapes: dict) -> tuple[float, int]:
    """Seconds to build the program for ``shapes`` in this process, and its sm_90 PTX bytes."""
    sig = Signature.from_spec(spec, spec.formats, shapes, "k")
    start = time.perf_counter()
    with ir.Context():
        program, _ = build.gpu_program(spec, shapes, sig, CHIPS, "auto", False)
    return time.perf_counter() - start, len(program.ptx["sm_90"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; chips {', '.join(CHIPS)}")
    for label, expression, fmt, shapes in KERNELS:
        spec = sm.compile(expression, formats={"A": fmt}, dtype="float32", target="cuda").spec
        generic, fixed, sizes = [], [], {}
        for round_ in range(args.rounds):
            order = [("generic", driver.generic_shapes(spec)), ("fixed", shapes)]
            for name, given in order if round_ % 2 == 0 else order[::-1]:
                seconds, sizes[name] = build_seconds(spec, given)
                (generic if name == "generic" else fixed).append(seconds)
        g, f = statistics.median(generic), statistics.median(fixed)
        print(f"{label:18s} generic {g * 1e3:7.0f} ms ({sizes['generic']:6d} B PTX)  per-shape {f * 1e3:7.0f} ms "
              f"({sizes['fixed']:6d} B PTX)  generic / per-shape {g / f:.2f}  "
              f"(spread: generic {min(generic) * 1e3:.0f}-{max(generic) * 1e3:.0f}, "
              f"per-shape {min(fixed) * 1e3:.0f}-{max(fixed) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
