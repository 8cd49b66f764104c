"""The bad-input corpus: every kind either raises a precise error or computes the right answer.

``CORPUS`` is the table (also rendered in docs/bad-inputs.md, checked below):
each entry names the kind, what must happen, and a function that builds the
input and runs it.  The kinds that could touch memory out of bounds if a
check were missing also run together in a subprocess, so a segfault fails
the suite instead of killing it.  Inputs are checked unchanged afterwards.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.errors import (DeviceError, DSLError, DTypeError, FormatError, InvalidIndicesError, OperandError,
                                PatternError, ShapeError)

SPMV = "y[i] = A[i,j] * x[j]"


def spmv(dtype="float64"):
    return sm.compile(SPMV, formats={"A": "csr"}, dtype=dtype)


def raw_csr(indptr, indices, data, shape):
    """A scipy CSR matrix built without scipy's own checks (as a careless caller might)."""
    m = sp.csr_matrix(shape, dtype=np.float64)
    m.indptr, m.indices, m.data = (np.asarray(indptr, np.int32), np.asarray(indices, np.int32),
                                   np.asarray(data, np.float64))
    return m


class FakeCupy:
    __module__ = "cupy._core.core"
    shape = (3,)


def _nm_violation():
    sm.SparseTensor.from_dense(np.ones((1, 4)), "2:4")


def _unsorted():
    m = raw_csr([0, 3, 3], [2, 0, 1], [1.0, 2.0, 3.0], (2, 3))
    before = m.indices.copy()
    y = spmv()(A=m, x=np.array([1.0, 10.0, 100.0]))
    assert np.array_equal(m.indices, before)
    return y, [132.0, 0.0]  # 1*100 + 2*1 + 3*10


def _duplicates():
    m = raw_csr([0, 2, 2], [1, 1], [1.0, 2.0], (2, 3))
    return spmv()(A=m, x=np.array([1.0, 10.0, 100.0])), [30.0, 0.0]


def _nan_inf():
    a = np.array([[np.nan, 0.0], [np.inf, 1.0], [0.0, 2.0]])
    return spmv()(A=sm.SparseTensor.from_dense(a, "csr"), x=np.array([1.0, 1.0])), a @ np.ones(2)


def _huge_dimension():
    t = sm.SparseTensor.from_coo([[0, 1], [2**33, 7]], [2.0, 3.0], (2, 2**33 + 1), "csr")
    assert t.format.crd_width == 64
    return sm.compile("r[i] = A[i,j]", formats={"A": "csr"})(A=t), [2.0, 3.0]


def _layout(make):
    def run():
        a = np.arange(12.0).reshape(3, 4) % 3
        x = make(np.arange(4.0))
        before = x.copy()
        y = spmv()(A=sm.SparseTensor.from_dense(a, "csr"), x=x)
        assert np.array_equal(x, before)
        return y, a @ np.arange(4.0)
    return run


def _strided(v):
    return np.repeat(v, 2)[::2]


def _readonly(v):
    v = v.copy()
    v.flags.writeable = False
    return v


def _misaligned(v):
    raw = np.zeros(v.size * 8 + 1, np.uint8)[1:].view(np.float64)
    raw[:] = v
    return raw


def _fortran():
    a = np.arange(6.0).reshape(2, 3)
    b = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    k = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "csr"})
    return k(A=sm.SparseTensor.from_dense(a, "csr"), B=b), a @ b


def _empty():
    return spmv()(A=sp.csr_matrix((3, 4)), x=np.ones(4)), np.zeros(3)


def _zero_size():
    return spmv()(A=sp.csr_matrix((0, 4)), x=np.ones(4)), np.zeros(0)


def _int64_indices():
    m = sp.random(5, 4, density=0.5, format="csr", random_state=0)
    m.indptr, m.indices = m.indptr.astype(np.int64), m.indices.astype(np.int64)
    return spmv()(A=m, x=np.ones(4)), m @ np.ones(4)


def _explicit_zeros():
    m = raw_csr([0, 2, 3], [0, 2, 1], [0.0, 5.0, 0.0], (2, 3))
    return spmv()(A=m, x=np.ones(3)), [5.0, 0.0]


# (kind, outcome, expected exception or None for "right answer", action)
CORPUS = [
    ("out-of-range column index", "raise", InvalidIndicesError,
     lambda: spmv()(A=raw_csr([0, 1, 1], [7], [1.0], (2, 3)), x=np.ones(3))),
    ("negative index", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_coo([[0], [-1]], [1.0], (2, 3), "csr")),
    ("out-of-range row index", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_coo([[5], [0]], [1.0], (2, 3), "csr")),
    ("non-monotone index pointer", "raise", InvalidIndicesError,
     lambda: spmv()(A=raw_csr([0, 2, 1, 3], [0, 1, 2], [1.0, 2.0, 3.0], (3, 3)), x=np.ones(3))),
    ("index pointer of the wrong length", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_buffers("csr", (3, 3), (np.array([0, 1], np.int32), np.array([0], np.int32),
                                                          np.ones(1)))),
    ("index pointer not starting at 0", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_buffers("csr", (1, 3), (np.array([1, 1], np.int32), np.zeros(0, np.int32),
                                                          np.ones(0)))),
    ("nnz mismatch: pointer end vs indices", "raise", InvalidIndicesError,
     lambda: spmv()(A=raw_csr([0, 1, 3], [0, 1], [1.0, 2.0], (2, 3)), x=np.ones(3))),
    ("nnz mismatch: coordinates vs values", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_coo([[0, 1], [0, 1]], [1.0], (2, 2), "csr")),
    ("nnz mismatch: values vs coordinates buffers", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_buffers("csr", (1, 3), (np.array([0, 2], np.int32), np.array([0, 1], np.int32),
                                                          np.ones(3)))),
    ("unsorted buffers given directly", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_buffers("csr", (1, 3), (np.array([0, 2], np.int32), np.array([2, 0], np.int32),
                                                          np.ones(2)))),
    ("object array operand", "raise", DTypeError, lambda: spmv()(A=sp.eye(3, format="csr"), x=np.ones(3, object))),
    ("string array operand", "raise", DTypeError, lambda: spmv()(A=sp.eye(3, format="csr"), x=np.array(["a"] * 3))),
    ("object values of a sparse tensor", "raise", DTypeError,
     lambda: sm.SparseTensor.from_coo([[0], [0]], np.array([object()]), (1, 1), "csr")),
    ("complex values", "raise", DTypeError, lambda: sm.SparseTensor.from_dense(np.eye(2) * 1j, "csr")),
    ("dense operand of another dtype", "raise", DTypeError,
     lambda: spmv()(A=sp.eye(3, format="csr"), x=np.ones(3, np.float32))),
    ("sparse operand of another dtype", "raise", DTypeError,
     lambda: spmv()(A=sp.eye(3, format="csr", dtype=np.float32), x=np.ones(3))),
    ("CuPy array given to a CPU kernel", "raise", DeviceError, lambda: spmv()(A=sp.eye(3, format="csr"), x=FakeCupy())),
    ("host operands given to a GPU kernel", "raise", DeviceError,
     lambda: sm.compile(SPMV, formats={"A": "csr"}, target="cuda")(A=sp.eye(3, format="csr"), x=np.ones(3))),
    ("unknown target", "raise", DeviceError, lambda: sm.compile(SPMV, formats={"A": "csr"}, target="tpu")),
    ("missing operand", "raise", OperandError, lambda: spmv()(A=sp.eye(3, format="csr"))),
    ("unknown operand", "raise", OperandError, lambda: spmv()(A=sp.eye(3, format="csr"), x=np.ones(3), z=1)),
    ("misspelled operand", "raise", OperandError, lambda: spmv()(a=sp.eye(3, format="csr"), x=np.ones(3))),
    ("list instead of an array", "raise", OperandError, lambda: spmv()(A=sp.eye(3, format="csr"), x=[1.0] * 3)),
    ("dense array for a sparse operand", "raise", OperandError, lambda: spmv()(A=np.eye(3), x=np.ones(3))),
    ("expression outside the grammar", "raise", DSLError, lambda: sm.compile("y[i] = A[i,j] / x[j]")),
    ("unknown function", "raise", DSLError, lambda: sm.compile("y[i] = tanh(A[i,j])")),
    ("sparse output of a non-zero-preserving expression", "raise", DSLError,
     lambda: sm.compile("C[i,j] = exp(A[i,j])", formats={"A": "csr", "C": "csr"})),
    ("exp of an integer kernel", "raise", DSLError,
     lambda: sm.compile("C[i,j] = exp(A[i,j])", formats={"A": "csr"}, dtype="int32")),
    ("operand shapes that disagree", "raise", ShapeError, lambda: spmv()(A=sp.eye(3, format="csr"), x=np.ones(4))),
    ("operand of the wrong rank", "raise", ShapeError,
     lambda: spmv()(A=sp.eye(3, format="csr"), x=np.ones((3, 1)))),
    ("out= of the wrong shape", "raise", ShapeError,
     lambda: spmv()(A=sp.eye(3, format="csr"), x=np.ones(3), out=np.ones(4))),
    ("unknown format", "raise", FormatError, lambda: sm.compile(SPMV, formats={"A": "csx"})),
    ("shape not a multiple of the block", "raise", FormatError,
     lambda: sm.SparseTensor.from_dense(np.eye(3), "bsr2x2")),
    ("N:M pattern violation", "raise", PatternError, _nm_violation),
    ("unsorted indices", "compute", None, _unsorted),
    ("duplicate indices", "compute", None, _duplicates),
    ("explicit zeros", "compute", None, _explicit_zeros),
    ("NaN and Inf values", "compute", None, _nan_inf),
    ("empty matrix", "compute", None, _empty),
    ("zero-size dimension", "compute", None, _zero_size),
    ("dimension beyond 32-bit coordinates", "compute", None, _huge_dimension),
    ("int64 scipy indices", "compute", None, _int64_indices),
    ("non-contiguous dense operand", "compute", None, _layout(_strided)),
    ("read-only dense operand", "compute", None, _layout(_readonly)),
    ("misaligned dense operand", "compute", None, _layout(_misaligned)),
    ("Fortran-order dense operand", "compute", None, _fortran),
    ("expression nested deeper than 128 operations (a flat sum of 600 terms)", "raise", DSLError,
     lambda: sm.compile("y[i] = " + " + ".join(f"A{n}[i]" for n in range(600)))),
    ("sparse output summing more than 5 sparse operands", "raise", DSLError,
     lambda: sm.compile("C[i,j] = " + " + ".join(f"A{n}[i,j]" for n in range(6)),
                        formats={**{f"A{n}": "csr" for n in range(6)}, "C": "csr"})),
    ("dense output summing more than 6 sparse operands", "raise", DSLError,
     lambda: sm.compile("C[i,j] = " + " + ".join(f"A{n}[i,j]" for n in range(7)),
                        formats={f"A{n}": "csr" for n in range(7)})),
    ("unsorted or duplicate COO coordinates given directly", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_buffers("coo", (3, 3), (np.array([0, 2], np.int32), np.array([0, 0], np.int32),
                                                          np.array([2, 1], np.int32), np.ones(2)))),
    ("COO coordinates given as (nnz, ndim) pairs", "raise", InvalidIndicesError,
     lambda: sm.SparseTensor.from_coo(np.array([[0, 1], [1, 2], [2, 0]]), [1.0, 2.0, 3.0], (3, 3))),
    ("Python scalar the kernel's dtype cannot hold exactly (2.7 or '2' for int32)", "raise", DTypeError,
     lambda: sm.compile("y[i] = A[i,j] * s[]", formats={"A": "csr"}, dtype="int32")(
         A=sp.eye(3, format="csr", dtype=np.int32), s=2.7)),
    ("negative, fractional or huge shape", "raise", ShapeError,
     lambda: sm.SparseTensor.from_coo([[0], [0]], [1.0], (2.5, 3), "csr")),
    ("`prune.magnitude` of a sparse input already sparser than asked", "compute", None,
     lambda: _prune_keeps_sparsity()),
    ("`sparse-mlir prune` with conflicting options (`--pattern 2:4 --sparsity 0.9`)", "raise",
     sm.errors.SparseMLIRError,
     lambda: _prune_conflicting_options()),
    ("`load_state_dict` into a sparsified torch model from a checkpoint of another format", "raise", FormatError,
     lambda: _torch_checkpoint_of_another_format()),
    ("`load_state_dict` of a torch checkpoint with corrupt sparse weight buffers", "raise", InvalidIndicesError,
     lambda: _torch_checkpoint_with_corrupt_buffers()),
    ("BSR with blocks one column wide (`bsr16x1`) in a kernel other than SpMM", "raise", FormatError,
     lambda: sm.compile(SPMV, formats={"A": "bsr16x1"})(
         A=sm.SparseTensor.from_dense(np.ones((16, 3)), "bsr16x1"), x=np.ones(3))),
    ("BSR blocks taller than the register budget (`bsr16x1` SpMM)", "compute", None, lambda: _tall_block_spmm()),
    ("tensor named like a planner temporary (`_t0`, `_lX`: any name starting with `_`)", "raise", DSLError,
     lambda: sm.compile("C[i] = _t0[i] + B[i,j]")),
    ("tensor names that collide with the C parameters made for another (`A` and `A_d0`, `A_values`)", "raise",
     DSLError, lambda: sm.compile("C[i] = A[i] + A_d0[i]")),
    ("input named `out` or `self` (keywords of the kernel call)", "raise", DSLError,
     lambda: sm.compile("y[i] = out[i] * 2")),
    ("tensor named by a C/C++ keyword or header type (`int`, `class`, `int64_t`)", "raise", DSLError,
     lambda: sm.compile("y[i] = int[i] * 2")),
    ("integer literal out of the dtype's range (`2147483648` in int32)", "raise", DSLError,
     lambda: sm.compile("y[i] = 2147483648 * x[i]", dtype="int32")),
    ("float literal that would be inf or 0 in the dtype (`1e400`, `1e39` in float32, `1e-400`)", "raise", DSLError,
     lambda: sm.compile("y[i] = 1e39 * x[i]", dtype="float32")),
    ("the most negative integer as a literal (`-2147483648` in int32)", "compute", None,
     lambda: (sm.compile("y[i] = x[i] * -2147483648", dtype="int32")(x=np.ones(2, np.int32)), [-2**31] * 2)),
    ("non-ASCII digits or letters in an expression (`U+0663`, `U+00E4`)", "raise", DSLError,
     lambda: sm.compile("y[i] = \u0663 * x[i]")),
    ("`coo`/`csf` of order 0 or past 8 (`csf0` was silently dense), non-integer BSR/N:M sizes, `1:1`", "raise",
     FormatError, lambda: sm.compile(SPMV, formats={"A": "csf0"})),
    ("non-unique level followed by a non-singleton (`ud`, `us`, `sud`: the compiler aborted)", "raise", FormatError,
     lambda: sm.compile(SPMV, formats={"A": "ud"})),
    ("`loose_compressed` level (its kernels read compressed positions as pairs: wrong answers)", "raise",
     FormatError, lambda: sm.formats.Level(sm.formats.LevelKind.LOOSE_COMPRESSED)),
]
DANGEROUS = [0, 3, 6, 8]  # would read out of bounds if the checks before native code were missing


@pytest.mark.parametrize("kind,outcome,error,action", CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_input(kind, outcome, error, action):
    if outcome == "raise":
        with pytest.raises(error):
            action()
    else:
        got, want = action()
        got = got.to_dense() if isinstance(got, sm.SparseTensor) else got
        np.testing.assert_array_equal(got, np.asarray(want))


def test_dangerous_kinds_do_not_crash_a_process():
    names = [CORPUS[i][0] for i in DANGEROUS]
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_bad_inputs import CORPUS
        for kind, _, error, action in CORPUS:
            if kind in {names!r}:
                try:
                    action()
                except error:
                    print("refused:", kind)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused:") == len(DANGEROUS)


def test_corpus_is_documented():
    doc = (Path(__file__).parents[1] / "docs" / "bad-inputs.md").read_text()
    for kind, *_ in CORPUS:
        assert f"| {kind} |" in doc, kind
    assert len(CORPUS) >= 30


# helpers of the entries appended last (names resolved when an entry runs)
def _prune_keeps_sparsity():
    """A 4%-dense input pruned "to 50%" keeps its nonzeros and stores no zero."""
    from sparse_mlir import prune

    m = sp.random(40, 50, density=0.04, format="csr", random_state=0)
    tensor, _ = prune.magnitude(m, 0.5)
    assert tensor.nnz == m.nnz and np.count_nonzero(tensor.values) == m.nnz
    return tensor, m.toarray()


def _prune_conflicting_options():
    """The CLI's prune command refuses the sparsity it would have ignored (raises ``SparseMLIRError``)."""
    from sparse_mlir.errors import SparseMLIRError
    from sparse_mlir.tools.cli import build_parser

    args = build_parser().parse_args(["prune", "w.npy", "out.smt", "--pattern", "2:4", "--sparsity", "0.9"])
    try:
        args.func(args)
    except SparseMLIRError as exc:
        assert "conflicts" in str(exc)
        raise


def _sparsified(seed, **prune):
    torch = pytest.importorskip("torch")
    from sparse_mlir.torch import sparsify

    torch.manual_seed(seed)
    return sparsify(torch.nn.Sequential(torch.nn.Linear(8, 4)), **prune)


def _torch_checkpoint_of_another_format():
    _sparsified(1, pattern="2:4").load_state_dict(_sparsified(0, sparsity=0.5).state_dict())


def _torch_checkpoint_with_corrupt_buffers():
    state = _sparsified(0, sparsity=0.5).state_dict()
    state["0.weight_crd1"] = state["0.weight_crd1"].clone()
    state["0.weight_crd1"][0] = 100
    _sparsified(1, sparsity=0.5).load_state_dict(state)


def _tall_block_spmm():
    a = np.kron(np.eye(4)[:, :3], np.ones((16, 1))) * np.arange(1.0, 65.0)[:, None]
    b = np.arange(21.0).reshape(3, 7)
    k = sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={"A": "bsr16x1"})
    return k(A=sm.SparseTensor.from_dense(a, "bsr16x1"), B=b), a @ b


@pytest.mark.parametrize("dtype", [("f8", -1), [("a", "f8"), ("a", "f8")], {"names": ["a"], "formats": ["f8"],
                                                                           "offsets": [-1]}])
def test_dtypes_numpy_cannot_make_are_dtype_errors(dtype):
    """numpy raises ValueError for these (the check only caught its TypeError)."""
    with pytest.raises(DTypeError, match="is not a dtype"):
        sm.compile(SPMV, formats={"A": "csr"}, dtype=dtype)
