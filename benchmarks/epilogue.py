"""Fused SpMM epilogues: ``relu(A@B + bias)`` against the plain SpMM and against scipy / torch doing the same.

``python benchmarks/epilogue.py``: CSR A 2048^2 at 90% sparsity, N = 128, float32, medians of
15 calls, every system in this process.  Ratios say which way they point.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.timing import median_seconds

ROUNDS = 15  # single calls of 2-20 ms: medians of 15

def main() -> None:
    rng = np.random.default_rng(0)
    size, n = 2048, 128
    a = sp.random(size, size, density=0.1, format="csr", dtype=np.float32, random_state=1)
    b = rng.standard_normal((size, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = np.empty((size, n), np.float32)
    tensor = sm.SparseTensor.from_scipy(a)
    plain = sm.compile("C[i,j] = A[i,k]*B[k,j]", formats={"A": "csr"}, dtype="float32")
    fused = sm.compile("C[i,j] = relu(A[i,k]*B[k,j] + bias[j])", formats={"A": "csr"}, dtype="float32")
    t_plain = median_seconds(lambda: plain(A=tensor, B=b, out=out), repeats=ROUNDS)
    t_fused = median_seconds(lambda: fused(A=tensor, B=b, bias=bias, out=out), repeats=ROUNDS)
    t_scipy = median_seconds(lambda: np.maximum(a @ b + bias, 0), repeats=ROUNDS)
    print(f"CSR {size}^2 at 90%, N={n}, float32")
    print(f"  plain SpMM            {t_plain * 1e3:8.3f} ms")
    print(f"  relu(A@B + bias)      {t_fused * 1e3:8.3f} ms   fused/plain {t_fused / t_plain:.2f}x (lower is better)")
    print(f"  scipy, same epilogue  {t_scipy * 1e3:8.3f} ms   scipy/ours {t_scipy / t_fused:.2f}x (above 1: ours faster)")
    try:
        import torch

        ta, tb, tbias = torch.from_numpy(a.toarray()).to_sparse_csr(), torch.from_numpy(b), torch.from_numpy(bias)
        t_torch = median_seconds(lambda: torch.relu(ta @ tb + tbias), repeats=ROUNDS)
        print(f"  torch.sparse, same    {t_torch * 1e3:8.3f} ms   torch/ours {t_torch / t_fused:.2f}x (above 1: ours faster)")
    except ImportError:
        print("  torch not installed: no torch column")


if __name__ == "__main__":
    main()
