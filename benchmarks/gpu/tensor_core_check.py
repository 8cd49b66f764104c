"""The Tensor Core device run: canary, correctness, then float16 GEMM benchmarks, with CuPy (and torch) alone.

``python BUNDLE/tensor_core_check.py BUNDLE`` on the GPU machine, from a
bundle made by ``tensor_core_bundle.py``.  Steps, each stopping the run on
failure:

1. canary: one exported kernel (CSR SpMV) against cupyx;
2. the first call of each Hopper kernel runs in a child process with a time
   limit, so a kernel that never finishes (a TMA byte count or barrier phase
   wrong) costs seconds, not the session;
3. correctness of every exported 2:4 and dense GEMM against a float32
   product of the same float16 inputs, on the Hopper code (sm_90a) and on
   the portable code (the same kernel with its sm_90a files removed);
4. benchmarks: ours (sm_90a and portable) against cuBLAS (``cupy.matmul``)
   and torch's 2:4 (``to_sparse_semi_structured``) in one process; GPU time
   from CUDA events over back-to-back launches, medians.

Ratios are the other system's time over ours (above 1: ours is faster).
Writes ``$OUT/tc_results.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

BUNDLE = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent).resolve()
sys.path.insert(0, str(next(BUNDLE.glob("sparse_mlir-*.whl"))))
os.environ.setdefault("CUPY_TF32", "0")
os.environ["SPARSE_MLIR_HOPPER"] = "1"  # the run that checks the sm_90a kernels enables them

import cupy as cp  # noqa: E402

import sparse_mlir as sm  # noqa: E402
from sparse_mlir.timing import gpu_seconds  # noqa: E402
from sparse_mlir.tensor.device import DeviceSparseTensor  # noqa: E402

PLAN = json.loads((BUNDLE / "plan.json").read_text())
OUT = Path(os.environ.get("OUT", BUNDLE))
RESULTS: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "checks": [], "bench": []}


def save() -> None:
    (OUT / "tc_results.json").write_text(json.dumps(RESULTS, indent=1))


def load(name: str, portable: bool = False):
    kernel = sm.load_kernel(BUNDLE / "kernels" / name / f"{name}.json")
    if portable:  # the sm_80/sm_90 code: what a GPU other than compute capability 9.0 runs
        kernel.function.files = {c: p for c, p in kernel.function.files.items() if not c.startswith("sm_90a")}
    return kernel


def gpu_time(fn, repeat: int = 10, rounds: int = 5) -> float:
    """Median seconds per call over ``rounds`` of ``repeat`` back-to-back launches (CUDA events)."""
    return gpu_seconds(fn, cp, repeat, rounds)


def operands(m: int, k: int, n: int, sparse: bool, seed: int = 0):
    """float16 A (2:4-pruned when ``sparse``), B, and the float32 reference product."""
    cp.random.seed(seed)
    a = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
    if sparse:  # keep the two largest of every four
        groups = a.reshape(m, k // 4, 4)
        rank = cp.argsort(cp.argsort(cp.abs(groups), axis=2), axis=2)
        a = cp.where(rank >= 2, groups, 0).reshape(m, k).astype(cp.float16)
    b = cp.random.standard_normal((k, n), dtype=cp.float32).astype(cp.float16)
    return a, b, a.astype(cp.float32) @ b.astype(cp.float32)


def run(kernel, a, b, sparse: bool):
    left = DeviceSparseTensor.from_dense_nm(a) if sparse else a
    return lambda: kernel(A=left, B=b)


def canary() -> None:
    import cupyx.scipy.sparse as csp

    rng = np.random.default_rng(1)
    dense = (rng.random((512, 512)) < 0.05) * rng.standard_normal((512, 512))
    a = csp.csr_matrix(cp.asarray(dense.astype(np.float32)))
    x = cp.asarray(rng.standard_normal(512).astype(np.float32))
    got = load(PLAN["canary"])(A=a, x=x)
    error = float(cp.abs(got - a @ x).max())
    RESULTS["canary"] = {"max_abs_error": error}
    print(f"canary SpMV vs cupyx: max abs error {error:.2e}", flush=True)
    if not error < 1e-4:
        save()
        if os.environ.get("SPARSE_MLIR_REHEARSAL") != "1":  # a rehearsal on the CuPy stand-in computes nothing
            sys.exit("canary failed: stop")


def first_call_in_child(name: str, sparse: bool) -> bool:
    """Run one Hopper kernel once in a child process with a time limit (a hang kills only the child)."""
    code = (f"import sys; sys.argv = ['x', {str(BUNDLE)!r}]; exec(open({__file__!r}).read().split({MARK!r})[0]);"
            f"e = {[e for e in PLAN['gemm'] if e['name'] == name][0]!r};"
            f"a, b, ref = operands(e['m'], e['k'], e['n'], {sparse});"
            f"got = run(load({name!r}), a, b, {sparse})(); cp.cuda.Device().synchronize(); print('ok')")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"{name}: first call did not finish in 60 s (hang)", flush=True)
        return False
    if done.returncode != 0:
        print(f"{name}: first call failed:\n{done.stderr[-3000:]}", flush=True)
    return done.returncode == 0


MARK = "# " + "CHILD"
# CHILD: everything above is what the child process needs


def relative_error(got, ref) -> float:
    return float(cp.abs(got.astype(cp.float32) - ref).max() / cp.abs(ref).max())


def main() -> None:
    canary()
    hopper_ok = {}
    for sparse in (True, False):
        smallest = min((e for e in PLAN["gemm"] if e["sparse"] == sparse), key=lambda e: e["m"] * e["k"] * e["n"])
        hopper_ok[sparse] = first_call_in_child(smallest["name"], sparse)
        print(f"hopper {'2:4' if sparse else 'dense'} first call: {'ok' if hopper_ok[sparse] else 'FAILED'}",
              flush=True)
    failed = False
    for entry in PLAN["gemm"]:
        m, k, n, sparse = entry["m"], entry["k"], entry["n"], entry["sparse"]
        a, b, ref = operands(m, k, n, sparse)
        for portable in ([False, True] if hopper_ok[sparse] else [True]):
            kernel = load(entry["name"], portable)
            error = relative_error(run(kernel, a, b, sparse)(), ref)
            ok = error <= 2e-3
            failed |= not ok
            RESULTS["checks"].append({"name": entry["name"], "portable": portable, "rel_error": error, "ok": ok})
            print(f"check {entry['name']:24s} {'portable' if portable else 'sm_90a  '} rel err {error:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
        del a, b, ref
    save()
    try:
        import torch
    except ImportError:
        torch = None
    for entry in PLAN["gemm"]:
        if not entry["bench"]:
            continue
        m, k, n, sparse = entry["m"], entry["k"], entry["n"], entry["sparse"]
        a, b, _ = operands(m, k, n, sparse)
        flop = 2.0 * m * n * k
        row = {"name": entry["name"], "m": m, "k": k, "n": n, "sparse": sparse}
        row["cublas_ms"] = gpu_time(lambda: cp.matmul(a, b)) * 1e3
        for portable in ([False, True] if hopper_ok[sparse] else [True]):
            checked = [c for c in RESULTS["checks"] if c["name"] == entry["name"] and c["portable"] == portable]
            if checked and not checked[0]["ok"]:
                continue
            row["portable_ms" if portable else "hopper_ms"] = gpu_time(run(load(entry["name"], portable), a, b,
                                                                           sparse)) * 1e3
        if torch is not None and sparse:
            try:
                from torch.sparse import to_sparse_semi_structured

                ta = torch.as_tensor(a, device="cuda")
                tb = torch.as_tensor(b, device="cuda")
                ts = to_sparse_semi_structured(ta)
                stream = torch.cuda.current_stream()
                with cp.cuda.ExternalStream(stream.cuda_stream):
                    row["torch_2to4_ms"] = gpu_time(lambda: torch.mm(ts, tb)) * 1e3
            except Exception as err:  # torch's 2:4 path refuses some shapes; record why
                row["torch_2to4_error"] = str(err)[:200]
        ours = row.get("hopper_ms") or row.get("portable_ms")
        if ours:
            row["tflops"] = flop / (ours * 1e-3) / 1e12
            row["vs_cublas"] = row["cublas_ms"] / ours
            if "torch_2to4_ms" in row:
                row["vs_torch_2to4"] = row["torch_2to4_ms"] / ours
        RESULTS["bench"].append(row)
        print(json.dumps(row), flush=True)
        save()
    save()
    if failed:
        sys.exit("a correctness check failed")


if __name__ == "__main__":
    main()
