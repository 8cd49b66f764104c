"""Writes the CSR matrix the C model ``csr_spmm_panels.c`` reads: a DLMC 0.9 pattern whose name contains the
argument (from ``$SPARSE_MLIR_DATA``), or ``random:ROWS:DENSITY``.

    python benchmarks/models/csr_spmm_panels.py layer_0_self_attention_multihead_attention_q
"""

from __future__ import annotations

import sys

import numpy as np
import scipy.sparse as sp
from sparse_mlir.io.matrix_files import read_smtx
from sparse_mlir.knobs import knobs

OUT = "/tmp/csr_spmm_model.bin"


def main(which: str) -> None:
    if which.startswith("random:"):
        _, rows, density = which.split(":")
        A = sp.random(int(rows), int(rows), density=float(density), format="csr", dtype=np.float32, random_state=1)
    else:
        found = sorted((knobs.data_dir() / "dlmc" / "transformer" / "magnitude_pruning" / "0.9").glob(f"*{which}*"))
        if not found:
            raise SystemExit(f"no DLMC 0.9 pattern matches {which!r}")
        A = sp.csr_matrix(read_smtx(found[0]), dtype=np.float32)
    A.sort_indices()
    A.data[:] = np.random.default_rng(1).standard_normal(A.nnz).astype(np.float32)
    with open(OUT, "wb") as f:
        np.array([*A.shape, A.nnz], np.int64).tofile(f)
        for part in (A.indptr, A.indices):
            part.astype(np.int32).tofile(f)
        A.data.tofile(f)
    print(f"{A.shape} {A.nnz} nonzeros -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "layer_0_self_attention_multihead_attention_q")
