"""all-MiniLM-L6-v2, loaded with sentence-transformers, its 36 encoder Linears pruned and run on sparse kernels.

For magnitude, Wanda, SparseGPT and ADMM pruning at 50%, 2:4 and 90% it prints:

* the cosine of the pruned model's sentence embeddings to the unpruned
  model's, on sentences that were not used for calibration;
* for ADMM at 90%, the cosine after gradual pruning with fine-tuning
  (``minilm.prune_gradually``: ADMM 60%, 100 Adam steps distilling the
  dense model's embeddings and each block's hidden states on generated
  sentences with the mask fixed, ADMM 80% from those weights and 100 more,
  then ADMM 90% and 1600; ``--steps`` scales that schedule; only the stored
  values and the dense parts train: about 25 minutes on one core);
* the time of a forward pass (a batch of sentences, padded to 128 tokens) of
  the sparse model (each MLP, its GELU included, run as one kernel:
  ``minilm.fuse_feed_forward``), of the same pruned weights on dense torch Linears, and
  of the unpruned model, all measured in this process (medians); ratios
  above 1 mean the sparse model is faster.

    pip install -e ".[test]" && python examples/minilm_sparse.py [--quick] [--batch 32]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from sparse_mlir.models import minilm
from sparse_mlir.timing import median_seconds

HELD_OUT = ["Sparse kernels close the efficiency gap.", "The weather is nice.", "The stock market rose on Tuesday.",
            "Children are playing chess in the library.", "He cooked dinner for his friends.",
            "A plane is landing at the airport.", "The museum opens at nine in the morning.",
            "She fixed the bicycle with an old wrench."]
# 32 more hand-written sentences (none generated, none used for calibration): the "cos40" column
MORE_HELD_OUT = [
    "Why did the meeting start so late yesterday?", "My grandmother grows tomatoes in her garden.",
    "The hospital hired twenty new nurses this year.", "Rain is expected over the weekend in the north.",
    "Can you send me the report before Friday?", "The orchestra played Beethoven's fifth symphony.",
    "A cyclist was injured in a crash on the main road.", "The recipe calls for two cups of flour.",
    "Scientists discovered a new species of frog in Peru.", "I lost my keys somewhere in the kitchen.",
    "The company reported record profits for the quarter.", "Our flight was delayed by three hours.",
    "The kids built a sandcastle on the beach.", "Python is a popular programming language.",
    "The judge dismissed the case for lack of evidence.", "He has been learning Japanese for two years.",
    "The bridge was closed for repairs last month.", "A black cat crossed the empty street.",
    "Vaccines protect people against serious diseases.", "She won the tennis tournament in straight sets.",
    "The printer on the second floor is out of paper.", "Electric cars are becoming cheaper every year.",
    "The river flooded several villages after the storm.", "They are planning a trip to the mountains.",
    "The teacher explained fractions with slices of pizza.", "This laptop battery lasts about ten hours.",
    "A crowd gathered to watch the fireworks.", "The soup tastes better with a little salt.",
    "The government announced new tax rules.", "Two dogs are chasing a ball in the yard.",
    "The library will be closed on public holidays.", "He apologized for forgetting her birthday."]
PRUNINGS = (("50%", {"sparsity": 0.5}), ("2:4", {"pattern": "2:4"}), ("90%", {"sparsity": 0.9}))


def forward_ms(model, features: dict[str, torch.Tensor], repeats: int) -> float:
    """Median milliseconds of one forward pass of the whole model on tokenized ``features``."""
    with torch.inference_mode():
        return median_seconds(lambda: model(features), repeats) * 1e3


def _cosines(model, reference) -> tuple[float, float]:
    """Cosine to the unpruned embeddings on the first 8 held-out sentences (earlier sessions' figure) and on all 40."""
    got = minilm.embed(model, HELD_OUT + MORE_HELD_OUT)
    return minilm.cosine(got[:len(HELD_OUT)], reference[:len(HELD_OUT)]), minilm.cosine(got, reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="sentences per forward pass (padded to 128 tokens)")
    parser.add_argument("--quick", action="store_true", help="magnitude and Wanda only, fewer repeats")
    parser.add_argument("--steps", type=int, default=sum(minilm.GRADUAL_STEPS),
                        help="fine-tuning steps for the gradual ADMM 90%% model, shared out as in "
                             "minilm.GRADUAL_STEPS (0: none; about 0.6-0.8 s a step on 1 thread)")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    model = minilm.load()
    reference = minilm.embed(model, HELD_OUT + MORE_HELD_OUT)
    batch = (HELD_OUT * (args.batch // len(HELD_OUT) + 1))[:args.batch]
    features = (model.preprocess if hasattr(model, "preprocess") else model.tokenize)(batch)
    # padded (and masked) to 128 tokens, the sequence length the targets are measured at
    features = {k: torch.nn.functional.pad(v, (0, 128 - v.shape[1])) if torch.is_tensor(v) and v.ndim == 2 else v
                for k, v in features.items()}
    total = sum(minilm.GRADUAL_STEPS)
    schedule = [args.steps * n // total for n in minilm.GRADUAL_STEPS[:-1]]
    schedule.append(args.steps - sum(schedule))
    unpruned_ms = forward_ms(model, features, repeats)
    print(f"all-MiniLM-L6-v2, forward of {args.batch} x 128 tokens, {torch.get_num_threads()} threads: "
          f"unpruned dense model {unpruned_ms:.1f} ms")
    print("cosine: to the unpruned model's embeddings on 8 (cos8) and 40 (cos40) held-out sentences; tuned: "
          f"cos8/cos40 after gradual pruning ({' -> '.join(f'{s:.0%}' for s in minilm.GRADUAL_SPARSITIES)}) "
          f"with {schedule} steps of fine-tuning")
    print(f"{'method':<10} {'pruning':<7} {'cos8':>6} {'cos40':>6} {'tuned':>11} {'prune s':>8} {'sparse ms':>10} "
          f"{'vs dense-pruned':>16} {'vs unpruned':>12}")
    training = minilm.training_sentences(model=model)
    for method in minilm.METHODS[:2] if args.quick else minilm.METHODS:
        for label, kw in PRUNINGS:
            sparse = copy.deepcopy(model)
            start = time.perf_counter()
            report = minilm.prune_encoder(sparse, method, **kw)
            prune_s = time.perf_counter() - start
            minilm.fuse_feed_forward(sparse)  # each MLP (GELU included) as one kernel
            cosines = _cosines(sparse, reference)
            sparse_ms = forward_ms(sparse, features, repeats)
            dense_ms = forward_ms(minilm.pruned_dense(model, report), features, repeats)
            tuned = "-"
            if label == "90%" and method == "admm" and args.steps:
                tuned_model = copy.deepcopy(model)
                minilm.prune_gradually(tuned_model, "admm", steps=schedule, sentences=training, teacher=model)
                tuned = "{:.3f}/{:.3f}".format(*_cosines(tuned_model, reference))
            print(f"{method:<10} {label:<7} {cosines[0]:6.3f} {cosines[1]:6.3f} {tuned:>11} {prune_s:8.1f} "
                  f"{sparse_ms:10.1f} "
                  f"{dense_ms / sparse_ms:15.2f}x {unpruned_ms / sparse_ms:11.2f}x", flush=True)


if __name__ == "__main__":
    main()
