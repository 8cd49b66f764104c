"""PyTorch integration: ``SparseLinear`` and ``sparsify`` (inference only; needs the ``torch`` extra).

``SparseLinear`` computes ``torch.nn.Linear``'s ``y = x W^T + b`` with the
weight pruned into a ``SparseTensor``: the generated kernel computes
``Y^T = W X^T + b`` (sparse weight on the left, rows of ``X^T`` contiguous,
which the register-tiled SpMM runs best), and the activations are transposed
once on the way in and viewed transposed on the way out.  CPU tensors cross
to numpy without other copies (``Tensor.numpy()`` shares memory, and the
result comes back through ``torch.from_numpy``); leading batch dimensions
are flattened into rows.  Autograd is not supported: calling it where a
gradient would be needed raises.

The sparse weight lives in the module's buffers, one per level buffer of its
format (``weight_pos1``, ``weight_crd1``, ``weight_values`` for CSR), with
the format and shape as extra state, so ``state_dict()`` holds it and
``load_state_dict`` restores it exactly: the loaded buffers are validated
like any ``SparseTensor`` (they may hold a different number of entries) and
a checkpoint of another format or shape is refused, never half-applied.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from sparse_mlir import prune
from sparse_mlir.api import compile as compile_kernel
from sparse_mlir.errors import DeviceError, FormatError, OperandError, SparseMLIRError
from sparse_mlir.formats import CSR, Format, as_format, format_from_json, format_to_json
from sparse_mlir.tensor.host import SparseTensor

__all__ = ["SparseLinear", "sparsify"]

# the weight on the left: the register-tiled SpMM emitter runs it, bias seeding its accumulators
_LINEAR = "Yt[o,b] = W[o,i] * Xt[i,b]"
_LINEAR_BIAS = "Yt[o,b] = W[o,i] * Xt[i,b] + bias[o]"
_BUFFER = "weight_"  # state-dict name of each level buffer: weight_pos1, weight_crd1, weight_values
_EXTRA_STATE = "_extra_state"  # torch's key for get_extra_state()


class SparseLinear(nn.Module):
    """A drop-in for ``nn.Linear`` whose weight is a pruned ``SparseTensor``."""

    def __init__(self, weight: SparseTensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.ndim != 2:
            raise OperandError(f"SparseLinear needs a 2-d weight, got shape {weight.shape}")
        self.out_features, self.in_features = weight.shape
        self._format, self._shape, self._dtype = weight.format, weight.shape, weight.dtype
        self._adopt(weight.buffers)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous())
        dtype = str(weight.dtype)
        formats = {"W": weight.format}
        self._kernel = compile_kernel(_LINEAR if bias is None else _LINEAR_BIAS, formats=formats, dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, pattern: str | None = None, sparsity: float | None = None,
                    format: Format | str | None = None) -> SparseLinear:
        """Prune ``linear``'s weight (``pattern="2:4"`` or unstructured ``sparsity=0.9``) and wrap it."""
        weight = linear.weight.detach().to(torch.float32).cpu().numpy()
        if pattern is not None:
            n, m = (int(x) for x in pattern.split(":"))
            tensor, _ = prune.n_m(weight, n, m, format=format)
        elif sparsity is not None:
            tensor, _ = prune.magnitude(weight, sparsity, format=CSR if format is None else as_format(format, 2))
        else:
            raise OperandError("give pattern='N:M' or sparsity=fraction to prune the weight")
        return cls(tensor, linear.bias)

    # -- the sparse weight as buffers --------------------------------------------------
    def _adopt(self, arrays: tuple[np.ndarray, ...]) -> None:
        """Make ``arrays`` the weight's level buffers and ``self.weight`` a validated tensor sharing their memory."""
        owned = [torch.from_numpy(np.array(a, copy=True)) for a in arrays]  # writable copies the buffers own
        for name, tensor in zip(self._format.buffer_names, owned):
            self.register_buffer(_BUFFER + name, tensor)
        self._sync_weight()

    def _sync_weight(self) -> None:
        """Rebuild ``self.weight`` over the current buffers (after ``.to()``/``.float()`` replaced them)."""
        tensors = [getattr(self, _BUFFER + name) for name in self._format.buffer_names]
        if any(t.device.type != "cpu" for t in tensors):
            self.weight = None  # forward refuses: the kernel reads host memory
            return
        self.weight = SparseTensor.from_buffers(self._format, self._shape, tuple(t.numpy() for t in tensors))

    def get_extra_state(self) -> dict[str, Any]:
        """The weight's format and shape: what its buffers mean, saved beside them."""
        return {"format": format_to_json(self._format), "shape": list(self._shape)}

    def set_extra_state(self, state: Any) -> None:
        """Refuse a checkpoint whose weight has another format or shape than this layer's kernel."""
        try:
            fmt, shape = format_from_json(state["format"]), tuple(int(n) for n in state["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"the checkpoint's SparseLinear extra state is not a format and shape: {exc!r}") \
                from None
        if fmt != self._format or shape != self._shape:
            raise FormatError(f"the checkpoint's weight is {fmt} of shape {shape}, but this SparseLinear was built "
                              f"for {self._format} of shape {self._shape} (its kernel is compiled for them)")

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Load the level buffers whole (their lengths follow the checkpoint's entries), checked before any change.

        torch would copy each buffer into the current one, which needs equal
        lengths and never checks that they form a valid tensor; a bad or
        mismatched checkpoint must raise before anything is overwritten.
        """
        if prefix + _EXTRA_STATE in state_dict:
            self.set_extra_state(state_dict[prefix + _EXTRA_STATE])
        keys = [prefix + _BUFFER + name for name in self._format.buffer_names]
        taken = {key: state_dict.pop(key) for key in keys if key in state_dict}  # torch's own copy of the dict
        arrays = self._checked_arrays(prefix, [taken[key] for key in keys]) if len(taken) == len(keys) else None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        missing_keys[:] = [key for key in missing_keys if key not in taken]
        if taken and arrays is None:
            error_msgs.append(f"{prefix}weight: the checkpoint has {sorted(taken)} but not "
                              f"{sorted(set(keys) - set(taken))}; a sparse weight needs all its level buffers")
        if arrays is not None:
            self._adopt(arrays)

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
        if tensor.dtype != self._dtype:
            raise FormatError(f"{prefix}weight: the checkpoint's values are {tensor.dtype}, this layer computes in "
                              f"{self._dtype}")
        return arrays

    def _apply(self, fn: Any, recurse: bool = True) -> SparseLinear:
        """``.to()``, ``.float()``...: torch replaces the buffers, so the weight is rebuilt over the new ones."""
        super()._apply(fn, recurse)
        self._sync_weight()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            raise OperandError("SparseLinear is inference-only: run it under torch.no_grad() or "
                               "torch.inference_mode(), on inputs that do not require grad")
        if x.device.type != "cpu" or self.weight is None:
            where = x.device if x.device.type != "cpu" else getattr(self, _BUFFER + "values").device
            raise DeviceError(f"SparseLinear runs on the CPU in this build; the input or weight is on {where}")
        if x.shape[-1] != self.in_features:
            raise OperandError(f"expected inputs with {self.in_features} features, got shape {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            raise OperandError(f"SparseLinear computes in float32, got {rows.dtype}")
        operands: dict[str, Any] = {"Xt": np.ascontiguousarray(rows.numpy().T), "W": self.weight}
        if self.bias is not None:
            operands["bias"] = self.bias.numpy()
        out_t = self._kernel(**operands)
        return torch.from_numpy(out_t.T).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        nnz = getattr(self, _BUFFER + "values").numel()
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self._format}, "
                f"nnz={nnz}, bias={self.bias is not None}")


def sparsify(model: nn.Module, *, pattern: str | None = None, sparsity: float | None = None,
             formats: Format | str | None = None, include: Any = None) -> nn.Module:
    """Replace ``nn.Linear`` layers of ``model`` in place by pruned ``SparseLinear`` layers; return the model.

    ``include(name, module)`` may select which layers are replaced (all by default).
    """
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and (include is None or include(name, child)):
            setattr(model, name, SparseLinear.from_linear(child, pattern=pattern, sparsity=sparsity, format=formats))
        else:
            sparsify(child, pattern=pattern, sparsity=sparsity, formats=formats, include=include)
    return model
