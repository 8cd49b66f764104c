"""A compiler process: MLIR runs outside the user's process.

The MLIR wheels are built with assertions, and a failed assertion in a pass
aborts the whole process.  Every compile therefore runs in one long-lived
child (``python -m sparse_mlir.worker``, started on first use, restarted
after a crash): a crash there becomes a ``LoweringError`` here, and the
user's process never loads the MLIR libraries.  Requests and replies are
pickles over the child's stdin/stdout; calls are serialized by a lock.
``SPARSE_MLIR_COMPILE_IN_PROCESS=1`` runs them in process instead
(debugging).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
from typing import Any

from .errors import LoweringError

__all__ = ["call", "shutdown"]

_lock = threading.Lock()
_child: subprocess.Popen | None = None
_logs: dict[int, Any] = {}  # the stderr file of each compiler process, by pid


def _start() -> subprocess.Popen:
    # the child imports exactly what this process imports: its sys.path, and not the current folder (-P),
    # which may hold an unrelated "sparse_mlir" folder (a build tree's output, for instance)
    path = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    # stderr goes to a file, not a pipe nobody drains while the child works
    log = tempfile.TemporaryFile()
    child = subprocess.Popen([sys.executable, "-P", "-m", "sparse_mlir.worker"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=log, env=env)
    _logs[child.pid] = log
    return child


def call(function: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``sparse_mlir.compiler.<function>(*args, **kwargs)`` in the compiler process; return its result."""
    if os.environ.get("SPARSE_MLIR_COMPILE_IN_PROCESS") == "1":
        from . import compiler

        return getattr(compiler, function)(*args, **kwargs)
    global _child
    with _lock:
        if _child is None or _child.poll() is not None:
            _child = _start()
        child = _child
        try:
            pickle.dump((function, args, kwargs), child.stdin)  # type: ignore[arg-type]
            child.stdin.flush()  # type: ignore[union-attr]
            ok, payload = pickle.load(child.stdout)  # type: ignore[arg-type]
        except (EOFError, BrokenPipeError, pickle.UnpicklingError) as exc:
            child.kill()
            child.wait()
            _child = None
            detail = _stderr_tail(child)
            raise LoweringError(f"the compiler process died (exit status {child.returncode}) running {function}",
                                stage="compile", target="cpu", diagnostics=detail) from exc
    if ok:
        return payload
    raise payload


def _stderr_tail(child: subprocess.Popen) -> str:
    log = _logs.pop(child.pid)
    log.seek(0)
    text = log.read().decode(errors="replace")[-4000:]
    log.close()
    return text


def shutdown() -> None:
    """Stop the compiler process (it also stops when this process exits)."""
    global _child
    with _lock:
        if _child is not None:
            _child.stdin.close()  # type: ignore[union-attr]
            _child.wait()
            _child = None


def _serve() -> None:
    from . import compiler

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the reply stream
    while True:
        try:
            function, args, kwargs = pickle.load(stdin)
        except EOFError:
            return
        try:
            reply = (True, getattr(compiler, function)(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - sent back and raised in the caller
            reply = (False, exc)
        try:
            data = pickle.dumps(reply)
        except Exception:  # noqa: BLE001 - e.g. the bindings' MLIRError: send its text instead
            data = pickle.dumps((False, LoweringError(str(reply[1]).splitlines()[0] if str(reply[1]) else
                                                      type(reply[1]).__name__, stage=function,
                                                      target="cuda" if "gpu" in function else "cpu",
                                                      diagnostics=str(reply[1]))))
        stdout.write(data)
        stdout.flush()


if __name__ == "__main__":
    _serve()
