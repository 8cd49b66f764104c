"""``load_kernel``: run an exported kernel (CPU library or GPU program) from its manifest, without MLIR installed.

A manifest decides which file is loaded into the caller's process and how
its memory is read, so nothing in it is trusted before it is checked
(``check_manifest``), in this order, before any code is loaded:

1. every field has its type (a malformed one is a ``FormatError``, never a
   ``KeyError`` or ``TypeError``);
2. every file it names (the library, each GPU code file, each checksummed
   file) is a plain relative name that stays inside the artifact folder
   (no absolute path, no ``..``, no symbolic link out) and is a regular file;
   the files that get loaded must be listed in ``"sha256"``;
3. every listed file matches its sha256;
4. the manifest matches its code: ``manifest_digest`` (a sha256 of the
   fields that decide how the code is called: the signature with its dtypes
   and shapes, the threading, and for a GPU program its launches, code map
   and cubin checksums) is embedded by ``export`` in the library (``DIGEST_MARK``)
   and in every PTX file (``PTX_DIGEST_PREFIX``); a manifest edited by hand,
   or paired with another export's code, is refused instead of letting a call
   read memory out of bounds.

The checks catch corruption, mix-ups and edits of the manifest alone; whoever
can rewrite every file of the folder can of course rewrite them consistently,
but cannot make ``load_kernel`` load anything from outside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any


from sparse_mlir.errors import FormatError, SparseMLIRError
from sparse_mlir.runtime.loaded import LoadedCudaKernel, LoadedKernel

__all__ = ["load_kernel", "MANIFEST_SCHEMA", "manifest_digest", "check_manifest", "DIGEST_MARK",
           "PTX_DIGEST_PREFIX", "ptx_digest_line"]

MANIFEST_SCHEMA = 1
DIGEST_MARK = b"sparse_mlir-manifest-sha256="  # followed by 64 hex digits, once in an exported library
PTX_DIGEST_PREFIX = "// sparse_mlir-manifest-sha256: "  # a line of every exported PTX file
_HEX64 = re.compile(r"[0-9a-f]{64}")


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of what decides how a manifest's code is called, for ``export`` to embed in that code.

    CPU: the signature and whether it is threaded.  GPU: the signature, the
    program (launches, grids, parameter layout), the code map and the
    checksum of every code file that cannot carry the digest itself (cubins).
    """
    if manifest["kind"] == "cpu":
        bound: dict[str, Any] = {"kind": "cpu", "signature": manifest["signature"],
                                 "threads": bool(manifest.get("threads"))}
    else:
        code = manifest["code"]
        bound = {"kind": "cuda", "signature": manifest["signature"], "program": manifest["program"], "code": code,
                 "binaries": {f: manifest["sha256"][f] for f in sorted(set(code.values())) if not f.endswith(".ptx")}}
    return hashlib.sha256(json.dumps(bound, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def ptx_digest_line(digest: str) -> str:
    """The comment line an exported PTX file carries (PTX comments are C++-style; the assembler ignores it)."""
    return f"{PTX_DIGEST_PREFIX}{digest}\n"


def _field(manifest: dict[str, Any], key: str, kind: type | tuple[type, ...], where: Path) -> Any:
    value = manifest.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        got = "missing" if key not in manifest else f"a {type(value).__name__}"
        raise FormatError(f"{where}: the manifest's {key!r} must be a {names}, it is {got}")
    return value


def _inside(folder: Path, name: Any, what: str, where: Path) -> Path:
    """``folder / name`` for a relative file name that stays in ``folder`` and is a regular file."""
    if not isinstance(name, str) or not name:
        raise FormatError(f"{where}: {what} must be a file name, got {name!r}")
    pure = PurePosixPath(name)
    if pure.is_absolute() or "\\" in name or "\0" in name or any(part == ".." for part in pure.parts):
        raise FormatError(f"{where}: {what} {name!r} is not a file of the artifact folder (an absolute path or "
                          f"'..' is refused: only files next to the manifest are loaded)")
    path = folder / pure
    base = folder.resolve()
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise FormatError(f"{where}: {what} {name!r} is missing or unreadable ({exc})") from exc
    if not real.is_relative_to(base):
        raise FormatError(f"{where}: {what} {name!r} resolves to {real}, outside the artifact folder {base}")
    if not stat.S_ISREG(os.stat(real).st_mode):
        raise FormatError(f"{where}: {what} {name!r} is not a regular file")
    return path


def check_manifest(manifest: Any, manifest_path: Path) -> dict[str, bytes]:
    """Check a parsed manifest and its files (module docstring); return the verified bytes of each listed file."""
    where = manifest_path
    if not isinstance(manifest, dict):
        raise FormatError(f"{where}: a kernel manifest is a JSON object, this one is a {type(manifest).__name__}")
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("kind") not in ("cpu", "cuda"):
        raise FormatError(f"{where}: not a kernel manifest of schema {MANIFEST_SCHEMA}")
    folder = manifest_path.parent
    sums = _field(manifest, "sha256", dict, where)
    _field(manifest, "signature", dict, where)
    if manifest["kind"] == "cpu":
        loaded = [_field(manifest, "library", str, where)]
        if manifest.get("threads") is not None:
            _field(manifest, "threads", bool, where)
    else:
        code = _field(manifest, "code", dict, where)
        _field(manifest, "program", dict, where)
        if not code:
            raise FormatError(f"{where}: the manifest's 'code' names no file")
        loaded = list(code.values())
        for chip in code:
            if not isinstance(chip, str) or not re.fullmatch(r"sm_\d+a?(\.cubin)?", chip):
                raise FormatError(f"{where}: {chip!r} in 'code' is not a chip name like 'sm_90' or 'sm_90.cubin'")
    for name in loaded:
        _inside(folder, name, "the code file", where)
        if name not in sums:
            raise FormatError(f"{where}: the code file {name!r} has no sha256 in the manifest, so it is not loaded")
    verified: dict[str, bytes] = {}
    for name, expected in sums.items():
        file = _inside(folder, name, "the checksummed file", where)
        if not isinstance(expected, str) or not _HEX64.fullmatch(expected):
            raise FormatError(f"{where}: the sha256 of {name!r} must be 64 lowercase hex digits, got {expected!r}")
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise FormatError(f"{file}: listed in {manifest_path.name} but unreadable ({exc})") from exc
        if hashlib.sha256(data).hexdigest() != expected:
            raise FormatError(f"{file}: checksum does not match its manifest (corrupted or replaced)")
        verified[name] = data
    _check_digest(manifest, {name: verified[name] for name in loaded}, where)
    return verified


def _check_digest(manifest: dict[str, Any], code: dict[str, bytes], where: Path) -> None:
    """The digest embedded in the code must be the manifest's own (``manifest_digest``)."""
    expected = manifest_digest(manifest)
    if manifest.get("manifest_sha256", expected) != expected:
        raise FormatError(f"{where}: the manifest does not match its own 'manifest_sha256' (it was edited)")
    anchors = 0
    for name, data in code.items():
        if manifest["kind"] == "cpu":
            found = [data[i + len(DIGEST_MARK):i + len(DIGEST_MARK) + 64].decode("latin-1")
                     for i in _occurrences(data, DIGEST_MARK)]
        elif name.endswith(".ptx"):
            found = [line[len(PTX_DIGEST_PREFIX):].strip()
                     for line in data.decode("utf-8", "replace").splitlines() if line.startswith(PTX_DIGEST_PREFIX)]
        else:
            continue  # a cubin: its checksum is part of the digest the PTX files carry
        anchors += 1
        if not found:
            raise FormatError(f"{where}: {name} carries no manifest digest (exported by an older sparse_mlir, or not "
                              f"by sparse_mlir): export the kernel again")
        if found != [expected]:
            raise FormatError(f"{where}: the manifest does not match {name} (its signature, dtypes, shapes or launches "
                              f"were changed, or the manifest belongs to another export): refusing to call it")
    if not anchors:
        raise FormatError(f"{where}: no code file carries the manifest digest (a GPU manifest needs its PTX files)")


def _occurrences(data: bytes, mark: bytes) -> list[int]:
    found, start = [], data.find(mark)
    while start >= 0:
        found.append(start)
        start = data.find(mark, start + 1)
    return found


def load_kernel(path: str | Path) -> Any:
    """Load an exported kernel from its manifest (``NAME.json``) or its library (``libNAME.so``).

    The manifest and every file it lists are checked first (``check_manifest``):
    only checksummed files inside its folder whose embedded digest matches the
    manifest are loaded.  A CPU manifest gives a ``LoadedKernel`` (numpy
    operands), a CUDA one a ``LoadedCudaKernel`` (CuPy operands; CuPy is needed
    only to run it).
    """
    path = Path(path)
    manifest_path = path if path.suffix == ".json" else path.with_name(path.name.removeprefix("lib")).with_suffix(
        ".json")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
        raise FormatError(f"{path}: no readable kernel manifest at {manifest_path} ({exc})") from exc
    check_manifest(manifest, manifest_path)
    try:
        if manifest["kind"] == "cuda":
            return LoadedCudaKernel(manifest, manifest_path.parent)
        return LoadedKernel(manifest, manifest_path.parent)
    except SparseMLIRError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise FormatError(f"{manifest_path}: malformed kernel manifest ({type(exc).__name__}: {exc})") from exc
