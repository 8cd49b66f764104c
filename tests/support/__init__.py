"""Test-only support: reference evaluator, CuPy and cuda.h stand-ins, the CPU emulation of GPU programs."""
