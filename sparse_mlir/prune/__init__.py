"""Pruning: which weights a sparse model keeps, by magnitude or calibrated on activations.

``magnitude``, ``n_m`` and ``block`` rank weights by size; ``wanda`` by size
times the norm of the input feature they multiply; ``sparsegpt`` prunes
column by column and updates the remaining weights to make up for what was
removed (second order, from the inputs' Gram matrix), then solves the kept
weights exactly; ``admm`` chooses the mask by ADMM with gradually rising
sparsity, which can revise earlier choices, then solves them the same way.  All return the sparse
tensor kernels run on and the boolean mask a training loop keeps; the
calibrated ones take a ``Calibration`` of the layer's inputs (``collect`` gathers one per layer
of a torch model with forward hooks; ``prune_sequentially`` calibrates each
layer on inputs that went through the layers already pruned, as the papers do).
"""

from sparse_mlir.prune.by_magnitude import block, by_magnitude, magnitude, n_m
from sparse_mlir.prune.calibrated import Calibration, admm, corrected_bias, sparsegpt, wanda
from sparse_mlir.prune.hooks import collect
from sparse_mlir.prune.masks import Pattern, apply_mask, pattern_of, satisfies_n_m
from sparse_mlir.prune.sequential import prune_sequentially, stages

__all__ = ["magnitude", "n_m", "block", "by_magnitude", "wanda", "sparsegpt", "admm", "Calibration", "corrected_bias",
           "collect", "prune_sequentially", "stages", "Pattern", "pattern_of", "apply_mask", "satisfies_n_m"]
