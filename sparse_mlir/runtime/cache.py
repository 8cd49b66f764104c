"""Content-addressed kernel cache on disk, shared by processes.

An entry is ``<dir>/<key[:2]>/<key>.so``, ``<key>.json`` (metadata with the
library's sha256) and ``<key>.ir.json`` (the IR of every stage, read lazily).  Both are written to temporary
names and moved into place with ``os.replace``; the JSON is written last, so
an entry without readable JSON, or whose library does not match its
checksum, is treated as absent and rebuilt.  A lock file per entry
(``flock``) makes concurrent processes wait for one compile instead of each
compiling.  The directory is created private to the user (mode 0700).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..knobs import knobs

__all__ = ["cache_dir", "entry_paths", "ir_path", "load_ir", "entry_lock", "load_entry", "store_metadata",
           "sha256_file", "write_atomically", "load_or_build"]


def cache_dir() -> Path:
    path = knobs.cache_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def entry_paths(key: str, suffix: str = ".so") -> tuple[Path, Path]:
    """The library (``suffix``: ``.gpu.json`` for a GPU program) and the metadata of an entry.

    Its IR lives beside them, see ``ir_path``.
    """
    folder = cache_dir() / key[:2]
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{key}{suffix}", folder / f"{key}.json"


def ir_path(key: str) -> Path:
    """The IR of every stage of an entry: read only when someone asks for it."""
    return entry_paths(key)[1].with_suffix(".ir.json")


@contextlib.contextmanager
def entry_lock(key: str) -> Iterator[None]:
    """Hold an exclusive lock on one entry across processes, so a kernel is compiled once, not once each."""
    lib, _ = entry_paths(key)
    fd = os.open(lib.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_entry(key: str, suffix: str = ".so") -> tuple[Path, dict[str, Any]] | None:
    """The library path and metadata of a complete, intact entry, or ``None``."""
    lib, meta_path = entry_paths(key, suffix)
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("sha256") != sha256_file(lib):
            return None
    except (OSError, ValueError):
        return None
    return lib, meta


def load_ir(key: str) -> dict[str, str]:
    """The IR of every stage of an entry."""
    return json.loads(ir_path(key).read_text())


def write_atomically(path: Path, text: str) -> None:
    """Write to a temporary name, then move into place: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_or_build(key: str, meta: dict[str, Any], build: Callable[[Path], dict[str, str]],
                  suffix: str = ".so") -> tuple[Path, dict[str, Any]]:
    """An intact entry; when absent, ``build(artifact path)`` writes it and returns its IR, under the entry's lock.

    A process that finds the lock held waits, then finds the entry the holder built: one build per key.
    """
    entry = load_entry(key, suffix)
    if entry is None:
        with entry_lock(key):
            entry = load_entry(key, suffix)
            if entry is None:
                path, _ = entry_paths(key, suffix)
                store_metadata(key, meta, build(path), suffix)
                entry = load_entry(key, suffix)
                assert entry is not None, "cache entry vanished right after it was written"
    return entry


def store_metadata(key: str, meta: dict[str, Any], ir: dict[str, str], suffix: str = ".so") -> None:
    """Record a freshly written library (its checksum is added here) and its IR; last step of a store."""
    lib, meta_path = entry_paths(key, suffix)
    write_atomically(ir_path(key), json.dumps(ir))
    write_atomically(meta_path, json.dumps({**meta, "sha256": sha256_file(lib)}))
