"""Writing files atomically, and finding the source checkout the package runs from.

Atomic writes: the new content goes to a fresh temporary name in the target's
own folder (``.<name>.<uuid>.tmp``, created ``O_EXCL | O_NOFOLLOW``, so it is
never an existing file or a planted symbolic link) and is moved onto the target
with ``os.replace``: a reader sees the old file or the whole new one, never a
half-written one.  On any error the temporary file is removed and the target
is left as it was.  There is no ``fsync``: this protects readers running at the
same time, not against a power cut.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["checkout_root", "open_atomically", "replace_atomically", "write_atomically"]


def _temporary_name(path: Path) -> Path:
    """A fresh name beside ``path``; the kernel cache recognizes this shape as one of its own files."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")


@contextlib.contextmanager
def replace_atomically(path: os.PathLike | str) -> Iterator[Path]:
    """A temporary path beside ``path`` for a tool that writes the file itself (a linker).

    Moved onto ``path`` when the block ends without an exception (``FileNotFoundError`` if nothing was
    written there), removed otherwise.
    """
    target = Path(path)
    tmp = _temporary_name(target)
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def open_atomically(path: os.PathLike | str, mode: int = 0o600) -> Iterator[BinaryIO]:
    """A binary file open for writing that replaces ``path`` when the block ends without an exception.

    ``mode`` is the new file's permissions, less the umask (``0o600``: nobody
    else may read it; ``0o666``: like ``open(path, "wb")``).
    """
    with replace_atomically(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            yield f


def write_atomically(path: os.PathLike | str, data: str | bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) in one step; see ``open_atomically``."""
    with open_atomically(path, mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def checkout_root() -> Path | None:
    """The source checkout this package is imported from (an editable install), or ``None`` (a wheel).

    Recognized by the project's ``pyproject.toml`` beside the package folder.
    What lives only in the checkout (``benchmarks/``) is found from here.
    """
    root = Path(__file__).resolve().parents[1]
    try:
        project = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    return root if 'name = "sparse-mlir"' in project else None
