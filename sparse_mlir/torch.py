"""PyTorch integration: ``SparseLinear``, ``sparsify`` and ``sparsity_report`` (needs the ``torch`` extra).

``SparseLinear`` computes ``torch.nn.Linear``'s ``y = x W^T + b`` with the
weight pruned into a sparse format, in float32 or float64 (the weight's
dtype; ``.double()`` switches).  Forward and backward are kernels from the
MLIR pipeline, called through the custom operators of
``sparse_mlir.torch_ops``, so autograd works (gradients for the input, the
bias and the stored weights only: fine-tuning keeps the mask; first
derivatives only, a double backward raises torch's "no autograd formula") and
``torch.compile`` and ``torch.export`` trace through the layer (one custom
operator in the graph); ``torch.jit.script`` is refused (``OptionError``),
``torch.jit.trace`` records the operator.  Leading batch dimensions are
flattened into rows.  The layer runs on the CPU; a CUDA weight or input is
refused (``DeviceError``).

The weight is the module's state: the stored values are the parameter
``weight_values`` (what an optimizer updates), the other level buffers of
its format are buffers (``weight_pos1``, ``weight_crd1`` for CSR), and the
format and shape are extra state, so ``state_dict()`` holds it and
``load_state_dict`` restores it exactly: the loaded buffers are validated
like any ``SparseTensor`` (they may hold a different number of entries) and
a checkpoint of another format or shape is refused, never half-applied.  A
dense checkpoint (``weight``, as ``nn.Linear`` saves it) is pruned again by
the layer's recipe, with a warning saying what was kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from sparse_mlir import prune
from sparse_mlir.errors import (
    DeviceError,
    DTypeError,
    FormatError,
    OperandError,
    OptionError,
    PatternError,
    ShapeError,
    SparseMLIRError,
)
from sparse_mlir.formats import (
    CSR,
    NM,
    Format,
    as_format,
    format_from_json,
    format_to_json,
)
from sparse_mlir.tensor.host import SparseTensor
from sparse_mlir.torch_ops import (
    ACTIVATIONS,
    TransposedPattern,
    feed_forward,
    format_key,
    linear,
    operator_weight,
    run_feed_forward,
    run_linear,
    runs_directly,
    transposed_pattern,
)

__all__ = ["Pruning", "SparseFeedForward", "SparseLinear", "SparsityReport", "sparsify", "sparsity_report"]

_BUFFER = "weight_"  # state-dict name of each level buffer: weight_pos1, weight_crd1, weight_values
_PATTERN = "_pattern_"  # the backward's index buffers (not saved: derived from the weight's pattern)
_EXTRA_STATE = "_extra_state"  # torch's key for get_extra_state()
_DTYPES = (torch.float32, torch.float64)
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pruning:
    """How a dense weight becomes this layer's sparse one: ``n:m`` groups or a fraction of zeros, and a format.

    Checked when built, so conflicting or ineffective options raise before any
    layer is touched; kept by ``SparseLinear`` to re-prune a dense checkpoint.
    """

    pattern: tuple[int, int] | None = None
    sparsity: float | None = None
    format: Format = CSR

    @classmethod
    def from_options(cls, pattern: str | None = None, sparsity: float | None = None,
                     format: Format | str | None = None) -> Pruning:
        if pattern is not None and sparsity is not None:
            raise OptionError(f"pattern={pattern!r} conflicts with sparsity={sparsity!r}: an N:M pattern fixes the "
                              f"sparsity (n/m kept); give one of them")
        fmt = None if format is None else as_format(format, 2)
        if pattern is not None:
            match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", pattern) if isinstance(pattern, str) else None
            if match is None:
                raise PatternError(f"pattern must be 'N:M' such as '2:4', got {pattern!r}")
            n, m = int(match.group(1)), int(match.group(2))
            nm = NM(n, m)
            if fmt is not None and (fmt.block_factors and not fmt.is_nm or fmt.is_nm and fmt != nm):
                raise OptionError(f"format {fmt} does not store an {n}:{m} pattern as such (blocks or groups of "
                                  f"another size would store the pruned zeros); use {n}:{m}, csr or coo")
            return cls(pattern=(n, m), format=nm if fmt is None else fmt)
        if sparsity is None:
            raise OptionError("give pattern='N:M' (structured) or sparsity=fraction (unstructured) to prune weights")
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
            raise PatternError(f"sparsity is the fraction of weights removed, in [0, 1), got {sparsity!r}")
        if fmt is not None and (fmt.is_nm or fmt.block_factors):
            raise OptionError(f"unstructured pruning (sparsity=) into format {fmt} is ineffective: "
                              + ("an N:M format needs pattern='N:M'" if fmt.is_nm else
                                 "a block format stores every block holding a kept weight, zeros included; prune "
                                 "blocks with sparse_mlir.prune.block and wrap the result in SparseLinear"))
        return cls(sparsity=float(sparsity), format=CSR if fmt is None else fmt)

    @classmethod
    def of(cls, weight: SparseTensor) -> Pruning:
        """The recipe that keeps a weight's kind of sparsity (a layer built from a weight, not by ``from_linear``)."""
        fmt = weight.format
        if fmt.is_nm:
            level = fmt.levels[-1]
            return cls(pattern=(level.n, level.m), format=fmt)
        return cls(sparsity=1.0 - weight.nnz / max(1, int(np.prod(weight.shape))), format=fmt)

    def apply(self, dense: np.ndarray) -> SparseTensor:
        """Prune ``dense`` (2-d) by this recipe."""
        if self.pattern is not None:
            return prune.n_m(dense, *self.pattern, format=self.format)[0]
        if self.format.block_factors:
            factors = self.format.block_factors
            return prune.block(dense, self.sparsity, (factors[0], factors[1]), format=self.format)[0]
        return prune.magnitude(dense, self.sparsity, format=self.format)[0]

    def __str__(self) -> str:
        what = f"{self.pattern[0]}:{self.pattern[1]}" if self.pattern else f"sparsity={self.sparsity:.3g}"
        return f"{what} stored as {self.format}"


def _versions(tensors: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """The in-place change counts of ``tensors``, or ``None`` for inference tensors (which keep none)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


class SparseLinear(nn.Module):
    """A drop-in for ``nn.Linear`` whose weight is pruned: trains its stored weights, keeps its mask."""

    def __init__(self, weight: SparseTensor, bias: torch.Tensor | None = None, *, pruning: Pruning | None = None,
                 activation: str | None = None):
        super().__init__()
        self.activation = activation
        if not isinstance(weight, SparseTensor) or weight.ndim != 2:
            raise OperandError(f"SparseLinear needs a 2-d SparseTensor weight, got {weight!r}")
        if weight.dtype not in (np.float32, np.float64):
            raise DTypeError(f"SparseLinear computes in float32 or float64, the weight is {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self._format, self._shape = weight.format, weight.shape
        self._format_key = format_key(weight.format)
        self.pruning = pruning if pruning is not None else Pruning.of(weight)
        self._adopt(weight.buffers)
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self.out_features,):
                raise ShapeError(f"the bias must be a tensor of shape ({self.out_features},), got "
                                 f"{getattr(bias, 'shape', type(bias).__name__)}")
            bias = nn.Parameter(bias.detach().to(device="cpu", dtype=self.weight_values.dtype, copy=True))
        self.register_parameter("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, pattern: str | None = None, sparsity: float | None = None,
                    format: Format | str | None = None) -> SparseLinear:
        """Prune ``linear``'s weight (``pattern="2:4"`` or unstructured ``sparsity=0.9``) and wrap a copy of it.

        float64 layers stay float64, every other dtype computes in float32.
        """
        recipe = Pruning.from_options(pattern, sparsity, format)
        return cls._pruned(linear, recipe)

    @classmethod
    def _pruned(cls, linear: nn.Linear, recipe: Pruning) -> SparseLinear:
        if not isinstance(linear, nn.Linear):
            raise OperandError(f"from_linear takes a torch.nn.Linear, got {type(linear).__name__}")
        if linear.weight.device.type == "meta":
            raise DeviceError("the Linear's weight is on the meta device (no values to prune); load it first")
        dtype = torch.float64 if linear.weight.dtype == torch.float64 else torch.float32
        weight = recipe.apply(linear.weight.detach().to(device="cpu", dtype=dtype).numpy())
        return cls(weight, linear.bias, pruning=recipe)

    @property
    def activation(self) -> str | None:
        """An activation applied to the output inside the kernel (``"gelu"``, exact), or ``None``: ``act(x W^T + b)``
        in one pass, where a separate activation module would read and write the whole output again."""
        return getattr(self, "_activation", None)  # a layer pickled before activations existed has none

    @activation.setter
    def activation(self, name: str | None) -> None:
        if name is not None and (not isinstance(name, str) or name not in ACTIVATIONS):
            raise OperandError(f"activation must be None or one of {', '.join(sorted(ACTIVATIONS))}, got {name!r}")
        self._activation = name

    # -- the sparse weight as a parameter and buffers -----------------------------------
    def _adopt(self, arrays: tuple[np.ndarray, ...]) -> None:
        """Make ``arrays`` the weight's level buffers and values, and derive the backward's patterns from them.

        Values of the same size and dtype are copied into the existing
        parameter, so an optimizer built over it keeps training it.
        """
        *levels, values = arrays
        for name, array in zip(self._format.buffer_names, levels):
            self.register_buffer(_BUFFER + name, torch.from_numpy(np.array(array, copy=True)))
        values = torch.from_numpy(np.array(values, copy=True))
        current = self._parameters.get("weight_values")
        if current is not None and current.shape == values.shape and current.dtype == values.dtype:
            with torch.no_grad():
                current.copy_(values)
        else:
            self.weight_values = nn.Parameter(values)
        pattern = transposed_pattern(self.weight)
        for name, tensor in zip(pattern._fields, pattern):
            self.register_buffer(_PATTERN + name, tensor, persistent=False)

    @property
    def _levels(self) -> list[torch.Tensor]:
        buffers = self._buffers  # not getattr: nn.Module's attribute fallback costs 0.5 us a name, every call
        return [buffers[_BUFFER + name] for name in self._format.buffer_names[:-1]]

    @property
    def weight(self) -> SparseTensor:
        """The weight as a ``SparseTensor`` over the module's buffers and values (shared memory, read-only)."""
        if any(t.device.type != "cpu" for t in (*self._levels, self.weight_values)):
            raise DeviceError(f"the weight is on {self.weight_values.device}; SparseLinear runs on the CPU")
        return self._operands()[0]

    def _operands(self) -> tuple[SparseTensor, np.ndarray | None]:
        """The weight's ``SparseTensor`` and the bias as an array, built once and kept while the buffers, values
        and bias are the same memory (they are read in place, so changed values need no rebuild; replaced or moved
        tensors get new ones)."""
        values, bias = self._parameters["weight_values"], self._parameters.get("bias")
        levels = self._levels
        key = [(t.data_ptr(), t.shape, t.dtype) for t in (*levels, values, *(() if bias is None else (bias,)))]
        versions = _versions(levels)  # a level buffer changed in place is checked again (``operator_weight``)
        key.append(object() if versions is None else versions)  # none kept: rebuilt, so checked, every call
        kept = self.__dict__.get("_kept_operand")
        if kept is None or kept[0] != key:  # the operators' own wrapping (the kernels' C path keys on its format)
            weight = operator_weight(self._format_key, list(self._shape), levels, values)
            kept = (key, weight, None if bias is None else bias.detach().numpy())
            self.__dict__["_kept_operand"] = kept
        return kept[1], kept[2]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_kept_operand", None)  # views of this module's tensors: rebuilt on the first call
        return state

    def get_extra_state(self) -> dict[str, Any]:
        """The weight's format and shape: what its buffers mean, saved beside them."""
        return {"format": format_to_json(self._format), "shape": list(self._shape)}

    def set_extra_state(self, state: Any) -> None:
        """Refuse a checkpoint whose weight has another format or shape than this layer's kernels."""
        try:
            fmt, shape = format_from_json(state["format"]), tuple(int(n) for n in state["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"the checkpoint's SparseLinear extra state is not a format and shape: {exc!r}") \
                from None
        if fmt != self._format or shape != self._shape:
            raise FormatError(f"the checkpoint's weight is {fmt} of shape {shape}, but this SparseLinear was built "
                              f"for {self._format} of shape {self._shape} (its kernels are compiled for them)")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Load the level buffers whole (their lengths follow the checkpoint's entries), checked before any change.

        torch would copy each buffer into the current one, which needs equal
        lengths and never checks that they form a valid tensor; a bad or
        mismatched checkpoint must raise before anything is overwritten.  A
        dense ``weight`` (an ``nn.Linear`` checkpoint) is re-pruned instead.
        """
        keys = [prefix + _BUFFER + name for name in self._format.buffer_names]
        dense = state_dict.pop(prefix + "weight", None) if not any(k in state_dict for k in keys) else None
        if dense is None and prefix + _EXTRA_STATE in state_dict:
            self.set_extra_state(state_dict[prefix + _EXTRA_STATE])
        taken = {key: state_dict.pop(key) for key in keys if key in state_dict}  # torch's own copy of the dict
        arrays = self._checked_arrays(prefix, [taken[key] for key in keys]) if len(taken) == len(keys) else None
        if dense is not None:
            arrays = self._repruned(prefix, dense)
            taken = dict.fromkeys([*keys, prefix + _EXTRA_STATE])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        missing_keys[:] = [key for key in missing_keys if key not in taken]
        if taken and arrays is None:
            error_msgs.append(f"{prefix}weight: the checkpoint has {sorted(taken)} but not "
                              f"{sorted(set(keys) - set(taken))}; a sparse weight needs all its level buffers")
        if arrays is not None:
            self._adopt(arrays)

    def _repruned(self, prefix: str, dense: Any) -> tuple[np.ndarray, ...]:
        """A dense checkpoint weight pruned by this layer's recipe, with a warning saying what was kept."""
        if not isinstance(dense, torch.Tensor):
            raise OperandError(f"{prefix}weight: the checkpoint's dense weight must be a tensor, got "
                               f"{type(dense).__name__}")
        if dense.device.type == "meta" or dense.is_complex() or dense.layout != torch.strided:
            raise OperandError(f"{prefix}weight: a dense weight to prune must hold real values in a strided tensor, "
                               f"got a {dense.dtype} {dense.layout} tensor on {dense.device}")
        if tuple(dense.shape) != (self.out_features, self.in_features):
            raise ShapeError(f"{prefix}weight: the checkpoint's dense weight has shape "
                             f"{tuple(getattr(dense, 'shape', ()))}, this SparseLinear is "
                             f"({self.out_features}, {self.in_features})")
        array = dense.detach().to(device="cpu", dtype=self.weight_values.dtype).numpy()
        tensor = self.pruning.apply(array)
        if tensor.format != self._format:  # a recipe's format fits its pattern (index widths may grow)
            raise FormatError(f"{prefix}weight: re-pruning gave format {tensor.format}, the layer's kernels are for "
                              f"{self._format}")
        warnings.warn(f"{prefix}weight: a dense weight {tuple(dense.shape)} was loaded into a SparseLinear by "
                      f"pruning it again ({self.pruning}): {tensor.nnz} of {array.size} entries stored, "
                      f"{1 - tensor.nnz / array.size:.1%} sparse", UserWarning, stacklevel=4)
        return tensor.buffers

    def _checked_arrays(self, prefix: str, tensors: list[Any]) -> tuple[np.ndarray, ...]:
        """The checkpoint's level buffers as arrays, validated as this layer's format, shape and dtype."""
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise FormatError(f"{prefix}weight: level buffers must be tensors, got "
                              f"{[type(t).__name__ for t in tensors]}")
        arrays = tuple(t.detach().cpu().contiguous().numpy() for t in tensors)
        try:
            tensor = SparseTensor.from_buffers(self._format, self._shape, arrays)
        except SparseMLIRError as exc:
            raise type(exc)(f"{prefix}weight: the checkpoint's level buffers are not a valid {self._format} "
                            f"tensor of shape {self._shape}: {exc}") from exc
        if torch.from_numpy(tensor.values[:0]).dtype != self.weight_values.dtype:
            raise FormatError(f"{prefix}weight: the checkpoint's values are {tensor.dtype}, this layer computes in "
                              f"{self.weight_values.dtype}")
        return arrays

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` calls this first: refuse plainly instead of failing deep in the script compiler."""
        raise OptionError("SparseLinear cannot be compiled by torch.jit.script (its kernels are called from Python); "
                          "use torch.compile, or torch.jit.trace")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, values, bias = self._checked(x)
        if runs_directly(rows, values, bias):
            out = run_linear(rows, *self._operands(), self.activation or "")
        else:
            pattern = [getattr(self, _PATTERN + name) for name in TransposedPattern._fields]
            out = linear(rows, values, bias, self._levels, pattern, self._format_key, self._shape,
                         self.activation or "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def _checked(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x`` as rows of ``in_features``, the weight's values and the bias, once all three are checked for this
        layer's kernels (CPU, dtype, sizes)."""
        values, bias = self._checked_weight()
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            raise OperandError(f"SparseLinear takes a dense torch.Tensor, got "
                               f"{x.layout if isinstance(x, torch.Tensor) else type(x).__name__}")
        if not x.is_cpu:
            raise DeviceError(f"SparseLinear runs on the CPU in this build; the input or weight is on {x.device}")
        if x.dtype != values.dtype:
            raise OperandError(f"SparseLinear computes in {values.dtype} (its weight's dtype), got {x.dtype}; "
                               f"cast the input, or the layer with .float() / .double()")
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise OperandError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        return x.reshape(math.prod(x.shape[:-1]), self.in_features), values, bias  # -1 is ambiguous for 0 features

    def _checked_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight's values and the bias, checked for this layer's kernels (CPU, dtype, sizes).  Parameters and
        buffers are read from their dictionaries, not through nn.Module's attribute fallback (0.5 us each, on
        every call)."""
        values, bias = self._parameters["weight_values"], self._parameters.get("bias")
        if not values.is_cpu:
            raise DeviceError(f"SparseLinear runs on the CPU in this build; the input or weight is on "
                              f"{values.device}")
        dtype = values.dtype
        if dtype not in _DTYPES:
            raise DTypeError(f"SparseLinear computes in float32 or float64, its weight is {dtype}")
        stored = self._buffers[_PATTERN + "crd"].shape
        if values.shape != stored:
            raise ShapeError(f"weight_values has shape {tuple(values.shape)}, but the weight's pattern stores "
                             f"{stored.numel()} entries (replace values in place, or load a state dict)")
        if bias is not None and (bias.dtype != dtype or bias.shape != (self.out_features,)):
            raise OperandError(f"the bias is {bias.dtype} of shape {tuple(bias.shape)}, the layer needs "
                               f"{dtype} of shape ({self.out_features},)")
        return values, bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self._format}, "
                f"nnz={self.weight_values.numel()}, bias={self.bias is not None}"
                + (f", activation={self.activation}" if self.activation else ""))


class SparseFeedForward(nn.Module):
    """Two ``SparseLinear`` layers in a chain, ``second(first(x))``, run as one kernel when no gradient is wanted.

    A transformer's feed-forward block: ``first`` (with its activation,
    ``SparseLinear.activation``, or a bias) widens, ``second`` narrows.  As
    two kernels the wide hidden activations go to memory and back; fused
    (``dialects.native.mlp``) each block of rows keeps them in cache.
    MiniLM's FFN at 90% (4096 rows, 1 thread): 23.5-24.8 ms as two layers,
    18.9-19.3 ms fused (2:4: 72-73 and 63-65 ms).  With autograd recording
    (training), the two layers run their own differentiable operators.  The layers stay submodules: their state dict
    entries are theirs, under ``first.`` and ``second.``.
    """

    def __init__(self, first: SparseLinear, second: SparseLinear):
        super().__init__()
        if not isinstance(first, SparseLinear) or not isinstance(second, SparseLinear):
            raise OperandError(f"SparseFeedForward takes two SparseLinear layers, got {type(first).__name__} and "
                               f"{type(second).__name__}")
        if first.out_features != second.in_features:
            raise ShapeError(f"the first layer has {first.out_features} outputs, the second takes "
                             f"{second.in_features} inputs")
        if first.activation is None and first.bias is None:
            raise OperandError("a fused feed-forward needs an activation or a bias on the first layer (without "
                               "either the two layers are one linear map: multiply the weights instead)")
        self.first, self.second = first, second

    def __prepare_scriptable__(self) -> nn.Module:
        raise OptionError("SparseFeedForward cannot be compiled by torch.jit.script (its kernels are called from "
                          "Python); use torch.compile, or torch.jit.trace")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self._modules["first"], self._modules["second"]  # not nn.Module's attribute fallback
        if torch.is_grad_enabled() and (getattr(x, "requires_grad", False)
                                        or any(p.requires_grad for p in self.parameters())):
            return second(first(x))
        rows, values1, bias1 = first._checked(x)
        values2, bias2 = second._checked_weight()
        if values2.dtype != values1.dtype:
            raise DTypeError(f"the layers compute in {values1.dtype} and {values2.dtype}; cast one of them")
        if runs_directly(rows, values1, bias1, values2, bias2):
            (w1, b1), (w2, b2) = first._operands(), second._operands()
            out = run_feed_forward(rows, w1, b1, first.activation or "", w2, b2)
        else:
            out = feed_forward(rows, (values1, bias1, first._levels, first._format_key, first._shape),
                               first.activation or "",
                               (values2, bias2, second._levels, second._format_key, second._shape))
        return out.reshape(*x.shape[:-1], second.out_features)


@dataclass(frozen=True)
class LayerSparsity:
    """One ``SparseLinear`` of a model: where it is, how it is stored, how sparse it is."""

    name: str
    format: str
    shape: tuple[int, int]
    stored: int

    @property
    def sparsity(self) -> float:
        return 1.0 - self.stored / (self.shape[0] * self.shape[1])


@dataclass(frozen=True)
class SparsityReport:
    """What ``sparsify`` left in a model: its sparse layers and the sparsity they reach together."""

    layers: tuple[LayerSparsity, ...]

    @property
    def sparsity(self) -> float:
        """Zeros over all entries of the sparse layers' weights (stored zeros count as stored)."""
        total = sum(layer.shape[0] * layer.shape[1] for layer in self.layers)
        return 1.0 - sum(layer.stored for layer in self.layers) / total if total else 0.0

    def __str__(self) -> str:
        lines = [f"{layer.name or '(model)'}: {layer.format} {layer.shape[0]}x{layer.shape[1]}, "
                 f"{layer.stored} stored, {layer.sparsity:.1%} sparse" for layer in self.layers]
        return "\n".join([*lines, f"{len(self.layers)} sparse layers, {self.sparsity:.1%} sparse together"])


def sparsity_report(model: nn.Module) -> SparsityReport:
    """The ``SparseLinear`` layers of ``model`` (by qualified name) and their sparsity, read off the model itself."""
    return SparsityReport(tuple(LayerSparsity(name, str(m._format), m._shape, m.weight_values.numel())
                                for name, m in model.named_modules() if isinstance(m, SparseLinear)))


def _shared_weights(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> every qualified name it goes by (a tied weight has more than one)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def sparsify(model: nn.Module, *, pattern: str | None = None, sparsity: float | None = None,
             formats: Format | str | None = None, include: Any = None) -> nn.Module:
    """Replace the ``nn.Linear`` layers of ``model`` by pruned ``SparseLinear`` copies; return the model.

    The model is changed in place; a bare ``nn.Linear`` cannot be, and its
    ``SparseLinear`` is returned.  ``include(name, module)`` (qualified
    names) may select layers.  Layers that cannot be swapped safely are
    skipped with a warning: subclasses of ``nn.Linear`` (their own forward,
    or a parent that reads ``.weight``, as ``MultiheadAttention`` does) and
    linears whose weight is tied to another parameter.  Options are checked
    first; conflicting or ineffective ones raise, and so does converting
    nothing.  What was converted is logged and is ``sparsity_report(model)``.
    """
    recipe = Pruning.from_options(pattern, sparsity, formats)
    if include is not None and not callable(include):
        raise OptionError(f"include must be a function (name, module) -> bool, got {type(include).__name__}")
    if type(model) is nn.Linear:
        if include is not None and not include("", model):
            raise OptionError("sparsify was given one nn.Linear and include() excluded it: nothing to convert")
        converted = SparseLinear._pruned(model, recipe)
        _log.info("sparsify: %s", sparsity_report(converted))
        return converted
    tied = _shared_weights(model)
    chosen, skipped = [], []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or include is not None and not include(name, module):
            continue
        if type(module) is not nn.Linear:
            skipped.append(f"{name} ({type(module).__name__} subclasses nn.Linear)")
        elif len(tied.get(id(module.weight), ())) > 1:
            skipped.append(f"{name} (its weight is tied: {', '.join(tied[id(module.weight)])})")
        else:
            chosen.append(name)
    if skipped:
        warnings.warn(f"sparsify left these layers dense: {'; '.join(skipped)}", UserWarning, stacklevel=2)
    if not chosen:
        raise OptionError("sparsify found no nn.Linear layer to convert" + (f" (skipped: {'; '.join(skipped)})"
                                                                           if skipped else ""))
    converted = {}
    for name in chosen:  # every layer first: a layer that cannot be pruned leaves the model as it was
        try:
            converted[name] = SparseLinear._pruned(model.get_submodule(name), recipe)
        except SparseMLIRError as exc:
            raise type(exc)(f"layer {name}: {exc}") from exc
    for name, layer in converted.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    _log.info("sparsify: %s", sparsity_report(model))
    return model
