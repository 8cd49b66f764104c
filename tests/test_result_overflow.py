"""A sparse result too large for its declared index widths is refused (``FormatError``), never returned with
wrapped positions or coordinates; the exported C entry point returns ``SPARSE_MLIR_RESULT_OVERFLOW``."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.errors import FormatError

SPGEMM = "C[i,j] = A[i,k] * B[k,j]"
ADD = "C[i,j] = A[i,j] + B[i,j]"


def _kernel(expression: str, width: int):
    return sm.compile(expression, formats={"A": "csr", "B": "csr", "C": sm.CSR.with_widths(width, width)},
                      dtype="float64")


@pytest.mark.parametrize("expression", [SPGEMM, ADD])  # the hand-scheduled SpGEMM and the sparsifier's add
def test_too_many_entries_for_the_positions(expression):
    a = sp.random(120, 120, density=0.6, format="csr", random_state=np.random.default_rng(0))  # 120 < 2^15
    with pytest.raises(FormatError, match=r"16/16 bits.*with_widths\(64, 64\)"):
        _kernel(expression, 16)(A=sp.csr_array(np.ones((200, 200))), B=sp.csr_array(np.ones((200, 200))))
    expected = (a @ a if expression == SPGEMM else a + a).toarray()
    np.testing.assert_allclose(_kernel(expression, 16)(A=a, B=a).to_dense(), expected, rtol=1e-12)
    with pytest.raises(FormatError, match="8/8 bits"):  # 120 columns fit 8-bit coordinates, 8640+ entries do not
        _kernel(expression, 8)(A=a, B=a)


@pytest.mark.parametrize("expression", [SPGEMM, ADD])
def test_coordinates_too_large_for_their_width_are_refused_before_running(expression):
    a = sp.random(10, 300, density=0.01, format="csr", random_state=np.random.default_rng(1))
    b = sp.random(300 if expression == SPGEMM else 10, 300, density=0.01, format="csr",
                  random_state=np.random.default_rng(2))
    with pytest.raises(FormatError, match="8/8 bits"):  # column 299 does not fit an int8
        _kernel(expression, 8)(A=a, B=b)
    np.testing.assert_allclose(_kernel(expression, 16)(A=a, B=b).to_dense(),
                               (a @ b if expression == SPGEMM else a + b).toarray(), rtol=1e-12)


def test_the_exported_header_names_the_status(tmp_path):
    kernel = _kernel(SPGEMM, 16)
    sm.export(kernel, tmp_path, "spgemm16", shapes={"A": (4, 4), "B": (4, 4)})
    header = (tmp_path / "spgemm16.h").read_text()
    assert "#define SPARSE_MLIR_RESULT_OVERFLOW 5" in header and "16-bit positions" in header
