"""Kernels scalar by design stay scalar in the machine code (``select.CpuChoice.scalar``).

The CSR SpMV keeps four independent accumulators of scalar loads of ``x``;
LLVM's SLP vectorizer had packed them into 4-lane gathers, measured 1.25-1.35x
slower on a Zen 4 host (session 10), the form the emitter had rejected.  The
register-tiled SpMM, vectorized by its emitter, keeps its vectors.
"""

from __future__ import annotations

import platform
import subprocess

import pytest

from sparse_mlir.compiler import driver
from sparse_mlir.dsl.plan import plan
from sparse_mlir.lowering.toolchain import tool

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="reads x86 machine code")


def _disassembly(expression: str, fmt: str) -> str:
    spec = plan(expression, {"A": fmt}, "float64", None)
    shapes = {name: (None,) * spec.ranks[name] for name in (*spec.inputs, spec.output)}
    artifact = driver.build(spec, spec.formats, shapes, driver.BuildOptions(cpu="znver4"))
    return subprocess.run([tool("llvm-objdump"), "-d", str(artifact.path)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.parametrize("expression, fmt", [("y[i] = A[i,j] * x[j]", "csr"), ("y[i] = A[i,j] * x[j]", "dcsr"),
                                             ("y[i] = 2 * A[i,j] * x[j]", "coo")])
def test_the_spmv_kernels_load_x_without_gathers(expression, fmt):
    code = _disassembly(expression, fmt)
    assert "vfmadd" in code or "vmulsd" in code  # the kernel is there
    assert "gather" not in code


def test_the_tiled_spmm_keeps_its_vectors():
    code = _disassembly("C[i,j] = A[i,k] * B[k,j]", "csr")
    assert "zmm" in code and "vfmadd231pd" in code
