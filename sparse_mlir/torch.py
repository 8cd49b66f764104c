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
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from . import prune
from .api import compile as compile_kernel
from .errors import DeviceError, OperandError
from .formats import CSR, Format, as_format
from .tensor import SparseTensor

__all__ = ["SparseLinear", "sparsify"]

# the weight on the left: the register-tiled SpMM emitter runs it, bias seeding its accumulators
_LINEAR = "Yt[o,b] = W[o,i] * Xt[i,b]"
_LINEAR_BIAS = "Yt[o,b] = W[o,i] * Xt[i,b] + bias[o]"


class SparseLinear(nn.Module):
    """A drop-in for ``nn.Linear`` whose weight is a pruned ``SparseTensor``."""

    def __init__(self, weight: SparseTensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.ndim != 2:
            raise OperandError(f"SparseLinear needs a 2-d weight, got shape {weight.shape}")
        self.weight = weight
        self.out_features, self.in_features = weight.shape
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            raise OperandError("SparseLinear is inference-only: run it under torch.no_grad() or "
                               "torch.inference_mode(), on inputs that do not require grad")
        if x.device.type != "cpu":
            raise DeviceError(f"SparseLinear runs on the CPU in this build; the input is on {x.device}")
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.weight.format}, "
                f"nnz={self.weight.nnz}, bias={self.bias is not None}")


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
