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

``python benchmarks/sparse_linear_training.py [--rows 128 512] [--repeats 15]``.
Times are medians of ``--repeats`` steps after a warm-up step; the ratio is
the baseline's time over ours (above 1: ours is faster).  On a shared
machine run it a few times and compare medians.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

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


def torch_sparse_layer(sparse: SparseLinear) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """The same pruned weight as a ``torch.sparse`` COO tensor that requires grad."""
    coords, values = sparse.weight.to_coo()
    weight = torch.sparse_coo_tensor(torch.from_numpy(coords.astype("int64")), torch.from_numpy(values.copy()),
                                     sparse.weight.shape).coalesce().requires_grad_()
    bias = sparse.bias.detach().clone().requires_grad_()
    return (lambda x: torch.sparse.mm(weight, x.t()).t() + bias), [weight, bias]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats} steps, float32; "
          f"ratio = baseline / ours (above 1: ours faster)")
    for in_features, out_features in ((384, 1536), (1536, 384)):
        dense = torch.nn.Linear(in_features, out_features)
        layers = {"90% csr": SparseLinear.from_linear(dense, sparsity=0.9),
                  "2:4": SparseLinear.from_linear(dense, pattern="2:4")}
        for rows in args.rows:
            x = torch.randn(rows, in_features, requires_grad=True)
            upstream = torch.randn(rows, out_features)
            base = median_seconds(step(dense, x, upstream, list(dense.parameters())), repeats=args.repeats)
            print(f"Linear({in_features}, {out_features}), {rows} rows: dense torch {base * 1e3:.3f} ms")
            for name, sparse in layers.items():
                ours = median_seconds(step(sparse, x, upstream, list(sparse.parameters())), repeats=args.repeats)
                with torch.no_grad():
                    forward = median_seconds(lambda s=sparse, x=x: s(x), repeats=args.repeats)
                line = (f"  SparseLinear {name}: {ours * 1e3:.3f} ms (forward alone {forward * 1e3:.3f} ms), "
                        f"dense/ours {base / ours:.2f}x")
                if name == "90% csr":
                    layer, params = torch_sparse_layer(sparse)
                    theirs = median_seconds(step(layer, x, upstream, params), repeats=args.repeats)
                    line += f"; torch.sparse COO {theirs * 1e3:.3f} ms, torch.sparse/ours {theirs / ours:.2f}x"
                print(line)


if __name__ == "__main__":
    main()
