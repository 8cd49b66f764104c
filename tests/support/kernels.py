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
