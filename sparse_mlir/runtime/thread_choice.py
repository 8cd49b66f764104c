"""Serial or threaded, for calls that would wake a sleeping pool: measured per kernel instead of guessed.

A fork whose workers sleep waits for them to wake: about 0.1 ms on the
2-core VMs measured here (``KMP_BLOCKTIME=0``, or a call after the
blocktime), every parallel region of the kernel over again, and far less
on bare metal.  ``threads.for_work`` guesses from the operands' entry
count, and the count says little of the work: a SpGEMM of SuiteSparse
rajat01 (86k entries) ran serially in 28.5 ms where two threads took 22,
and hangGlider_2 has fewer entries than cryg2500 and 20 times its work.
So each kernel times its cold calls per call size (the exact entry count,
which repeats when the same operands or shapes come back: a model's
layers, a solver's iterations; the ``SIZES`` most recent ones are kept):
the rule's guess runs first (a warm-up, not kept), then each kind
``TRIALS`` times, then the other kind if its median of the last
``SAMPLES`` beats the guess's (later, the current choice's) by the margin
``SWITCH_BELOW``, with
one call of each kind timed again every ``PROBE_EVERY`` cold calls of that
size so that a changed machine (a busy core, another pool) is noticed.
Warm calls (the workers still spin) and small ones keep the rule.
"""

from __future__ import annotations

import functools
from collections import OrderedDict, deque
from collections.abc import Callable

from sparse_mlir.runtime import threads

__all__ = ["PROBE_EVERY", "SAMPLES", "SIZES", "SWITCH_BELOW", "TRIALS", "ThreadChoice"]

SAMPLES = 3  # recent timed calls remembered per thread count: a median of three drops one outlier
TRIALS = 3  # timed cold calls of each kind before the faster one is taken
PROBE_EVERY = 32  # cold calls of a size between two timings of each kind (a 2x slower probe costs 3%)
SIZES = 64  # call sizes remembered per kernel, the least recently called forgotten first
SWITCH_BELOW = 0.9  # the other kind is taken only when its median is below this share of the current one's
# (first the rule's guess): a threaded call's wake-up time has a long tail, and where the two kinds were within
# 10% (an SDDMM, a DLMC SpMM) three trials each chose either, run to run


class _CallSize:
    """The recent times of one call size's cold calls, by thread count."""

    __slots__ = ("calls", "faster", "guess", "seconds", "warmed")

    def __init__(self) -> None:
        self.seconds: dict[int, deque[float]] = {}
        self.calls = 0
        self.guess: int | None = None  # the rule's thread count for this size: kept unless clearly slower
        self.faster: int | None = None  # the thread count chosen, once both have TRIALS times
        # the first call is not kept: it pays for page faults and copies the next ones do not (an SDDMM's first
        # threaded call took 2.6x its later ones, and two trials chose one thread, 1.4x slower)
        self.warmed = False

    def pick(self, guess: int, configured: int) -> tuple[int, bool]:
        """The thread count for the next cold call (1 or ``configured``: trials first, ``guess``'s first) and
        whether to time it: every trial, then one call of each kind per ``PROBE_EVERY``."""
        self.calls += 1
        self.guess = guess
        other = configured if guess == 1 else 1
        faster = self.faster
        if faster is not None and faster in (guess, other):
            phase = self.calls % PROBE_EVERY
            if phase == 0:
                return (other if faster == guess else guess), True
            return faster, phase == 1
        times = self.seconds
        return (other if len(times.get(other, ())) < len(times.get(guess, ())) else guess), True  # ties: the guess

    def record(self, count: int, seconds: float) -> None:
        if not self.warmed:
            self.warmed = True
            return
        self.seconds.setdefault(count, deque(maxlen=SAMPLES)).append(seconds)
        medians = {c: _median(t) for c, t in list(self.seconds.items()) if len(t) >= TRIALS}  # (another thread
        # may add a count meanwhile)
        if len(medians) < 2:
            self.faster = None
            return
        best = min(medians, key=medians.__getitem__)
        current = self.faster if self.faster in medians else self.guess if self.guess in medians else best
        self.faster = best if medians[best] < SWITCH_BELOW * medians[current] else current


def _median(times: deque[float]) -> float:
    """The median of a few times (the upper one of an even count; ``statistics.median`` costs 5x more)."""
    return sorted(times)[len(times) // 2]


class ThreadChoice:
    """One kernel's thread counts: ``before_call`` sets the count for the next call on this Python thread and
    returns ``report(seconds)`` when the call's time should be reported back, else ``None``.

    Both run on every threaded call, and with the caches cold from other
    libraries' work Python is slow (about 1 us a line): ``before_call``
    adds a dictionary look-up and a few comparisons to the rule's work once
    the choice is made, and calls between probes are not timed (timing and
    reporting every cold call cost 0.03 ms on a 0.12 ms SpMM).  The state
    of a size is read and replaced under the GIL, with no lock (two threads
    racing can only time one kind once more), and so is the table of sizes
    (``_remember``).
    """

    def __init__(self) -> None:
        self._sizes: OrderedDict[int, _CallSize] = OrderedDict()

    def before_call(self, entries: int) -> Callable[[float], None] | None:
        count, alternative = threads.work_threads(entries)
        report = None
        if alternative is not None:
            size = self._sizes.get(entries)
            if size is None or size.calls % PROBE_EVERY == 0:  # new, or now and then marked recently used
                size = self._remember(entries)
            count, timed = size.pick(count, alternative)
            if timed:
                report = functools.partial(size.record, count)
        threads.set_threads(count)
        return report

    def _remember(self, entries: int) -> _CallSize:
        """The state of this call size, made most recently used (created, forgetting the least recently used
        sizes beyond ``SIZES``, when new).

        Each table operation is one atomic step under the GIL; another
        thread may forget a size between two of them, which is a
        ``KeyError`` to ignore.  No lock: a lock held by another thread
        when the process forks would stay held in the child for ever.
        """
        size = self._sizes.get(entries)
        if size is None:
            size = self._sizes.setdefault(entries, _CallSize())
            while len(self._sizes) > SIZES:
                try:
                    self._sizes.popitem(last=False)
                except KeyError:  # emptied meanwhile
                    break
        else:
            try:
                self._sizes.move_to_end(entries)
            except KeyError:  # forgotten meanwhile: it will be made again on its next call
                pass
        return size

    def verdicts(self) -> dict[int, dict[int, float]]:
        """Per call size (entry count), the median seconds of each thread count timed: what the choice rests on
        (for benchmarks and tests)."""
        return {entries: {count: _median(times) for count, times in list(size.seconds.items())}
                for entries, size in list(self._sizes.items()) if size.seconds}
