"""Collecting a model's calibration inputs with forward hooks, layer by layer, without holding them.

Calibrated pruners (``wanda``, ``sparsegpt``) need the inputs each Linear
layer sees on representative data.  ``collect`` hooks every selected
``torch.nn.Linear`` (and ``SparseLinear``), runs the model on the caller's
data, and folds each layer's inputs into a ``Calibration`` as they pass, so
memory stays at one Gram matrix per layer whatever the amount of data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparse_mlir.errors import OperandError
from sparse_mlir.prune.calibrated import Calibration

__all__ = ["collect"]


def collect(model: Any, run: Callable[[Any], Any], *,
            include: Callable[[str, Any], bool] | None = None) -> dict[str, Calibration]:
    """``{layer name: Calibration}`` of every Linear layer's inputs while ``run(model)`` executes.

    ``run`` drives the model (for example ``lambda m: m.encode(sentences)``
    for a sentence-transformers model, or a loop over batches); it runs under
    ``torch.no_grad()`` and the hooks are removed afterwards, even if it
    raises.  ``include(name, module)`` selects layers (all Linear layers by default).
    """
    import torch  # torch is optional for the package; this function is for torch models only

    if not isinstance(model, torch.nn.Module):
        raise OperandError(f"collect() hooks a torch.nn.Module, got {type(model).__name__}")
    found: dict[str, Calibration] = {}
    handles = []

    def hook_for(name: str, features: int) -> Callable[..., None]:
        def record(_module: Any, args: tuple[Any, ...]) -> None:
            found.setdefault(name, Calibration(features)).update(args[0])
        return record

    for name, module in model.named_modules():
        features = getattr(module, "in_features", None)
        if features is None or not hasattr(module, "weight") or (include is not None and not include(name, module)):
            continue
        handles.append(module.register_forward_pre_hook(hook_for(name, features)))
    if not handles:
        raise OperandError("the model has no Linear layers to calibrate (or include= selected none)")
    try:
        with torch.no_grad():
            run(model)
    finally:
        for handle in handles:
            handle.remove()
    return found
