"""Compile what the Tensor Core device run needs, here (MLIR is not on the device).

Writes ``OUT/`` (default ``benchmarks/gpu/tc_bundle``, git-ignored): the
package as a pure-Python wheel, ``kernels/<name>/`` (PTX for sm_80/sm_90 and
the Hopper sm_90a kernels, cubins, manifests) for the float16 2:4 SpMM and
the dense GEMM at every shape ``tensor_core_check.py`` runs, a CSR SpMV for
its canary, and ``plan.json``.

Usage: ``python benchmarks/gpu/tensor_core_bundle.py [OUT] [--small]``; on the
device ``python OUT/tensor_core_check.py OUT``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import sparse_mlir as sm
from prepare_bundle import fresh_bundle  # the sibling script (this folder is on sys.path when run)

ROOT = Path(__file__).resolve().parents[2]
GEMM = "C[i,j] = A[i,k]*B[k,j]"
# (M, K, N): the square sizes, the BERT-base FFN products (W @ X^T with 4096 rows of X), and shapes
# whose edges are not whole tiles (M not a multiple of 128, K of 64, N of 256)
BENCH = ((8192, 8192, 8192), (4096, 4096, 4096), (3072, 768, 4096), (768, 3072, 4096))
CHECK = ((256, 512, 256), (1040, 1056, 1000), (3008, 3008, 3000))
SMALL = ((256, 512, 256), (144, 96, 136))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=ROOT / "benchmarks" / "gpu" / "tc_bundle", type=Path)
    parser.add_argument("--small", action="store_true", help="small shapes only: rehearse the device script")
    args = parser.parse_args()
    out = args.out
    start = time.perf_counter()
    fresh_bundle(out)
    plan: dict = {"canary": "canary_spmv", "gemm": []}
    spmv = sm.compile("y[i] = A[i,j]*x[j]", formats={"A": "csr"}, dtype="float32", target="cuda")
    sm.export(spmv, out / "kernels" / "canary_spmv", "canary_spmv", shapes={"A": (512, 512), "x": (512,)})
    shapes = [(s, False) for s in (SMALL if args.small else CHECK)] + \
        ([] if args.small else [(s, True) for s in BENCH])
    for (m, k, n), bench in shapes:
        for sparse in (True, False):
            name = f"{'nm' if sparse else 'dense'}_{m}x{k}x{n}"
            kernel = sm.compile(GEMM, formats={"A": "2:4"} if sparse else {}, dtype="float16", target="cuda")
            sm.export(kernel, out / "kernels" / name, name, shapes={"A": (m, k), "B": (k, n)})
            plan["gemm"].append({"name": name, "m": m, "k": k, "n": n, "sparse": sparse, "bench": bench})
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    shutil.copy(Path(__file__).with_name("tensor_core_check.py"), out / "tensor_core_check.py")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"bundle {out}: {size / 2**20:.1f} MiB, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
