"""Small-batch ``SparseLinear`` against ``nn.Linear`` with each layer's weight out of cache, as in a forward.

A model's forward walks its layers one after another, so by the time a
layer runs again its weight has left L2: a layer timed alone, back to back,
reads its weight from L2 and looks faster than it runs in a model.  Here
``--layers`` different layers of one shape are called in turn on the same
batch, and a call's time is the round's time over the layers.

``python benchmarks/layers_in_turn.py [--rows 10] [--threads 1] [--layers 24] [--rounds 30]``: MiniLM's
three Linear shapes, pruned 2:4 and to 90%, us per layer call, the median over rounds (sparse and dense
taking turns, round by round); ratio = dense time / sparse time (above 1: sparse faster).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from sparse_mlir.torch import SparseLinear

SHAPES = ((384, 384), (1536, 384), (384, 1536))  # (out, in): attention, the MLP's first and second Linear
PRUNINGS = (("2:4", {"pattern": "2:4"}), ("90%", {"sparsity": 0.9}))


def per_call(layers: list[torch.nn.Module], x: torch.Tensor) -> float:
    """Seconds per layer call for one pass over ``layers``."""
    start = time.perf_counter()
    for layer in layers:
        layer(x)
    return (time.perf_counter() - start) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10, help="batch rows (a 10-token sentence: 10)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=24, help="different layers called in turn")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["SPARSE_MLIR_NUM_THREADS"] = str(args.threads)  # our kernels read it at each call
    torch.manual_seed(0)
    print(f"{args.rows} rows, {args.threads} thread(s), {args.layers} layers in turn, {args.rounds} rounds; "
          f"us per layer call, ratio = dense / sparse (above 1: sparse faster)")
    with torch.inference_mode():
        for out_features, in_features in SHAPES:
            dense = [torch.nn.Linear(in_features, out_features) for _ in range(args.layers)]
            x = torch.randn(args.rows, in_features)
            for label, options in PRUNINGS:
                sparse = [SparseLinear.from_linear(layer, **options) for layer in dense]
                for layers in (sparse, dense):  # warm: kernels compiled and loaded, pools started
                    per_call(layers, x)
                times: dict[str, list[float]] = {"sparse": [], "dense": []}
                for _ in range(args.rounds):
                    times["sparse"].append(per_call(sparse, x))
                    times["dense"].append(per_call(dense, x))
                s, d = (float(np.median(times[k])) * 1e6 for k in ("sparse", "dense"))
                print(f"  {out_features} x {in_features} {label}: sparse {s:.1f}, dense {d:.1f}, ratio {d / s:.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
