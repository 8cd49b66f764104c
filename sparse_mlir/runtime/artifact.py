"""``load_kernel``: run an exported kernel (CPU library or GPU program) from its manifest, without MLIR installed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError, OperandError, ShapeError
from ..signature import Signature
from .library import NativeFunction
from .operands import check_extents, dense_output, prepare

__all__ = ["load_kernel", "LoadedKernel", "MANIFEST_SCHEMA"]

MANIFEST_SCHEMA = 1


class LoadedKernel:
    """An exported kernel: fixed sparse shapes, keyword operands as for ``sm.compile`` kernels."""

    def __init__(self, manifest: dict[str, Any], folder: Path):
        self.manifest = manifest
        self.signature = sig = Signature.from_json(manifest["signature"])
        self.native = NativeFunction(folder / manifest["library"], sig, threaded=bool(manifest.get("threads")))
        self._inputs = tuple((op.name, op.format, len(op.shape)) for op in sig.inputs)
        places: dict[str, list[tuple[str, int]]] = {}
        for op in sig.inputs:
            for d, idx in enumerate(op.index):
                places.setdefault(idx, []).append((op.name, d))
        self._sources = tuple((idx, tuple(p)) for idx, p in places.items())

    def __call__(self, out: np.ndarray | None = None, **operands: Any) -> Any:
        sig = self.signature
        args = prepare(sig.expression, self._inputs, operands, sig.output.dtype, "cpu")
        for op in sig.inputs:
            shape = args[op.name].shape
            if any(s is not None and s != got for s, got in zip(op.shape, shape)):
                raise ShapeError(f"{sig.name} was exported for {op.name} of shape "
                                 f"{tuple('?' if s is None else s for s in op.shape)}, got {shape}")
        extents = check_extents(self._sources, args)
        out_op = sig.output
        out_shape = tuple(extents[i] if i in extents else s for i, s in zip(out_op.index, out_op.shape))
        if out_op.sparse:
            if out is not None:
                raise OperandError(f"out= is only for dense results; {out_op.name} is sparse")
            return self.native(args, None, out_shape)
        return self.native(args, dense_output(out_op.name, out, out_shape, out_op.dtype, args), out_shape)

    def __repr__(self) -> str:
        return f"LoadedKernel({self.signature.name!r}: {self.signature.expression!r})"


def load_kernel(path: str | Path) -> Any:
    """Load an exported kernel from its manifest (``NAME.json``) or its library (``libNAME.so``).

    Every file's checksum is verified against the manifest before loading.
    A CPU manifest gives a ``LoadedKernel`` (numpy operands), a CUDA one a
    ``LoadedCudaKernel`` (CuPy operands; CuPy is needed only to run it).
    """
    path = Path(path)
    manifest_path = path if path.suffix == ".json" else path.with_name(path.name.removeprefix("lib")).with_suffix(
        ".json")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path}: no readable kernel manifest at {manifest_path} ({exc})") from exc
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("kind") not in ("cpu", "cuda"):
        raise FormatError(f"{manifest_path}: not a kernel manifest of schema {MANIFEST_SCHEMA}")
    for name, expected in manifest["sha256"].items():
        file = manifest_path.parent / name
        try:
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
        except OSError as exc:
            raise FormatError(f"{file}: listed in {manifest_path.name} but unreadable ({exc})") from exc
        if digest != expected:
            raise FormatError(f"{file}: checksum does not match its manifest (corrupted or replaced)")
    if manifest["kind"] == "cuda":
        from .cuda import LoadedCudaKernel

        return LoadedCudaKernel(manifest, manifest_path.parent)
    return LoadedKernel(manifest, manifest_path.parent)
