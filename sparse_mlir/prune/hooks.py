"""Collecting a model's calibration inputs with forward hooks, layer by layer, without holding them.

Calibrated pruners (``wanda``, ``sparsegpt``) need the inputs each Linear
layer sees on representative data.  ``collect`` hooks every selected
``torch.nn.Linear`` (and ``SparseLinear``), runs the model on the caller's
data, and folds each layer's inputs into a ``Calibration`` as they pass, so
memory stays at one Gram matrix per layer whatever the amount of data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sparse_mlir.errors import OperandError
from sparse_mlir.prune.calibrated import Calibration

__all__ = ["collect", "hook_inputs"]


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
    names = [name for name, module in model.named_modules()
             if getattr(module, "in_features", None) is not None and hasattr(module, "weight")
             and (include is None or include(name, module))]
    if not names:
        raise OperandError("the model has no Linear layers to calibrate (or include= selected none)")
    found: dict[str, Calibration] = {}
    handles = hook_inputs(model, names, lambda name, x: found.setdefault(name, Calibration(int(x.shape[-1]))).update(x))
    try:
        with torch.no_grad():
            run(model)
    finally:
        for handle in handles:
            handle.remove()
    return found


def hook_inputs(model: Any, names: Sequence[str], record: Callable[[str, Any], None]) -> list[Any]:
    """Call ``record(name, input)`` whenever one of the modules ``names`` of ``model`` runs; returns the hook
    handles (the caller removes them).  Unknown names raise ``OperandError``."""
    modules = dict(model.named_modules())
    missing = [name for name in names if name not in modules]
    if missing:
        raise OperandError(f"the model has no layers named {missing}")

    def hook_for(name: str) -> Callable[..., None]:
        def hook(_module: Any, args: tuple[Any, ...]) -> None:
            record(name, args[0])
        return hook

    return [modules[name].register_forward_pre_hook(hook_for(name)) for name in names]
