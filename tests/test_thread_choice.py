"""Serial or threaded for calls that find the pool asleep: each kernel times both and keeps the faster
(``runtime/thread_choice.py``), on the Python call path and the C one alike."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.runtime import thread_choice, threads
from sparse_mlir.runtime.thread_choice import PROBE_EVERY, SIZES, TRIALS, ThreadChoice

BIG = 4 * threads.COLD_SERIAL_BELOW  # the entry-count rule guesses threads for this many
SMALL = threads.SERIAL_BELOW  # and one thread for this many


@pytest.fixture
def cold_pool(monkeypatch):
    """Two threads whose workers sleep after every call (``KMP_BLOCKTIME=0``): every call is cold."""
    monkeypatch.setenv("SPARSE_MLIR_NUM_THREADS", "2")
    monkeypatch.setenv("KMP_BLOCKTIME", "0")
    monkeypatch.setattr(threads._local, "last_call", None, raising=False)  # this thread's last call, put back after


def _counts(monkeypatch) -> list[int]:
    """The thread counts ``set_threads`` is given, in order."""
    seen: list[int] = []
    monkeypatch.setattr(threads, "set_threads", seen.append)
    return seen


def _calls(choice: ThreadChoice, entries: int, calls: int, seconds: dict[int, float], counts: list[int]) -> int:
    """``calls`` cold calls, each timed one reporting the time ``seconds`` gives for the count it was given;
    returns how many were timed."""
    timed = 0
    for _ in range(calls):
        report = choice.before_call(entries)
        if report is not None:
            report(seconds[counts[-1]] * entries)
            timed += 1
    return timed


def test_trials_start_with_the_rules_guess_then_alternate_then_keep_the_faster(cold_pool, monkeypatch):
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    _calls(choice, BIG, 1 + 2 * TRIALS + 3, {1: 1e-9, 2: 3e-9}, counts)  # serial three times faster per entry
    assert counts[:1 + 2 * TRIALS] == [2] + [2, 1] * TRIALS  # the rule guesses threads for BIG; a warm-up first
    assert counts[1 + 2 * TRIALS:] == [1, 1, 1]
    counts.clear()
    _calls(ThreadChoice(), SMALL, 1 + 2 * TRIALS + 3, {1: 2e-9, 2: 1e-9}, counts)
    assert counts == [1] + [1, 2] * TRIALS + [2, 2, 2]  # guessed serial, measured threads faster


def test_the_first_call_of_a_size_is_not_kept(cold_pool, monkeypatch):
    """It pays for page faults the others do not: however slow, it decides nothing."""
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    report = choice.before_call(BIG)
    report(1.0)  # a very slow first (threaded) call
    _calls(choice, BIG, 2 * TRIALS + 2, {1: 2e-9, 2: 1e-9}, counts)
    assert counts[-2:] == [2, 2]
    assert max(choice.verdicts()[BIG].values()) < 0.1


def test_trials_are_timed_then_only_one_call_of_each_kind_per_probe_period(cold_pool, monkeypatch):
    """Timing and reporting cost Python work on every call they touch (slow with cold caches), so once the
    choice is made a period of ``PROBE_EVERY`` cold calls times two: one of the faster kind, the probe."""
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    assert _calls(choice, BIG, 1 + 2 * TRIALS, {1: 1e-9, 2: 3e-9}, counts) == 1 + 2 * TRIALS
    assert _calls(choice, BIG, 4 * PROBE_EVERY, {1: 1e-9, 2: 3e-9}, counts) == 4 * 2


def test_the_slower_kind_is_tried_again_so_a_change_is_noticed(cold_pool, monkeypatch):
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    _calls(choice, BIG, PROBE_EVERY, {1: 1e-9, 2: 3e-9}, counts)
    assert counts[-1] == 2 and counts.count(2) == 1 + TRIALS + 1  # warm-up, trials, one probe at PROBE_EVERY
    _calls(choice, BIG, 3 * PROBE_EVERY, {1: 5e-9, 2: 3e-9}, counts)  # serial slowed down (a busy core, say)
    assert counts[-PROBE_EVERY:].count(2) == PROBE_EVERY - 1  # threads now, serial probed once
    assert choice.verdicts()[BIG][2] < choice.verdicts()[BIG][1]


def test_a_choice_changes_only_for_a_clear_margin(cold_pool, monkeypatch):
    """A threaded call's time has a long tail (the wake-up): the other kind must be ``SWITCH_BELOW`` times the
    current one's median (first the rule's guess) to replace it."""
    counts = _counts(monkeypatch)
    near = ThreadChoice()
    _calls(near, BIG, 1 + 2 * TRIALS + 3, {1: 0.95e-9, 2: 1e-9}, counts)  # serial 5% faster: the guess stays
    assert counts[-3:] == [2, 2, 2]
    _calls(near, SMALL, 1 + 2 * TRIALS + 3, {1: 1e-9, 2: 0.95e-9}, counts)
    assert counts[-3:] == [1, 1, 1]
    choice = ThreadChoice()
    _calls(choice, BIG, 1 + 2 * TRIALS, {1: 1e-9, 2: 3e-9}, counts)
    _calls(choice, BIG, 4 * PROBE_EVERY, {1: 1e-9, 2: 0.95e-9}, counts)  # threads now 5% faster: kept serial
    assert counts[-PROBE_EVERY:].count(1) == PROBE_EVERY - 1
    _calls(choice, BIG, 4 * PROBE_EVERY, {1: 1e-9, 2: 0.8e-9}, counts)  # 20% faster: taken
    assert counts[-PROBE_EVERY:].count(2) == PROBE_EVERY - 1


def test_call_sizes_are_measured_apart(cold_pool, monkeypatch):
    """Each entry count has its own trials (a SpGEMM's work is not proportional to its entries), and only the
    ``SIZES`` most recently called are remembered."""
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    _calls(choice, BIG, 2 * TRIALS + 2, {1: 1e-9, 2: 3e-9}, counts)
    assert counts[-1] == 1
    _calls(choice, BIG + 1, 2, {1: 1e-9, 2: 3e-9}, counts)
    assert counts[-2:] == [2, 2]  # a new size starts from the rule's guess: its warm-up, then its first trial
    assert set(choice.verdicts()) == {BIG, BIG + 1}
    for n in range(SIZES):
        _calls(choice, BIG + 2 + n, 2, {1: 1e-9, 2: 3e-9}, counts)
    assert BIG not in choice.verdicts() and BIG + 1 not in choice.verdicts() and len(choice.verdicts()) == SIZES


def test_warm_small_and_fixed_calls_keep_the_rule_and_are_not_timed(cold_pool, monkeypatch):
    counts = _counts(monkeypatch)
    choice = ThreadChoice()
    monkeypatch.setenv("KMP_BLOCKTIME", "infinite")  # once started, the workers always spin
    assert choice.before_call(SMALL) is not None  # the first call of this thread: cold
    assert [choice.before_call(n) for n in (SMALL, BIG)] == [None, None] and counts[1:] == [2, 2]
    monkeypatch.setenv("KMP_BLOCKTIME", "0")
    assert choice.before_call(threads.SERIAL_BELOW - 1) is None and counts[-1] == 1
    with threads.fixed(2):
        assert choice.before_call(SMALL) is None and counts[-1] == 2
    monkeypatch.setenv("SPARSE_MLIR_NUM_THREADS", "1")
    assert choice.before_call(BIG) is None and counts[-1] == 1
    assert list(choice.verdicts()) == []  # the one cold call was the class's warm-up


class _Subclass(np.ndarray):
    """A numpy array the C call path declines (it takes exact ``ndarray``s), so the Python path runs."""


@pytest.mark.skipif(threads.openmp_library() is None, reason="no OpenMP runtime: kernels are serial")
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
    kernel(A=tensor, x=x)  # builds the specialization (the kernel is cached: others' tests may have made more)
    specials = kernel.specializations
    for special in specials:
        special.native.thread_choice._sizes.clear()
    calls_before = [special.planner.calls for special in specials]
    for _ in range(2 * TRIALS + 3):
        np.testing.assert_allclose(kernel(A=tensor, x=x), a @ x, rtol=1e-12, atol=1e-12)
    (special,) = [s for s in specials if s.native.thread_choice.verdicts()]
    assert (special.planner.calls > calls_before[specials.index(special)]) == (path == "C")  # the path named ran
    (by_count,) = special.native.thread_choice.verdicts().values()
    assert set(by_count) == {1, 2} and all(t > 0 for t in by_count.values())


def test_threads_calling_at_once_never_break_the_table(cold_pool, monkeypatch):
    """Python threads calling one kernel with more sizes than ``SIZES`` at once: each size may be forgotten
    by one thread while another marks it recently used; no call may fail for it."""
    import threading

    monkeypatch.setattr(threads, "set_threads", lambda count: None)
    monkeypatch.setattr(thread_choice, "PROBE_EVERY", 1)  # every call marks its size recently used
    choice = ThreadChoice()
    failures: list[BaseException] = []

    def caller(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for entries in rng.integers(SMALL, SMALL + SIZES + 2, size=20000):  # sizes forgotten all the time
                report = choice.before_call(int(entries))
                if report is not None:
                    report(1e-6)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            failures.append(exc)

    workers = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can, to meet the race
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == [] and len(choice._sizes) <= SIZES


def test_a_size_forgotten_by_another_thread_mid_call_is_no_error(cold_pool, monkeypatch):
    """The table is changed without a lock (one held at a fork would stay held in the child): a size that
    another thread forgets between this call's look-up and its marking as recently used is made again later,
    not an error."""
    from collections import OrderedDict

    class ForgetsAfterLookUp(OrderedDict):
        looked_up = 0

        def get(self, key, default=None):
            found = super().get(key, default)
            self.looked_up += 1
            if self.looked_up % 2 == 0:  # the second look-up of a call, the one before the marking
                self.pop(key, None)  # what another thread's eviction does between the two steps
            return found

    monkeypatch.setattr(threads, "set_threads", lambda count: None)
    monkeypatch.setattr(thread_choice, "PROBE_EVERY", 1)  # every call marks its size recently used
    choice = ThreadChoice()
    for _ in range(3):
        choice.before_call(BIG)
    choice._sizes = ForgetsAfterLookUp(choice._sizes)
    for _ in range(3):
        choice.before_call(BIG)
