"""Running test code in a fresh interpreter, for what a process decides once: which OpenMP runtime kernels link,
what a forked child inherits.  The child prints one JSON line last; ``run_python`` returns it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def run_python(code: str, env: dict[str, str]) -> dict:
    """Run ``code`` (dedented) in a new interpreter with environment ``env``; its last stdout line, as JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def threaded_kernels(counts: tuple[int, ...], with_torch: bool = False) -> str:
    """A child script running one kernel of each threaded family (SpMV, SpMM, Linear, SDDMM, SpGEMM, sparse
    add: hand-scheduled and sparsified parallel loops) three times at each thread count in ``counts`` against
    scipy.  It prints the largest error per kernel and count, the runtime kernels link now, the runtimes
    loaded and our pool's path; ``with_torch`` imports torch first (libgomp in the process)."""
    return ("import torch\n" if with_torch else "") + textwrap.dedent(f"""
    import json, numpy as np, scipy.sparse as sp
    import sparse_mlir as sm
    from sparse_mlir.runtime import kmp_pool, threads
    rng = np.random.default_rng(0)
    A = sp.random(3000, 2000, density=0.02, format="csr", random_state=1, dtype=np.float64)
    D = sp.random(3000, 2000, density=0.02, format="csr", random_state=4, dtype=np.float64)
    S = sp.random(600, 500, density=0.05, format="csr", random_state=2, dtype=np.float64)
    x, B = rng.standard_normal(2000), rng.standard_normal((2000, 64))
    P, Q = rng.standard_normal((600, 16)), rng.standard_normal((16, 500))
    W = sp.random(300, 200, density=0.1, format="csr", random_state=3, dtype=np.float64)
    X = rng.standard_normal((700, 200))
    cases = {{
        "spmv": (sm.compile("y[i] = A[i,j] * x[j]", formats={{"A": "csr"}}), dict(A=A, x=x), A @ x),
        "spmm": (sm.compile("C[i,j] = A[i,k] * B[k,j]", formats={{"A": "csr"}}), dict(A=A, B=B), A @ B),
        "linear": (sm.compile("Y[b,o] = X[b,i] * W[o,i]", formats={{"W": "csr"}}), dict(X=X, W=W), X @ W.T),
        "sddmm": (sm.compile("C[i,j] = S[i,j] * P[i,k] * Q[k,j]", formats={{"S": "csr", "C": "csr"}}),
                  dict(S=S, P=P, Q=Q), S.multiply(P @ Q).toarray()),
        "spgemm": (sm.compile("C[i,j] = A[i,k] * D[k,j]", formats={{"A": "csr", "D": "csr", "C": "csr"}}),
                   dict(A=A, D=A.T.tocsr()), (A @ A.T).toarray()),
        "add": (sm.compile("C[i,j] = A[i,j] + D[i,j]", formats={{"A": "csr", "D": "csr", "C": "csr"}}),
                dict(A=A, D=D), (A + D).toarray()),
    }}
    errors = {{}}
    for count in {counts!r}:
        for name, (kernel, operands, want) in cases.items():
            for _ in range(3):
                with threads.fixed(count):
                    got = kernel(**operands)
                got = got.toarray() if hasattr(got, "toarray") else np.asarray(got)
                key = f"{{name}}@{{count}}"
                errors[key] = max(errors.get(key, 0.0), float(np.abs(got - want).max()))
    pool = kmp_pool.library()
    print(json.dumps({{"errors": errors, "runtime": str(threads.kernel_runtime()), "pool": str(pool and pool[0]),
                      "loaded": [str(p) for p in threads._loaded]}}))
    """)


ENTRY_POINTS = textwrap.dedent("""
    import subprocess
    from sparse_mlir.compiler import cache
    exported = subprocess.run(["nm", "-D", "--defined-only", threads.kernel_runtime()], capture_output=True,
                              text=True, check=True).stdout
    names = {line.split()[-1].split("@")[0] for line in exported.splitlines()}
    imported = set()
    for path in cache.cache_dir().rglob("*.so"):
        out = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True).stdout
        imported |= {line.split()[-1].split("@")[0] for line in out.splitlines()
                     if "__kmpc_" in line or " omp_" in line}
    print(json.dumps({"missing": sorted(imported - names), "imported": sorted(imported)}))
    """)
"""Appended to ``threaded_kernels``: the OpenMP entry points the kernels in the cache import that the runtime
they link does not define (a kernel importing one would fail to load, or call another runtime's)."""
