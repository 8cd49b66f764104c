"""MiniLM forward speed (issue 18): the sparse model against the dense torch models a user would run instead.

all-MiniLM-L6-v2 (sentence-transformers), a batch of sentences padded to
128 tokens, ``torch.inference_mode``.  Compared side by side in this one
process, at 2:4 and at 90% unstructured (magnitude pruning: the speed does
not depend on how the weights were chosen):

* the unpruned dense model (the issue's baseline);
* the dense-pruned model: the same pruned weights in ordinary ``nn.Linear``
  layers (what masked-dense pruning runs);
* the sparse model: the 36 encoder Linears as ``SparseLinear``, each MLP's
  GELU fused into the first one's kernel and both its Linears run as one
  kernel (``minilm.fuse_feed_forward``).

``python benchmarks/minilm_speed.py [--threads 2 1] [--rounds 5] [--repeats 3] [--batch 32] [--tokens 128]
[--profile]`` (``--batch 1 --tokens 0``: one unpadded sentence, the latency a single query sees).
For each thread count (torch and our kernels get the same number) the
models take turns, round after round, the order rotating each round, so a
shared machine's drifting load falls on all of them alike; a model's time
is the median over rounds of the median of ``repeats`` forwards, and each
ratio is the median of the per-round ratios ``baseline time / sparse time``
(above 1: the sparse model is faster), printed with its range over rounds
as the noise.  ``--profile`` adds, per model, torch.profiler's self CPU time
per operator (one forward), to see where the time goes.

The environment is used as it is and printed: torch's CPU wheel runs its
operators on libgomp, whose idle workers spin for milliseconds after each
operator (``GOMP_SPINCOUNT``, read when torch loads) on the cores our
kernels' threads then need.  At 2 threads ``GOMP_SPINCOUNT=0`` took the 90%
model from 277 to 224 ms, and the dense model from 431 to 481 ms (443 to
444 in another pair of runs); run both ways to see it.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sparse_mlir.models import minilm

SENTENCES = ["Sparse kernels close the efficiency gap.", "The weather is nice.", "The stock market rose on Tuesday.",
             "Children are playing chess in the library.", "He cooked dinner for his friends.",
             "A plane is landing at the airport.", "The museum opens at nine in the morning.",
             "She fixed the bicycle with an old wrench."]
PRUNINGS = (("2:4", {"pattern": "2:4"}), ("90%", {"sparsity": 0.9}))
TOKENS = 128


def host() -> str:
    """The CPU model, cores and widest vector extension of this machine, read from the system, and the load."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    vector = next((name for name in ("avx512f", "avx2", "sse4_2") if name in flags), "unknown")
    spin = os.environ.get("GOMP_SPINCOUNT", "unset (libgomp's default)")
    return (f"{model}, {os.cpu_count()} cores, widest vectors {vector}, "
            f"load average {os.getloadavg()[0]:.2f}, GOMP_SPINCOUNT {spin}")


def batch_features(model: Any, batch: int, tokens: int = TOKENS) -> dict[str, torch.Tensor]:
    """``batch`` tokenized sentences padded (and masked) to ``tokens`` tokens (``TOKENS``, the length issue 18
    measures at), or as long as the longest of them when ``tokens`` is 0 (what one sentence's latency sees)."""
    sentences = (SENTENCES * (batch // len(SENTENCES) + 1))[:batch]
    features = (model.preprocess if hasattr(model, "preprocess") else model.tokenize)(sentences)
    if not tokens:
        return features
    return {k: torch.nn.functional.pad(v, (0, tokens - v.shape[1])) if torch.is_tensor(v) and v.ndim == 2 else v
            for k, v in features.items()}


def forward(model: Any, features: dict[str, torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
    """One forward of ``model`` on a fresh copy of ``features`` (sentence-transformers adds its outputs to the
    dict it is given and returns that dict: two calls on one dict would return the same object)."""
    def run() -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            return model(dict(features))
    return run


def wall_and_cpu(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of this process (all its threads) over ``repeats`` calls, after
    one warm-up call.

    Why CPU time too: on a machine shared with other work, wall time counts
    the time other processes held the cores; CPU time counts only the work
    done here (and, with threads, their spinning), so at one thread it is
    the figure that stays put while the load swings.
    """
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return float(np.median(wall)), float(np.median(cpu))


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, repeats: int
                ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds per forward of each variant, ``rounds`` times, taking turns in an order that rotates
    each round."""
    names = list(variants)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, cpu_seconds = wall_and_cpu(variants[name], repeats)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
    return wall, cpu


def print_times(times: dict[str, list[float]]) -> None:
    """Each variant's median [range] in ms; for the sparse ones the ratios to both baselines."""
    for name, samples in times.items():
        digits = 0 if np.median(samples) >= 0.1 else 1  # a sentence's few milliseconds need a decimal
        line = (f"    {name}: {np.median(samples) * 1e3:.{digits}f} ms "
                f"[{min(samples) * 1e3:.{digits}f}-{max(samples) * 1e3:.{digits}f}]")
        if name.startswith("sparse"):
            label = name.split(" ", 1)[1]
            for baseline in ("dense", f"dense-pruned {label}"):
                ratios = np.divide(times[baseline], samples)
                line += f", {baseline}/sparse {np.median(ratios):.2f}x [{ratios.min():.2f}-{ratios.max():.2f}]"
        print(line, flush=True)


def profile(name: str, run: Callable[[], object], top: int = 8) -> None:
    """torch.profiler's self CPU time per operator over one forward (after a warm-up one)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / 1e3
    listed = ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.0f}" for e in rows[:top])
    print(f"    profile {name} ({total:.0f} ms self CPU): {listed}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="forwards per round (their median is the round's)")
    parser.add_argument("--batch", type=int, default=32, help="sentences per forward")
    parser.add_argument("--tokens", type=int, default=TOKENS,
                        help="tokens per sentence, padded; 0: as long as the longest sentence (small-batch latency)")
    parser.add_argument("--profile", action="store_true", help="print where each model's forward spends its time")
    args = parser.parse_args()
    print(f"host: {host()}; torch {torch.__version__}")
    dense = minilm.load()
    features = batch_features(dense, args.batch, args.tokens)
    tokens = features["input_ids"].shape[1]
    variants: dict[str, Callable[[], object]] = {"dense": forward(dense, features)}
    for label, options in PRUNINGS:
        sparse = copy.deepcopy(dense)
        report = minilm.prune_encoder(sparse, "magnitude", **options)
        # each MLP's GELU in its first SparseLinear's kernel, then both Linears of each MLP in one kernel
        fused = minilm.fuse_feed_forward(sparse)
        variants[f"dense-pruned {label}"] = forward(minilm.pruned_dense(dense, report), features)
        variants[f"sparse {label}"] = forward(sparse, features)
        # the same numbers on both paths, or the timing compares different work
        got, want = variants[f"sparse {label}"](), variants[f"dense-pruned {label}"]()
        error = (got["sentence_embedding"] - want["sentence_embedding"]).abs().max().item()
        print(f"{label}: {report.layers} SparseLinear layers ({fused} MLPs fused with their GELU), "
              f"{report.sparsity:.1%} sparse; max difference of the "
              f"embeddings to the dense-pruned model {error:.1e}")
    for threads in args.threads:  # both sides get the same count (our kernels read it at each call)
        torch.set_num_threads(threads)
        os.environ["SPARSE_MLIR_NUM_THREADS"] = str(threads)
        for run in variants.values():
            run()  # warm: kernels compiled and loaded, torch's pools started
        started = time.strftime("%H:%M:%S", time.gmtime())
        wall, cpu = interleaved(variants, args.rounds, args.repeats)
        print(f"{args.batch} x {tokens} tokens, {threads} thread(s), {started} UTC, {args.rounds} rounds of "
              f"{args.repeats} forwards, load average now {os.getloadavg()[0]:.2f}; ratio = baseline time / sparse "
              f"time (above 1: sparse faster), median of per-round ratios [range]")
        print("  wall time:")
        print_times(wall)
        print("  CPU time of this process (all threads; spinning counts):")
        print_times(cpu)
        if args.profile:
            for name, run in variants.items():
                profile(name, run)


if __name__ == "__main__":
    main()
