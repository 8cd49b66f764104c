"""Training step (forward + backward) of ``SparseLinear`` against what a user would train instead.

MiniLM's FFN shapes (``Linear(384, 1536)`` and ``Linear(1536, 384)``), float32,
``rows`` = batch x sequence tokens.  Each step runs the layer on ``x``
(``requires_grad``) and back-propagates a fixed upstream gradient, giving
the input, weight and bias gradients.  Compared, in this one process:

* dense ``torch.nn.Linear`` (what a masked-dense fine-tune runs; a mask
  hook would only add time to it);
* ``torch.sparse``: the pruned weight as a COO tensor that requires grad,
  ``torch.sparse.mm(W, x^T)^T + b`` (COO is the layout whose values torch
  differentiates);
* ``SparseLinear`` at 90% unstructured (CSR) and at 2:4.

``python benchmarks/sparse_linear_training.py [--rows 128 512] [--rounds 7] [--repeats 5] [--threads N]``.
The variants take turns, round after round (``interleaved``); times are
medians over rounds, ratios the median of per-round ratios of the
baseline's time over ours (above 1: ours is faster).  On a shared
machine run it a few times and compare medians; ``--threads 1`` is the
figure to trust there (torch's 2-thread pool stalls for milliseconds per
parallel region when other processes hold the cores).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import numpy as np
import torch

from sparse_mlir.timing import median_seconds
from sparse_mlir.torch import SparseLinear


def step(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, upstream: torch.Tensor,
         params: list[torch.Tensor]) -> Callable[[], None]:
    """One forward + backward, gradients cleared first (as ``optimizer.zero_grad(set_to_none=True)`` does)."""
    def run() -> None:
        for p in (x, *params):
            p.grad = None
        layer(x).backward(upstream)
    return run


def forward_only(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    """The layer's inference call (no graph kept), for the share of a step the forward takes."""
    def run() -> None:
        with torch.no_grad():
            layer(x)
    return run


def torch_sparse_layer(sparse: SparseLinear) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """The same pruned weight as a ``torch.sparse`` COO tensor that requires grad."""
    coords, values = sparse.weight.to_coo()
    weight = torch.sparse_coo_tensor(torch.from_numpy(coords.astype("int64")), torch.from_numpy(values.copy()),
                                     sparse.weight.shape).coalesce().requires_grad_()
    bias = sparse.bias.detach().clone().requires_grad_()
    return (lambda x: torch.sparse.mm(weight, x.t()).t() + bias), [weight, bias]


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of each variant, ``rounds`` times, the variants taking turns within each round.

    Taking turns puts every variant under the same background load (a shared
    machine's load drifts over seconds), so per-round ratios are fairer than
    ratios of separately taken medians.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            times[name].append(median_seconds(run, repeats=repeats))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5, help="steps per round (their median is the round's time)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for torch and for our kernels (default: each library's own default)")
    args = parser.parse_args()
    if args.threads is not None:  # both sides get the same number (ours reads it at each kernel call)
        torch.set_num_threads(args.threads)
        os.environ["SPARSE_MLIR_NUM_THREADS"] = str(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32; {args.rounds} rounds of "
          f"{args.repeats} steps, variants taking turns; medians over rounds; ratio = baseline / ours, the median of "
          f"the per-round ratios (above 1: ours faster)")
    for in_features, out_features in ((384, 1536), (1536, 384)):
        dense = torch.nn.Linear(in_features, out_features)
        layers = {"90% csr": SparseLinear.from_linear(dense, sparsity=0.9),
                  "2:4": SparseLinear.from_linear(dense, pattern="2:4")}
        coo, coo_params = torch_sparse_layer(layers["90% csr"])
        for rows in args.rows:
            x = torch.randn(rows, in_features, requires_grad=True)
            upstream = torch.randn(rows, out_features)
            variants = {"dense torch.nn.Linear": step(dense, x, upstream, list(dense.parameters())),
                        "torch.sparse COO 90%": step(coo, x, upstream, coo_params)}
            for name, sparse in layers.items():
                variants[f"SparseLinear {name}"] = step(sparse, x, upstream, list(sparse.parameters()))
                variants[f"SparseLinear {name}, forward only"] = forward_only(sparse, x)
            times = interleaved(variants, args.rounds, args.repeats)
            base = times["dense torch.nn.Linear"]
            print(f"Linear({in_features}, {out_features}), {rows} rows, forward + backward:")
            for name, samples in times.items():
                line = f"  {name}: {np.median(samples) * 1e3:.3f} ms"
                if name.startswith("SparseLinear") and "forward" not in name:
                    line += f", dense/ours {np.median(np.divide(base, samples)):.2f}x"
                    if "90%" in name:
                        coo_times = times["torch.sparse COO 90%"]
                        line += f", torch.sparse/ours {np.median(np.divide(coo_times, samples)):.2f}x"
                print(line)


if __name__ == "__main__":
    main()
