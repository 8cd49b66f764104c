"""Content-addressed kernel cache on disk, shared by processes.

An entry is ``<dir>/<key[:2]>/<key>.so`` and ``<key>.json`` (metadata: the
library's sha256 and the IR of every stage).  Both are written to temporary
names and moved into place with ``os.replace``; the JSON is written last, so
an entry without readable JSON, or whose library does not match its
checksum, is treated as absent and rebuilt.  The directory is created
private to the user (mode 0700).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from ..knobs import knobs

__all__ = ["cache_dir", "entry_paths", "load_entry", "store_metadata", "sha256_file"]


def cache_dir() -> Path:
    path = knobs.cache_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def entry_paths(key: str) -> tuple[Path, Path]:
    folder = cache_dir() / key[:2]
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{key}.so", folder / f"{key}.json"


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_entry(key: str) -> tuple[Path, dict[str, Any]] | None:
    """The library path and metadata of a complete, intact entry, or ``None``."""
    lib, meta_path = entry_paths(key)
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("sha256") != sha256_file(lib):
            return None
    except (OSError, ValueError):
        return None
    return lib, meta


def store_metadata(key: str, meta: dict[str, Any]) -> None:
    """Record a freshly written library (its checksum is added here); last step of a store."""
    lib, meta_path = entry_paths(key)
    meta = {**meta, "sha256": sha256_file(lib)}
    tmp = meta_path.with_name(f".{meta_path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, meta_path)
