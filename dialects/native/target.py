"""The CPU a module is emitted for: what the hand-scheduled emitters size their registers and tiles by.

Vector width alone was enough until the N:M SpMM's panels: the rows of B a
block of rows reuses are sized to the L1 data cache, and L1 differs between
hosts (32 KiB on Zen 4, 48 KiB on Sapphire Rapids and Zen 5).  Session 11
on a 48 KiB Xeon: 2:4 Linear layers took 0.71-0.78x dense torch's time with
8 KiB panels, 0.90-0.95x with 24-40 KiB.

Whether vector gathers pay differs too: the SpMV's four scalar accumulators,
packed by LLVM into 4-lane gathers of ``x``, were 1.25-1.35x slower on a Zen 4
host (session 10) and 1.1-1.3x faster on a Sapphire-Rapids-class Xeon
(session 15, gather-bound SpMVs: 1M rows of 16 entries 32.7 -> 25.2 ms).
On a Zen 5 host those 4-lane gathers lost 5-10% on long rows, but gathering
a whole register of ``x`` a step won 1.1-1.4x (session 23), so where gathers
pay the SpMV's long rows now do that (``spmv.RowSums``).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CpuTarget", "DEFAULT_L1D_BYTES"]

DEFAULT_L1D_BYTES = 32 * 1024  # a target other than this host's: the smallest L1d of current x86 cores


class CpuTarget(NamedTuple):
    """``vector_bits``: vector register width (512 with AVX-512); ``l1d_bytes``: the L1 data cache per core;
    ``fast_gathers``: vector gathers beat scalar loads, so the SpMV's long rows gather a register of ``x`` at a
    time."""

    vector_bits: int = 256
    l1d_bytes: int = DEFAULT_L1D_BYTES
    fast_gathers: bool = False

    @property
    def panel_bytes(self) -> int:
        """Bytes of B an N:M row block keeps in L1: half of it, the other half streams A's entries and C."""
        return max(4096, self.l1d_bytes // 2)
