"""Pruning a sparse input keeps it sparse, kept counts are honest, conflicting options raise (issue 14 item 12)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir import prune
from sparse_mlir.tools.cli import main
from sparse_mlir.errors import PatternError, ShapeError, SparseMLIRError


@pytest.fixture
def sparse_weights() -> sp.csr_matrix:
    """4% nonzeros: far sparser than any sparsity asked for below."""
    return sp.random(96, 128, density=0.04, format="csr", dtype=np.float32, random_state=3)


@pytest.mark.parametrize("as_input", [lambda m: m.toarray(), lambda m: m, sm.SparseTensor.from_scipy])
@pytest.mark.parametrize("scope", ["global", "row"])
def test_magnitude_never_stores_an_implicit_zero(sparse_weights, as_input, scope):
    """Asked for 50% of a 4%-dense matrix, it keeps the 4% and not 46% of explicit zeros."""
    tensor, mask = prune.magnitude(as_input(sparse_weights), 0.5, scope=scope)
    assert tensor.nnz == sparse_weights.nnz == mask.sum()
    assert np.count_nonzero(tensor.values) == tensor.nnz
    np.testing.assert_array_equal(tensor.to_dense(), sparse_weights.toarray())


def test_magnitude_still_prunes_the_nonzeros_when_asked_for_more(sparse_weights):
    dense = sparse_weights.toarray()
    tensor, mask = prune.magnitude(sparse_weights, 0.99)
    assert tensor.nnz == mask.sum() == round(0.01 * dense.size)
    assert np.abs(dense[mask]).min() >= np.abs(dense[~mask & (dense != 0)]).max()


def test_n_m_and_block_keep_no_zero_the_input_did_not_have(sparse_weights):
    """N:M keeps at most N nonzeros per group (the format pads); a block of zeros is never kept."""
    dense = sparse_weights.toarray()
    _, mask = prune.n_m(sparse_weights, 2, 4)
    assert not (mask & (dense == 0)).any()
    tensor, mask = prune.block(sparse_weights, 0.1, (4, 4))
    blocks = np.abs(dense).reshape(24, 4, 32, 4).sum(axis=(1, 3))
    assert tensor.nnz == 16 * np.count_nonzero(blocks)
    assert (mask.reshape(24, 4, 32, 4).any(axis=(1, 3)) == (blocks > 0)).all()


def test_exact_zeros_of_a_dense_input_are_not_stored():
    weights = np.array([[0.0, 3.0, 0.0, -1.0], [0.0, 0.0, 0.0, 2.0]], np.float32)
    tensor, mask = prune.magnitude(weights, 0.25)
    assert tensor.nnz == mask.sum() == 3


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_prune_of_a_sparse_file_reports_kept_nonzeros_honestly(tmp_path, capsys, sparse_weights):
    source = tmp_path / "w.smt"
    sm.save_tensor(sm.SparseTensor.from_scipy(sparse_weights), source)
    code, out, _ = cli(capsys, "prune", str(source), str(tmp_path / "p.smt"), "--sparsity", "0.5")
    assert code == 0
    nnz = sparse_weights.nnz
    assert f"{nnz:,} of {nnz:,} nonzeros kept, {nnz / (96 * 128):.1%} of {96 * 128:,} entries" in out
    assert sm.load_tensor(tmp_path / "p.smt").nnz == nnz


def test_cli_prune_names_the_zeros_a_format_stores(tmp_path, capsys, sparse_weights):
    np.save(tmp_path / "w.npy", sparse_weights.toarray())
    code, out, _ = cli(capsys, "prune", str(tmp_path / "w.npy"), str(tmp_path / "p.smt"), "--pattern", "2:4")
    stored = sm.load_tensor(tmp_path / "p.smt")
    kept = np.count_nonzero(stored.values)
    assert code == 0 and f"{kept:,} of {sparse_weights.nnz:,} nonzeros kept" in out
    assert f"the format stores {stored.nnz - kept:,} zeros beside them" in out


@pytest.mark.parametrize("options", [["--pattern", "2:4", "--sparsity", "0.9"], ["--pattern", "2:4", "--block", "4x4"],
                                     ["--pattern", "2:4", "--scope", "row"],
                                     ["--sparsity", "0.5", "--block", "4x4", "--scope", "row"],
                                     ["--sparsity", "0.5", "--block", "4"], ["--sparsity", "0.5", "--block", "0x4"]])
def test_cli_prune_refuses_conflicting_or_malformed_options(tmp_path, capsys, options):
    np.save(tmp_path / "w.npy", np.ones((8, 8), np.float32))
    code, _, err = cli(capsys, "prune", str(tmp_path / "w.npy"), str(tmp_path / "p.smt"), *options)
    assert code == 2 and ("conflicts" in err or "--scope" in err or "RxC" in err)
    assert not (tmp_path / "p.smt").exists()


# -- options that were truncated or let through (an attacker's audit, session 28) ----------------------------------

def _calibrated(rng, features=16):
    return prune.Calibration.from_activations(rng.standard_normal((64, features)))


@pytest.mark.parametrize("call", [
    lambda w, c: prune.admm(w, c, sparsity=0.5, gradual=0.5),  # int(0.5) == 0: no mask step, nothing pruned
    lambda w, c: prune.admm(w, c, sparsity=0.5, rho=float("nan")),
    lambda w, c: prune.admm(w, c, sparsity=0.5, rho=float("inf")),
    lambda w, c: prune.sparsegpt(w, c, sparsity=0.5, block_columns=float("inf")),
    lambda w, c: prune.block(w, 0.5, (2.9, 4)),  # pruned as 2x4
    lambda w, c: prune.block(w, 0.5, (4,)),
    lambda w, c: prune.n_m(w, 2.9, 4),  # pruned as 2:4
    lambda w, c: prune.n_m(w, float("inf"), 4),
    lambda w, c: prune.satisfies_n_m(w, 2, 0),  # ZeroDivisionError
    lambda w, c: prune.wanda(w, None, sparsity=0.5),  # AttributeError
    lambda w, c: prune.Calibration(float("nan")),
    lambda w, c: prune.magnitude([[1.0, 2.0], [3.0]], 0.5),  # a ragged list: numpy's ValueError
])
def test_pruning_options_that_are_not_what_they_say_are_refused(rng, call):
    w = rng.standard_normal((8, 16))
    with pytest.raises(SparseMLIRError):
        call(w, _calibrated(rng))


@pytest.mark.parametrize("pruner", [
    lambda w, c: prune.magnitude(w, 0.5),
    lambda w, c: prune.sparsegpt(w, c, sparsity=0.5),  # one NaN weight came back as a row of 8 stored NaNs
    lambda w, c: prune.wanda(w, c, pattern="2:4"),
])
def test_weights_that_are_not_finite_are_refused(rng, pruner):
    w = rng.standard_normal((8, 16))
    w[3, 5] = np.nan
    with pytest.raises(PatternError, match=r"nan at \(3, 5\)"):
        pruner(w, _calibrated(rng))


def test_activations_whose_gram_overflows_are_refused_and_leave_the_calibration_as_it_was(rng):
    calibration = _calibrated(rng, 2)
    gram = calibration.gram.copy()
    with pytest.raises(ShapeError, match="overflow"):
        calibration.update(np.array([[1e200, 1e200]]))  # sparsegpt then raised scipy's bare ValueError
    np.testing.assert_array_equal(calibration.gram, gram)
