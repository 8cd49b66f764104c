"""The sparsifier's kernel for an expression a hand-scheduled emitter now builds, timed in a child process.

A benchmark that compares a hand-scheduled kernel with the sparsifier's kernel it replaced runs itself again
as a child (``run``), in a private cache and compiling in process, and the child drops the emitter's rows
(``drop_emitter``) from the table the compiler reads and from the shape-generic table that follows it, so
the same expression goes to the sparsifier there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["drop_emitter", "run"]


def run(script: str, prefix: str, rounds: int, repeats: int) -> Any:
    """``python script --sparsifier --rounds R --repeats N`` in a private cache; its last stdout line, as JSON."""
    with tempfile.TemporaryDirectory(prefix=prefix) as cache:
        env = {**os.environ, "SPARSE_MLIR_CACHE_DIR": cache, "SPARSE_MLIR_COMPILE_IN_PROCESS": "1"}
        done = subprocess.run([sys.executable, script, "--sparsifier", "--rounds", str(rounds), "--repeats",
                               str(repeats)], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def drop_emitter(name: str) -> None:
    """In this (child) process: compile what emitter ``name`` built with the sparsifier instead."""
    # MLIR in the child only: the table the compiler reads, and the shape-generic rows that follow it
    from sparse_mlir.dialects import select

    from sparse_mlir.compiler import emitters

    select.CPU_EMITTERS = tuple(row for row in select.CPU_EMITTERS if row.name != name)
    emitters.SHAPE_GENERIC_CPU = tuple(row for row in emitters.SHAPE_GENERIC_CPU if row[0] != name)
