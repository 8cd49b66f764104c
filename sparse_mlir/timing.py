"""One timing rule for everything that compares variants: warm up once, then the median of repeats."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

__all__ = ["median_seconds"]


def median_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls after one untimed warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))
