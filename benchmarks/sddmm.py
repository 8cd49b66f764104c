"""SDDMM ``C[i,j] = S[i,j] * A[i,k] * B[k,j]`` (CSR S, 4096^2 at 1%, K = 64, float32) against torch.sparse.sampled_addmm.

``python benchmarks/sddmm.py``: medians of 7 calls, both systems in this process; the ratio is torch's time
over ours (above 1: ours is faster).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

import sparse_mlir as sm
from sparse_mlir.timing import median_seconds


def main() -> None:
    rng = np.random.default_rng(0)
    n, k = 4096, 64
    s = sp.random(n, n, density=0.01, format="csr", dtype=np.float32, random_state=1)
    a, b = rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    kernel = sm.compile("C[i,j] = S[i,j] * A[i,k] * B[k,j]", formats={"S": "csr", "C": "csr"}, dtype="float32")
    tensor = sm.SparseTensor.from_scipy(s)
    ours = median_seconds(lambda: kernel(S=tensor, A=a, B=b), repeats=7)
    print(f"SDDMM CSR {n}^2 at 1% ({s.nnz} entries), K={k}, float32: ours {ours * 1e3:.2f} ms")
    try:
        import torch

        ts = torch.sparse_csr_tensor(torch.from_numpy(s.indptr.astype(np.int64)),
                                     torch.from_numpy(s.indices.astype(np.int64)), torch.from_numpy(s.data), (n, n))
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        theirs = median_seconds(lambda: torch.sparse.sampled_addmm(ts, ta, tb, beta=0.0), repeats=7)
        print(f"torch.sparse.sampled_addmm {theirs * 1e3:.2f} ms: torch/ours {theirs / ours:.2f}x (above 1: ours faster)")
    except ImportError:
        print("torch not installed: no comparison")


if __name__ == "__main__":
    main()
