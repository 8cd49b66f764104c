"""Expressions that no hand-scheduled emitter matches, for tests about the sparsifier's path.

Tests that check per-shape builds, the sparsifier's IR stages or its error paths need a kernel
that really goes through the sparsifier. A literal factor (`2 * A @ x`) no longer does: the
SpMV emitters strip it (`patterns.unscaled`). A vector that appears twice is outside every
emitter's pattern, so these stay sparsified. Keep them here so that when an emitter learns a
new pattern, one line changes.
"""

SPARSIFIED_SPMV = "y[i] = A[i,k] * x[k] * x[k]"
"""y = A (x*x): with A in CSC the reduction is the outer loop, so it is sparsified per shape."""

SPARSIFIED_SPMV_T = "y[i] = A[j,i] * x[j] * x[j]"
"""y = A^T (x*x): the transposed read of a CSR operand, sparsified per shape."""


LANE_PERMUTE = "llvm.x86.avx512.permvar"
"""What the IR of an N:M Linear or MLP kernel with features across lanes (``lane_select``) calls."""


def host_has_lane_kernels() -> bool:
    """Whether this host builds N:M Linear layers with features across lanes (AVX-512) instead of transposing."""
    from sparse_mlir.lowering.toolchain import vector_bits

    return vector_bits("native") == 512


def ran_native_linear(ir_text: str, fmt: str) -> bool:
    """Whether a Linear kernel's input IR is the hand-scheduled one this host builds for ``fmt``: the lane kernel
    for N:M on AVX-512, else the transposes around ``linear_spmm``."""
    if ":" in fmt and host_has_lane_kernels():
        return LANE_PERMUTE in ir_text and "call @linear_spmm" not in ir_text
    return "call @linear_spmm" in ir_text


def ran_native_mlp(ir_text: str, formats: tuple[str, str]) -> bool:
    """Whether a two-layer kernel's input IR is the fused one this host builds for ``formats``."""
    if all(":" in fmt for fmt in formats) and host_has_lane_kernels():
        return LANE_PERMUTE in ir_text and "call @mlp_first" not in ir_text
    return "call @mlp_first" in ir_text and "call @mlp_second" in ir_text
