"""How far apart the benchmark's two threads run: the round trip of a cache line between the first two usable CPUs.

Why it is recorded: on the 2-vCPU VMs these figures come from, the host
moves the vCPUs between cores of one L3 (a round trip of 85-140 ns) and
cores of two (310-380 ns), for minutes at a time.  With two L3s, every
line one thread writes and the other reads is a remote fetch: a 2-thread
SDDMM that shared one transposed copy of B ran no faster than one thread
(session 26).  The benchmark measures this before and after its workloads
(``efficiency_gap.environment``), so a run can be read in the light of it.

    python benchmarks/core_latency.py      # prints the round trip in ns, and what it suggests
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sparse_mlir.errors import SparseMLIRError
from sparse_mlir.lowering.toolchain import c_compiler

SOURCE = Path(__file__).with_name("core_latency.c")
SHARED_L3_BELOW_NS = 200.0  # measured 85-140 ns on one L3, 310-380 across two (Zen 5 under KVM)


def round_trip_ns(timeout: float = 30.0) -> float | None:
    """The measured round trip between the first two usable CPUs, or ``None`` when there are fewer than two or
    the probe cannot be built or run here (no C compiler, pinning refused)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    with tempfile.TemporaryDirectory(prefix="sparse_mlir_core_latency_") as folder:
        binary = Path(folder) / "core_latency"
        try:
            subprocess.run([c_compiler(), "-O2", "-pthread", "-o", str(binary), str(SOURCE)], check=True,
                           capture_output=True, timeout=timeout)
            run = subprocess.run([str(binary), str(cpus[0]), str(cpus[1])], capture_output=True, text=True,
                                 timeout=timeout, check=True)
            return float(run.stdout)
        except (OSError, subprocess.SubprocessError, ValueError, SparseMLIRError):  # a probe, never fatal
            return None


def describe(ns: float | None) -> str:
    """One line for a report."""
    if ns is None:
        return "thread round trip: not measured"
    where = "one L3" if ns < SHARED_L3_BELOW_NS else "two L3s: data one thread writes, the other fetches remotely"
    return f"thread round trip {ns:.0f} ns ({where})"


if __name__ == "__main__":
    print(describe(round_trip_ns()))
    sys.exit(0)
