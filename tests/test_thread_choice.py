"""Serial or threaded for calls that find the pool asleep: each kernel times both and keeps the faster
(``runtime/thread_choice.py``), on the Python call path and the C one alike."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.runtime import thread_choice, threads
from sparse_mlir.runtime.thread_choice import PROBE_EVERY, TRIALS, ThreadChoice

BIG = 4 * threads.COLD_SERIAL_BELOW  # the entry-count rule guesses threads for this many
SMALL = threads.SERIAL_BELOW  # and one thread for this many


@pytest.fixture
def cold_pool(monkeypatch):
    """Two threads whose workers sleep after every call (``KMP_BLOCKTIME=0``): every call is cold."""
    monkeypatch.setenv("SPARSE_MLIR_NUM_THREADS", "2")
    monkeypatch.setenv("KMP_BLOCKTIME", "0")


def _counts(monkeypatch) -> list[int]:
    """The thread counts ``set_threads`` is given, in order."""
    seen: list[int] = []
    monkeypatch.setattr(threads, "set_threads", seen.append)
    return seen


def _calls(choice: ThreadChoice, entries: int, calls: int, seconds: dict[int, float], counts: list[int]) -> None:
    """``calls`` cold calls, each reporting the time ``seconds`` gives for the count it was given."""
    for _ in range(calls):
        report = choice.before_call(entries)
        assert report is not None  # every cold call is timed
        report(seconds[counts[-1]] * entries)


def test_trials_start_with_the_rules_guess_then_alternate_then_keep_the_faster(cold_pool, monkeypatch):
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    _calls(choice, BIG, 2 * TRIALS + 3, {1: 1e-9, 2: 3e-9}, counts)  # serial three times faster per entry
    assert counts[:2 * TRIALS] == [2, 1] * TRIALS  # the rule guesses threads for BIG
    assert counts[2 * TRIALS:] == [1, 1, 1]
    counts.clear()
    _calls(ThreadChoice(), SMALL, 2 * TRIALS + 3, {1: 2e-9, 2: 1e-9}, counts)
    assert counts == [1, 2] * TRIALS + [2, 2, 2]  # guessed serial, measured threads faster


def test_the_slower_kind_is_tried_again_so_a_change_is_noticed(cold_pool, monkeypatch):
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    _calls(choice, BIG, PROBE_EVERY, {1: 1e-9, 2: 3e-9}, counts)
    assert counts[-1] == 2 and counts.count(2) == TRIALS + 1  # the trials, then one probe at PROBE_EVERY
    _calls(choice, BIG, 3 * PROBE_EVERY, {1: 5e-9, 2: 3e-9}, counts)  # serial slowed down (a busy core, say)
    assert counts[-PROBE_EVERY:].count(2) == PROBE_EVERY - 1  # threads now, serial probed once
    assert choice.verdicts()[BIG.bit_length()][2] < choice.verdicts()[BIG.bit_length()][1]


def test_size_classes_are_measured_apart(cold_pool, monkeypatch):
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    _calls(choice, BIG, 2 * TRIALS + 1, {1: 1e-9, 2: 3e-9}, counts)
    assert counts[-1] == 1
    _calls(choice, 8 * BIG, 1, {1: 1e-9, 2: 3e-9}, counts)
    assert counts[-1] == 2  # a new class starts from the rule's guess
    assert set(choice.verdicts()) == {BIG.bit_length(), (8 * BIG).bit_length()}


def test_warm_small_and_fixed_calls_keep_the_rule_and_are_not_timed(monkeypatch):
    monkeypatch.setenv("SPARSE_MLIR_NUM_THREADS", "2")
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    monkeypatch.setenv("KMP_BLOCKTIME", "infinite")  # the workers always spin: no call is cold
    assert [choice.before_call(n) for n in (SMALL, BIG)] == [None, None] and counts == [2, 2]
    monkeypatch.setenv("KMP_BLOCKTIME", "0")
    assert choice.before_call(threads.SERIAL_BELOW - 1) is None and counts[-1] == 1
    with threads.fixed(2):
        assert choice.before_call(SMALL) is None and counts[-1] == 2
    monkeypatch.setenv("SPARSE_MLIR_NUM_THREADS", "1")
    assert choice.before_call(BIG) is None and counts[-1] == 1
    assert choice.verdicts() == {}


class _Subclass(np.ndarray):
    """A numpy array the C call path declines (it takes exact ``ndarray``s), so the Python path runs."""


@pytest.mark.parametrize("path", ["C", "Python"])
def test_kernel_calls_report_their_times_and_stay_right(cold_pool, path):
    """A threaded kernel's cold calls are timed on either call path (the C path times the entry point itself)
    and give the same answer with one thread or two."""
    a = sp.random(3000, 3000, density=0.02, format="csr", dtype=np.float64, random_state=7)
    x = np.random.default_rng(1).standard_normal(3000)
    if path == "Python":
        x = x.view(_Subclass)
    kernel = sm.compile("y[i] = A[i,j] * x[j]", formats={"A": "csr"}, dtype="float64")
    tensor = sm.SparseTensor.from_scipy(a)
    kernel(A=tensor, x=x)  # builds the specialization
    (special,) = kernel.specializations
    choice = special.native.thread_choice
    choice._classes.clear()  # (a cached specialization may have been called by another test)
    calls_before = special.planner.calls
    for _ in range(2 * TRIALS + 2):
        np.testing.assert_allclose(kernel(A=tensor, x=x), a @ x, rtol=1e-12, atol=1e-12)
    assert (special.planner.calls > calls_before) == (path == "C")  # the path the case names ran
    (by_count,) = choice.verdicts().values()
    assert set(by_count) == {1, 2} and all(t > 0 for t in by_count.values())
