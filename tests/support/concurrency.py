"""Calling code from several Python threads at once, for tests of what runs concurrently."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_at_once(target: Callable[[int], None], count: int) -> None:
    """``target(i)`` on ``count`` threads started together (``i`` from 0); returns when all have finished."""
    workers = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
