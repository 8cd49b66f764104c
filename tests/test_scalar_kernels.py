"""Kernels scalar by design stay scalar in the machine code (``select.CpuChoice.scalar``: LLVM's vectorizers off),
but where the target's gathers pay (``CpuTarget.fast_gathers``) the SpMV's long rows gather whole registers of
``x`` themselves.

The CSR SpMV keeps four independent accumulators of scalar loads of ``x``;
LLVM's SLP vectorizer packs them into 4-lane gathers, measured 1.25-1.35x
slower on a Zen 4 host (session 10) and 1.1-1.3x faster on a Sapphire-Rapids-class
Xeon (session 15), 5-10% slower on a Zen 5 host (session 23).  Where gathers
pay, long rows gather a whole vector register of ``x`` at a time instead (Zen 5:
1.1-1.4x faster), and everything else stays scalar.  The
register-tiled SpMM, vectorized by its emitter, keeps its vectors either way.
"""

from __future__ import annotations

import platform
import subprocess

import pytest

from sparse_mlir.compiler import driver
from sparse_mlir.dsl.plan import plan
from sparse_mlir.lowering import toolchain
from sparse_mlir.lowering.toolchain import tool

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                reason="reads x86 machine code")


def _disassembly(expression: str, fmt: str, cpu: str = "znver4") -> str:
    spec = plan(expression, {"A": fmt}, "float64", None)
    shapes = {name: (None,) * spec.ranks[name] for name in (*spec.inputs, spec.output)}
    artifact = driver.build(spec, spec.formats, shapes, driver.BuildOptions(cpu=cpu))
    return subprocess.run([tool("llvm-objdump"), "-d", str(artifact.path)], capture_output=True, text=True,
                          check=True).stdout


def _functions(code: str) -> dict[str, str]:
    """Each function's disassembly by symbol (``llvm-objdump -d`` output)."""
    out: dict[str, str] = {}
    name = ""
    for line in code.splitlines():
        if line.endswith(">:"):
            name = line.split("<", 1)[1][:-2]
        out[name] = out.get(name, "") + line + "\n"
    return out


def _packed_float(code: str) -> list[str]:
    """The instructions on whole registers of floating-point lanes (``vmulpd ymm``, ``vfmadd231ps zmm``...).

    Integer vector instructions do not count: the C entry point's check of
    the positions (``lowering.c_entry``) is vectorized in every kernel, and
    a serial kernel is inlined into it.
    """
    packed = []
    for line in code.splitlines():
        fields = line.split("\t")  # address and bytes, mnemonic, operands
        mnemonic = fields[1].strip() if len(fields) > 1 else ""
        if mnemonic.endswith(("pd", "ps")) and ("ymm" in line or "zmm" in line):
            packed.append(line)
    return packed


@pytest.mark.parametrize("expression, fmt", [("y[i] = A[i,j] * x[j]", "csr"), ("y[i] = A[i,j] * x[j]", "dcsr"),
                                             ("y[i] = 2 * A[i,j] * x[j]", "coo")])
def test_the_spmv_kernels_load_x_without_gathers(expression, fmt):
    code = _disassembly(expression, fmt)
    assert "vfmadd" in code or "vmulsd" in code  # the kernel is there
    assert "gather" not in code


def test_the_tiled_spmm_keeps_its_vectors():
    code = _disassembly("C[i,j] = A[i,k] * B[k,j]", "csr")
    assert any("vfmadd231pd" in line and "zmm" in line for line in _packed_float(code))


@pytest.mark.parametrize("cpu", ["sapphirerapids", "znver5"])
@pytest.mark.parametrize("fmt", ["csr", "dcsr"])
def test_where_gathers_pay_long_rows_gather_x_a_register_at_a_time(fmt, cpu):
    code = _disassembly("y[i] = A[i,j] * x[j]", fmt, cpu=cpu)
    assert any("gather" in line and "zmm" in line for line in code.splitlines())


@pytest.mark.parametrize("expression, fmt", [("y[i] = A[i,j] * x[j]", "coo"), ("y[i] = A[i,j] * x[j]", "csc"),
                                             ("y[j] = A[i,j] * x[i]", "csr")])
def test_where_gathers_pay_runs_of_entries_and_scatters_stay_scalar(expression, fmt):
    """LLVM's vectorizers stay off: no floating-point instruction on a register wider than a scalar's."""
    code = _disassembly(expression, fmt, cpu="znver5")
    assert "vfmadd" in code and not _packed_float(code)


@pytest.mark.parametrize("cpu", ["znver4", "znver5"])
def test_the_entry_point_checks_positions_a_vector_at_a_time(cpu):
    """The C entry point's per-call check that positions never fall runs before the kernel on one thread; in a
    kernel built scalar it is still vectorized (``c_entry.VECTORIZE``): a packed compare of 512-bit registers."""
    entry = _functions(_disassembly("y[j] = A[i,j] * x[i]", "csr", cpu=cpu))["sparse_mlir_kernel"]
    assert any("vpcmp" in line and "zmm" in line for line in entry.splitlines()), entry


def test_where_gathers_pay_only_the_long_rows_gather():
    """The pair of vectors and the one after it: three gathers of ``x``, none packed by LLVM elsewhere."""
    code = _disassembly("y[i] = A[i,j] * x[j]", "csr", cpu="znver5")
    assert sum("gather" in line for line in code.splitlines()) == 3


@pytest.mark.parametrize("cpuinfo, gds, pays", [
    ("vendor_id : GenuineIntel\nflags : fpu sse avx2 avx512f amx_tile", "Not affected", True),
    ("vendor_id : GenuineIntel\nflags : fpu sse avx2 avx512f", "Vulnerable: No microcode", True),
    ("vendor_id : GenuineIntel\nflags : fpu sse avx2 avx512f", "Mitigation: Microcode", False),  # Skylake-Ice Lake
    ("vendor_id : GenuineIntel\nflags : fpu sse avx2", "Not affected", False),  # not measured: scalar
    ("vendor_id : AuthenticAMD\nflags : fpu sse avx2 avx512f", "Not affected", False),  # no family: as Zen 4
    ("vendor_id : AuthenticAMD\ncpu family : 25\nflags : fpu sse avx2 avx512f", "Not affected", False),  # Zen 4
    ("vendor_id : AuthenticAMD\ncpu family\t: 26\nflags : fpu sse avx2 avx512f", "Not affected", True),  # Zen 5
    ("vendor_id : AuthenticAMD\ncpu family : 26\nflags : fpu sse avx2", "Not affected", False),  # AVX-512 off
    ("vendor_id : AuthenticAMD\ncpu family : 1a\nflags : fpu sse avx2 avx512f", "Not affected", False),  # unread
])
def test_the_gather_rule(cpuinfo, gds, pays):
    assert toolchain.gathers_pay(cpuinfo, gds) is pays


def test_named_targets_other_than_recent_xeons_and_zen_5_keep_scalar_loads():
    assert toolchain.fast_gathers("sapphirerapids") and toolchain.fast_gathers("znver5")
    assert not toolchain.fast_gathers("znver4")
    assert not toolchain.fast_gathers("skylake-avx512") and not toolchain.fast_gathers("x86-64-v3")
