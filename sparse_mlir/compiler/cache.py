"""Content-addressed kernel cache on disk, shared by processes, private to the user.

An entry is ``<dir>/<key[:2]>/<key>.so``, ``<key>.json`` (metadata with the
library's sha256) and ``<key>.ir.json`` (the IR of every stage, read lazily).  Both are written to temporary
names and moved into place with ``os.replace``; the JSON is written last, so
an entry without readable JSON, or whose library does not match its
checksum, is treated as absent and rebuilt.  A lock file per entry
(``flock``) makes concurrent processes wait for one compile instead of each
compiling.

Privacy is what makes the checksums mean anything: whoever can write into a
cache folder can plant a library and rewrite its checksum, and the next
process loads it.  So every folder the cache uses is checked each time it is
used (``_checked_root``, ``_checked_folder``): the root must be a folder owned
by this user that nobody else can write to (and no ancestor may be
world-writable without the sticky bit, which would let anyone rename it
away); the entry folders below it must be owned by this user with no access
for anyone else (they are created 0700, and tightened to 0700 if merely
readable).  A folder that fails is never used: the cache moves to a fresh
private folder for the rest of the process, with a warning.  A marker file at
the root (``MARKER``) records that the folder is a cache this library made,
and ``clear`` deletes only entries with the library's own names.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparse_mlir.errors import SparseMLIRError
from sparse_mlir.files import write_atomically
from sparse_mlir.knobs import knobs

__all__ = ["cache_dir", "entry_paths", "ir_path", "load_ir", "entry_lock", "load_entry", "store_metadata",
           "sha256_file", "write_atomically", "load_or_build", "clear", "ClearReport", "CacheError",
           "CacheWarning", "MARKER"]

MARKER = ".sparse_mlir-cache"
_MARKER_TEXT = "This folder is a sparse_mlir kernel cache; `sparse-mlir cache clear` deletes its entries.\n"
# entry folders: a key's first two characters (kernels' keys are hex; the C libraries ``compiler.extension``
# builds, the call path's module and the OpenMP pool, have keys ``ext-<hex>`` and ``lib-<hex>``)
_ENTRY_FOLDER = re.compile(r"[0-9a-f]{2}|ex|li")
# <key><suffix> (.so, .json, .ir.json, .lock, .gpu.json, .sm_90.ptx, ...) and the temporary names
# write_atomically (".<name>.<uuid>.tmp") and the linker (".<name>.<pid>.<thread>.tmp") use while writing
_ENTRY_FILE = re.compile(r"\.?(?P<key>(?:ext-|lib-)?[0-9a-f]{64})(\.[A-Za-z0-9_]+)*")

_lock = threading.Lock()
_fallback: Path | None = None
_fallback_owner = -1  # the process that made the fallback folder removes it at exit
_warned: set[str] = set()


def _reset_after_fork() -> None:
    """A child forked while another thread held ``_lock`` would wait forever on its copy: give it a new one."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


class CacheError(SparseMLIRError, OSError):
    """A cache folder that cannot be used or cleared safely (not private, not a cache, unreadable)."""


class CacheWarning(UserWarning):
    """The configured cache folder was unsafe; kernels are cached in a private temporary folder instead."""


def _problem_with_root(path: Path) -> str | None:
    """Why ``path`` (an existing cache root) is unsafe to use, or ``None``."""
    uid = os.geteuid()
    try:
        link = path.lstat()
        info = path.stat()
    except OSError as exc:
        return f"it cannot be examined ({exc})"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        return f"it is a symbolic link owned by user {link.st_uid}"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != uid:
        return f"it is owned by user {info.st_uid}, not by this user ({uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by {'others' if info.st_mode & stat.S_IWOTH else 'its group'} " \
               f"(mode {stat.S_IMODE(info.st_mode):o})"
    for parent in path.resolve().parents:
        try:
            mode = parent.stat().st_mode
        except OSError:
            continue
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            return f"its parent {parent} is writable by everyone without the sticky bit, so anyone can replace it"
    return None


def _problem_with_folder(path: Path) -> str | None:
    """Why an entry folder (below a checked root) is unsafe, or ``None``; a readable one of ours is made 0700."""
    try:
        info = path.lstat()
    except OSError as exc:
        return f"it cannot be examined ({exc})"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder" + (" (a symbolic link)" if stat.S_ISLNK(info.st_mode) else "")
    if info.st_uid != os.geteuid():
        return f"it is owned by user {info.st_uid}, not by this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    if info.st_mode & 0o077:
        try:
            path.chmod(0o700)
        except OSError as exc:
            return f"it is readable by others and cannot be made private ({exc})"
    return None


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, CacheWarning, stacklevel=4)


def _fallback_root(reason: str) -> Path:
    """A fresh private folder for this process's cache, after ``reason`` ruled the configured one out."""
    global _fallback, _fallback_owner
    with _lock:
        if _fallback is None or _fallback_owner != os.getpid() or not _fallback.is_dir():
            _fallback = Path(tempfile.mkdtemp(prefix="sparse_mlir-cache-"))  # mkdtemp makes it 0700
            _fallback_owner = os.getpid()
            _write_marker(_fallback)
            atexit.register(_remove_fallback, _fallback, _fallback_owner)
        fallback = _fallback
    _warn_once(f"sparse_mlir: not using the kernel cache folder {reason}; kernels are cached in the private "
               f"folder {fallback} for this process instead (set SPARSE_MLIR_CACHE_DIR to a folder only you "
               f"can write to)")
    return fallback


def _remove_fallback(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child, which shares the folder with its parent
        shutil.rmtree(path, ignore_errors=True)


def _write_marker(root: Path) -> None:
    marker = root / MARKER
    if marker.is_file():
        return
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(_MARKER_TEXT)


def _checked_root() -> Path:
    """The configured cache root, created 0700 if absent, checked private and marked; else the fallback."""
    root = knobs.cache_dir()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        return _fallback_root(f"{root}: it cannot be created ({exc})")
    problem = _problem_with_root(root)
    if problem is not None:
        return _fallback_root(f"{root}: {problem}")
    try:
        _write_marker(root)
    except OSError as exc:
        return _fallback_root(f"{root}: its marker file cannot be written ({exc})")
    return root


def _checked_folder(root: Path, name: str) -> Path:
    """``root/name``, created 0700 and checked private; in the fallback root when it is not."""
    folder = root / name
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        problem: str | None = f"it cannot be created ({exc})"
    else:
        problem = _problem_with_folder(folder)
    if problem is None:
        return folder
    folder = _fallback_root(f"{folder}: {problem}") / name
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def cache_dir() -> Path:
    """The cache root this process uses: the configured one if it is private, else a private fallback."""
    return _checked_root()


def entry_paths(key: str, suffix: str = ".so") -> tuple[Path, Path]:
    """The library (``suffix``: ``.gpu.json`` for a GPU program) and the metadata of an entry.

    Its IR lives beside them, see ``ir_path``.
    """
    folder = _checked_folder(cache_dir(), key[:2])
    return folder / f"{key}{suffix}", folder / f"{key}.json"


def ir_path(key: str) -> Path:
    """The IR of every stage of an entry: read only when someone asks for it."""
    return entry_paths(key)[1].with_suffix(".ir.json")


@contextlib.contextmanager
def entry_lock(key: str) -> Iterator[None]:
    """Hold an exclusive lock on one entry across processes, so a kernel is compiled once, not once each."""
    lib, _ = entry_paths(key)
    fd = os.open(lib.with_suffix(".lock"), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
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
        if not isinstance(meta, dict) or meta.get("sha256") != sha256_file(lib):
            return None
    except (OSError, ValueError, RecursionError):
        return None
    return lib, meta


def load_ir(key: str) -> dict[str, str]:
    """The IR of every stage of an entry; a damaged IR file is a ``CacheError`` that says how to recover."""
    path = ir_path(key)
    try:
        ir = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise CacheError(f"{path}: the IR of this cached kernel is unreadable ({exc}); `sparse-mlir cache clear` "
                         f"removes it and the next compile writes it again") from exc
    if not isinstance(ir, dict):
        raise CacheError(f"{path}: the IR of this cached kernel is not a JSON object; `sparse-mlir cache clear` "
                         f"removes it")
    return ir


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


@dataclass
class ClearReport:
    """What ``clear`` did: the root, how many entry files it removed, and what it left alone."""

    root: Path
    removed: int = 0
    kept: list[Path] = field(default_factory=list)
    root_removed: bool = False


def clear() -> ClearReport:
    """Delete the entries of the configured cache: only files with the library's own names, in its own folders.

    The root must carry ``MARKER`` (written when the library first used it) and
    be private; anything else in it (a file the user keeps there, a folder of
    another name) is left and listed in ``kept``.  The root itself, and its
    marker, go only when nothing else is left.  Nothing is created.
    """
    root = knobs.cache_dir()
    report = ClearReport(root)
    if not root.exists():
        return report
    problem = _problem_with_root(root)
    if problem is not None:
        raise CacheError(f"{root}: not clearing the kernel cache: {problem}")
    if not (root / MARKER).is_file():
        raise CacheError(f"{root}: not clearing: it has no {MARKER} file, so it is not a kernel cache this "
                         f"library made (nothing was deleted)")
    try:
        children = sorted(root.iterdir())
    except OSError as exc:
        raise CacheError(f"{root}: cannot list the cache ({exc})") from exc
    for child in children:
        if child.name == MARKER:
            continue
        if not _ENTRY_FOLDER.fullmatch(child.name) or _problem_with_folder(child) is not None:
            report.kept.append(child)
            continue
        for entry in sorted(child.iterdir()):
            match = _ENTRY_FILE.fullmatch(entry.name)
            if match is None or not match["key"].startswith(child.name) or entry.is_dir() and not entry.is_symlink():
                report.kept.append(entry)
                continue
            try:
                entry.unlink()
                report.removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise CacheError(f"{entry}: cannot delete this cache entry ({exc})") from exc
        with contextlib.suppress(OSError):
            child.rmdir()  # only when empty: a kept file keeps its folder
    if not report.kept:
        with contextlib.suppress(OSError):
            (root / MARKER).unlink()
            root.rmdir()
            report.root_removed = True
    return report
