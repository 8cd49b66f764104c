"""Serial or threaded, for calls that would wake a sleeping pool: measured per kernel instead of guessed.

A fork whose workers sleep waits for them to wake: about 0.1 ms on the
2-core VMs measured here (``KMP_BLOCKTIME=0``, or a call after the
blocktime), every parallel region of the kernel over again, and far less
on bare metal.  ``threads.for_work`` guesses from the operands' entry
count, which misjudges both ways: a SpGEMM reads few entries for its work
(SuiteSparse hangGlider_2, 10.8 ms serial, ran serially though 2 threads
took 6.8 ms) and a DLMC SpMM many (0.20 ms threaded against 0.15 serial,
its pool asleep between other libraries' calls).  So each kernel keeps,
per size class of its calls (the bit length of the entry count), the time
per entry of its last ``SAMPLES`` cold calls of either kind: the rule's
guess runs first, then each kind ``TRIALS`` times, then the faster one,
with the other tried again every ``PROBE_EVERY`` cold calls of that class
so that a changed machine (a busy core, another pool) is noticed.  Warm
calls (the workers still spin) and small ones keep the rule.
"""

from __future__ import annotations

import functools
import statistics
import threading
from collections import deque
from collections.abc import Callable

from sparse_mlir.runtime import threads

__all__ = ["PROBE_EVERY", "SAMPLES", "TRIALS", "ThreadChoice"]

SAMPLES = 3  # recent cold calls remembered per thread count: a median of three drops one outlier
TRIALS = 2  # cold calls of each kind before the faster one is taken (the first call of a size class pays for
# page faults and copies the next ones do not)
PROBE_EVERY = 32  # cold calls of a size class between two trials of the slower kind (a 2x slower one costs 3%)


class _SizeClass:
    """The recent times per entry of one size class's cold calls, by thread count."""

    def __init__(self) -> None:
        self.seconds_per_entry: dict[int, deque[float]] = {}
        self.calls = 0

    def pick(self, guess: int, configured: int) -> int:
        """The thread count for the next cold call: 1 or ``configured``, trials first (``guess``'s first)."""
        self.calls += 1
        kinds = (guess, configured if guess == 1 else 1)
        times = [self.seconds_per_entry.setdefault(k, deque(maxlen=SAMPLES)) for k in kinds]
        fewest = min(range(2), key=lambda k: len(times[k]))  # ties go to the guess
        if len(times[fewest]) < TRIALS:
            return kinds[fewest]
        faster = min(range(2), key=lambda k: statistics.median(times[k]))
        return kinds[1 - faster] if self.calls % PROBE_EVERY == 0 else kinds[faster]

    def record(self, count: int, entries: int, seconds: float) -> None:
        self.seconds_per_entry[count].append(seconds / entries)


class ThreadChoice:
    """One kernel's thread counts: ``before_call`` sets the count for the next call on this Python thread and
    returns ``report(seconds)`` when the call's time should be reported back (a cold call), else ``None``."""

    def __init__(self) -> None:
        self._classes: dict[int, _SizeClass] = {}
        self._lock = threading.Lock()  # kernels are called from several Python threads at once

    def before_call(self, entries: int) -> Callable[[float], None] | None:
        count, alternative = threads.work_threads(entries)
        if alternative is None:
            threads.set_threads(count)
            return None
        with self._lock:
            size_class = self._classes.setdefault(entries.bit_length(), _SizeClass())
            count = size_class.pick(count, alternative)
        threads.set_threads(count)
        return functools.partial(self._record, size_class, count, entries)

    def _record(self, size_class: _SizeClass, count: int, entries: int, seconds: float) -> None:
        with self._lock:
            size_class.record(count, entries, seconds)

    def verdicts(self) -> dict[int, dict[int, float]]:
        """Per size class (bit length of the entry count), the median seconds per entry of each thread count
        tried: what the choice rests on (for benchmarks and tests)."""
        with self._lock:
            return {bits: {count: statistics.median(times) for count, times in c.seconds_per_entry.items() if times}
                    for bits, c in self._classes.items()}
