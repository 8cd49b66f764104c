"""One timing rule for everything that compares variants: warm up once, then the median of repeats."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["median_seconds", "gpu_seconds"]


def median_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def gpu_seconds(fn: Callable[[], object], cp: Any, repeat: int = 20, rounds: int = 5) -> float:
    """Median GPU seconds per call of ``fn`` over ``rounds`` of ``repeat`` back-to-back launches, from CUDA events
    on CuPy's current stream (``cp`` is the ``cupy`` module: this module never imports it)."""
    fn()
    cp.cuda.Device().synchronize()
    samples = []
    for _ in range(rounds):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(repeat):
            fn()
        stop.record()
        stop.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, stop) / 1e3 / repeat)
    return float(np.median(samples))
