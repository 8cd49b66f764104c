"""Sequential calibration: each layer is calibrated on inputs that went through the layers already pruned.

Calibrating every layer on the dense model's activations (all at once)
leaves each pruned layer blind to the error of the ones before it, and the
errors add up through the depth of the model.  SparseGPT and Wanda instead
prune in the order the model runs: a layer's calibration inputs come from the
model whose earlier layers are already pruned, so its own pruning (and
SparseGPT's weight update) makes up for theirs.

Layers that read the same input tensor in one forward pass (an attention
block's query, key and value) form one *stage*: they are calibrated and
pruned together, which is what they would see anyway.  The stages come from
the order in which the layers run on the first batch, not from their names,
so any torch model works.  Each calibration pass stops the forward pass as
soon as the stage's layers have seen their inputs (an exception raised from
the last hook), so stage ``k`` costs the depth up to it, not a whole pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sparse_mlir.errors import OperandError
from sparse_mlir.prune.calibrated import Calibration
from sparse_mlir.prune.hooks import hook_inputs

__all__ = ["stages", "prune_sequentially"]


class _StageDone(Exception):
    """Raised from a forward hook to end a forward pass whose remaining layers are not needed."""


def _run(model: Any, forward: Callable[[Any, Any], Any], batch: Any) -> None:
    import torch  # torch is optional for the package; this module is for torch models only

    with torch.no_grad():
        try:
            forward(model, batch)
        except _StageDone:
            pass


def stages(model: Any, names: Sequence[str], batch: Any,
           forward: Callable[[Any, Any], Any] = lambda model, batch: model(batch)) -> list[list[str]]:
    """``names`` grouped into stages, in the order ``forward(model, batch)`` runs them.

    A stage is a run of consecutive calls that read the very same input
    tensor.  A layer that runs twice (a shared layer) is refused: its inputs
    would change while it is being pruned.  Layers that never run are
    refused too: nothing could calibrate them.
    """
    calls: list[tuple[str, Any]] = []
    _with_hooks(model, names, lambda name, x: calls.append((name, x)), forward, batch)
    order = [name for name, _ in calls]
    if len(set(order)) != len(order):
        raise OperandError(f"layers run more than once per forward pass cannot be pruned in sequence: "
                           f"{sorted({n for n in order if order.count(n) > 1})}")
    if set(order) != set(names):
        raise OperandError(f"these layers never ran on the calibration batch: {sorted(set(names) - set(order))}")
    grouped: list[list[str]] = []
    for index, (name, x) in enumerate(calls):
        if index and x is calls[index - 1][1]:
            grouped[-1].append(name)
        else:
            grouped.append([name])
    return grouped


def prune_sequentially(model: Any, names: Sequence[str], batches: Iterable[Any],
                       prune_layer: Callable[[str, Calibration], None], *,
                       forward: Callable[[Any, Any], Any] = lambda model, batch: model(batch),
                       reference: Any = None, positions: Callable[[Any], Any] | None = None) -> list[list[str]]:
    """Calibrate and prune the layers ``names`` of ``model`` stage by stage, in the order they run.

    For each stage, ``forward(model, batch)`` runs over every batch (under
    ``torch.no_grad()``, stopped after the stage) while hooks fold the
    stage's inputs into one ``Calibration`` per layer; then
    ``prune_layer(name, calibration)`` is called for each of its layers and
    must leave the pruned layer in the model (it is what the later stages'
    inputs go through).  With ``reference`` (an unpruned copy of the model,
    same layer names), each batch also runs through it and the calibrations
    get the dense model's inputs as targets (``Calibration.update``), so
    SparseGPT and ``corrected_bias`` aim at the dense model's outputs.
    ``positions(batch)``, if given, is a boolean mask over the inputs'
    leading dimensions (``attention_mask`` for padded token batches): only
    those rows are calibration samples, so padding never enters the
    statistics and batches can be large.  Returns the stages.
    """
    batches = list(batches)
    if not batches:
        raise OperandError("sequential pruning needs at least one calibration batch")
    grouped = stages(model, names, batches[0], forward)
    for stage in grouped:
        found: dict[str, Calibration] = {}
        for batch in batches:
            targets = None if reference is None else _stage_inputs(reference, stage, batch, forward)
            keep = None if positions is None else positions(batch)

            def record(name: str, x: Any, targets: dict[str, Any] | None = targets, keep: Any = keep,
                       found: dict[str, Calibration] = found, last: str = stage[-1]) -> None:
                target = None if targets is None else targets[name]
                if keep is not None:
                    x, target = x[keep], None if target is None else target[keep]
                found.setdefault(name, Calibration(int(x.shape[-1]))).update(x, target)
                if name == last:
                    raise _StageDone

            _with_hooks(model, stage, record, forward, batch)
        for name in stage:
            prune_layer(name, found[name])
    return grouped


def _with_hooks(model: Any, names: Sequence[str], record: Callable[[str, Any], None],
                forward: Callable[[Any, Any], Any], batch: Any) -> None:
    handles = hook_inputs(model, names, record)
    try:
        _run(model, forward, batch)
    finally:
        for handle in handles:
            handle.remove()


def _stage_inputs(model: Any, stage: Sequence[str], batch: Any, forward: Callable[[Any, Any], Any]
                  ) -> dict[str, Any]:
    """The inputs of the stage's layers on ``batch`` (the forward pass stops after them)."""
    inputs: dict[str, Any] = {}

    def record(name: str, x: Any) -> None:
        inputs[name] = x
        if name == stage[-1]:
            raise _StageDone

    _with_hooks(model, stage, record, forward, batch)
    missing = [name for name in stage if name not in inputs]
    if missing:
        raise OperandError(f"the reference model did not run the layers {missing}")
    return inputs
