"""A compiler process: MLIR runs outside the user's process.

The MLIR wheels are built with assertions, and a failed assertion in a pass
aborts the whole process.  Every compile therefore runs in one long-lived
child (``python -m sparse_mlir.compiler``, started on first use, restarted
after a crash): a crash there becomes a ``LoweringError`` here, and the
user's process never loads the MLIR libraries.  ``SPARSE_MLIR_COMPILE_IN_PROCESS=1``
runs compiles in process instead (debugging; no timeout then).

The exchange is one request, then its reply, under a lock.  Each message is
a frame ``(id, length, pickle)``, and a reply must carry its request's id:
anything else (an exception in the caller while it waits, such as Ctrl-C or
a timeout signal, a reply out of order, a dead or stuck child) ends that
child, and the next call starts a fresh one, so the exchange can never fall
one reply behind.  ``SPARSE_MLIR_COMPILE_TIMEOUT`` (seconds) bounds the wait
for a reply.  After ``os.fork`` the child process forgets its parent's
compiler and lock (``os.register_at_fork``): a fork while another thread
compiles would otherwise inherit the lock held by a thread that does not
exist in the child.
"""

from __future__ import annotations

import atexit
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from sparse_mlir.errors import LoweringError, SparseMLIRError
from sparse_mlir.knobs import knobs

__all__ = ["JOBS", "call", "serve", "shutdown", "CompilerDied"]

# what the compiler process serves: the names of ``build.JOBS`` (a test checks the two agree)
JOBS = frozenset({"kernel_source", "build_cpu", "build_cuda"})
_FRAME = struct.Struct("<QQ")  # request id, payload length
# signals by which a compiler ends when a pass fails on its input (an assertion, a bad dereference), as opposed
# to being stopped from outside (SIGKILL from the kernel's OOM killer or a user, SIGTERM, SIGINT)
_FAULTS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})


class CompilerDied(LoweringError):
    """The compiler process ended without replying: crashed in a pass, killed from outside, or timed out.

    ``returncode`` is the child's exit status (negative: the signal that
    ended it); ``crashed`` tells a fault inside the compiler (what a pass
    does on an input it cannot handle, so recompiling differently may help)
    from a process stopped from outside or by the timeout (nothing about the
    input: recompiling differently would be wrong, see ``runtime.kernel``).
    """

    def __init__(self, message: str, *, returncode: int | None, timed_out: bool = False, stage: str = "compile",
                 target: str = "cpu", diagnostics: str = ""):
        self.returncode = returncode
        self.timed_out = timed_out
        super().__init__(message, stage=stage, target=target, diagnostics=diagnostics)

    @property
    def crashed(self) -> bool:
        return not self.timed_out and self.returncode is not None and -self.returncode in _FAULTS

    def __reduce__(self):
        return _compiler_died, (self.message, self.returncode, self.timed_out, self.stage, self.target,
                                self.diagnostics)


def _compiler_died(message: str, returncode: int | None, timed_out: bool, stage: str, target: str,
                   diagnostics: str) -> CompilerDied:
    return CompilerDied(message, returncode=returncode, timed_out=timed_out, stage=stage, target=target,
                        diagnostics=diagnostics)


@dataclass
class _Compiler:
    """One compiler child, its stderr file and the id of its next request."""

    popen: subprocess.Popen
    log: IO[bytes]
    next_id: int = field(default=1)


_lock = threading.Lock()
_compiler: _Compiler | None = None


def _start() -> _Compiler:
    # the child imports exactly what this process imports: its sys.path, and not the current folder (-P),
    # which may hold an unrelated "sparse_mlir" folder (a build tree's output, for instance)
    path = os.pathsep.join(os.path.abspath(p) if p else os.getcwd() for p in sys.path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    # stderr goes to a file, not a pipe nobody drains while the child works
    log = tempfile.TemporaryFile()
    popen = subprocess.Popen([sys.executable, "-P", "-m", "sparse_mlir.compiler"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=log, env=env, bufsize=0)
    return _Compiler(popen, log)


def call(job: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``build.JOBS[job](*args, **kwargs)`` in the compiler process; return its result.

    Raises what the compiler raised (always a ``SparseMLIRError``), or
    ``CompilerDied`` when the process ended or ran past the timeout.
    """
    if job not in JOBS:
        raise LoweringError(f"the compiler process has no job {job!r}; jobs: {', '.join(sorted(JOBS))}",
                            stage="compile", target="cpu")
    if knobs.compile_in_process():
        # imported here, not at the top: the build module loads MLIR, which a process that only runs cached
        # kernels must never do
        from sparse_mlir.compiler import build

        return build.JOBS[job](*args, **kwargs)
    global _compiler
    timeout = knobs.compile_timeout()
    target = "cuda" if job == "build_cuda" else "cpu"
    with _lock:
        if _compiler is None or _compiler.popen.poll() is not None:
            if _compiler is not None:
                _discard(_compiler)
            _compiler = _start()
        compiler = _compiler
        request_id = compiler.next_id
        compiler.next_id += 1
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            _send(compiler.popen, request_id, (job, args, kwargs))
            reply_id, reply = _receive(compiler.popen, deadline)
        except TimeoutError as exc:
            _compiler = None
            _discard(compiler)
            raise CompilerDied(f"{job} ran past SPARSE_MLIR_COMPILE_TIMEOUT={timeout:g}s; the compiler process "
                               f"was stopped (a fresh one serves the next compile)", returncode=None, timed_out=True,
                               target=target) from exc
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            _compiler = None
            detail = _discard(compiler)
            code = compiler.popen.returncode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 and \
                -code in signal.Signals._value2member_map_ else f"exit status {code}"
            raise CompilerDied(f"the compiler process died ({how}) running {job}; nothing was cached, "
                               f"a fresh process serves the next compile", returncode=code, target=target,
                               diagnostics=detail) from exc
        except BaseException:
            # interrupted mid-exchange (Ctrl-C, a timeout signal...): its reply may still come, so this
            # process can no longer tell which reply answers which request; a fresh one will
            _compiler = None
            _discard(compiler)
            raise
        if reply_id != request_id:
            _compiler = None
            _discard(compiler)
            raise LoweringError(f"the compiler process answered request {reply_id} to request {request_id}; it was "
                                f"restarted", stage="compile", target=target)
    ok, payload = reply
    if ok:
        return payload
    raise payload


def _send(popen: subprocess.Popen, request_id: int, message: Any) -> None:
    data = pickle.dumps(message)
    _write_all(popen.stdin.fileno(), _FRAME.pack(request_id, len(data)) + data)  # type: ignore[union-attr]


def _receive(popen: subprocess.Popen, deadline: float | None) -> tuple[int, Any]:
    fd = popen.stdout.fileno()  # type: ignore[union-attr]
    reply_id, length = _FRAME.unpack(_read_exact(fd, _FRAME.size, deadline))
    return reply_id, pickle.loads(_read_exact(fd, length, deadline))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    """``size`` bytes from ``fd``; ``EOFError`` if the writer is gone first, ``TimeoutError`` past ``deadline``."""
    chunks: list[bytes] = []
    poller = None
    if deadline is not None:  # poll, not select: select fails on descriptors past 1023
        poller = select.poll()
        poller.register(fd, select.POLLIN)
    while size:
        if poller is not None and deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(max(1, math.ceil(left * 1000))):
                raise TimeoutError
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _discard(compiler: _Compiler) -> str:
    """End a compiler process (killed if still running); return the tail of its stderr."""
    popen = compiler.popen
    if popen.poll() is None:
        popen.kill()
    popen.wait()
    for pipe in (popen.stdin, popen.stdout):
        if pipe is not None:
            pipe.close()
    try:
        compiler.log.seek(0)
        return compiler.log.read().decode(errors="replace")[-4000:]
    except (OSError, ValueError):
        return ""
    finally:
        compiler.log.close()


def shutdown(wait_s: float = 10.0, lock_s: float = -1) -> None:
    """Stop the compiler process: end of input, then up to ``wait_s`` seconds to return, then killed.  With
    ``lock_s`` >= 0, give up after that long if another thread's exchange holds the compiler.

    Also run at this process's exit (``atexit``): the child would see the
    end of its input anyway, but the pipes and the child's handle would be
    left to the interpreter's teardown (a ``ResourceWarning`` per pipe).
    """
    global _compiler
    if not _lock.acquire(timeout=lock_s):
        return
    try:
        compiler, _compiler = _compiler, None
        if compiler is not None:
            compiler.popen.stdin.close()  # type: ignore[union-attr]  # EOF: the child returns when idle
            try:
                compiler.popen.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
            _discard(compiler)
    finally:
        _lock.release()


def _shutdown_at_exit() -> None:
    """``shutdown`` with short waits: an idle child returns at once, and a busy one is not worth the user's
    wait at exit.  A compile still running in another (daemon) thread holds the lock: then the child is left
    to see the end of its input when this process is gone, rather than the exit waiting for that compile."""
    shutdown(wait_s=2.0, lock_s=2.0)


def _after_fork_in_child() -> None:
    """Forget the parent's compiler: a new lock (the old one may be held by a thread that is not here) and no
    handle, so the first compile starts this process's own child.

    The inherited pipe ends are pointed at /dev/null rather than closed: the
    file objects keep valid descriptors (closing them later touches nothing
    of the parent's), and the parent's compiler sees EOF on its stdin when
    the parent closes its end, not when every fork has exited too.
    """
    global _lock, _compiler
    _lock = threading.Lock()
    compiler, _compiler = _compiler, None
    if compiler is None:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for pipe in (compiler.popen.stdin, compiler.popen.stdout):
            if pipe is not None and not pipe.closed:
                os.dup2(null, pipe.fileno())
    finally:
        os.close(null)
    compiler.popen.returncode = 0  # not our child: never wait for or kill it from here
    _forgotten.append(compiler)


_forgotten: list[_Compiler] = []  # the parent's compilers, kept so their pipe objects are never finalized mid-use
os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_shutdown_at_exit)


def serve() -> None:
    """The compiler process's loop: one request, one reply, until the caller closes the pipe."""
    from sparse_mlir.compiler.build import (
        JOBS as jobs,  # only the compiler process itself loads MLIR
    )

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the reply stream
    # Ctrl-C in a terminal reaches the whole process group: the caller decides (it ends this process if the
    # exchange is broken), so a compile in progress is not cut off under a caller that catches the interrupt
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        header = stdin.read(_FRAME.size)
        if len(header) < _FRAME.size:
            return  # the caller closed the pipe
        request_id, length = _FRAME.unpack(header)
        job, args, kwargs = pickle.loads(stdin.read(length))
        data = pickle.dumps(_run(jobs, job, args, kwargs))
        stdout.write(_FRAME.pack(request_id, len(data)) + data)
        stdout.flush()


def _run(jobs: dict[str, Any], job: str, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, a picklable SparseMLIRError)``: nothing raw reaches the caller.

    An error of the MLIR bindings outside a pass pipeline (an attribute or
    type MLIR cannot build for this kernel) is MLIR refusing the kernel's
    input module: stage ``input``, like a pass failure a refusal.
    """
    target = "cuda" if job == "build_cuda" else "cpu"
    try:
        if job not in jobs:
            raise LoweringError(f"the compiler process has no job {job!r}", stage="compile", target=target)
        return True, jobs[job](*args, **kwargs)
    except SparseMLIRError as exc:
        error: Exception = exc
    except RecursionError as exc:
        error = LoweringError("the expression nests too deeply for the compiler (RecursionError)", stage=job,
                              target=target, diagnostics=str(exc))
    except Exception as exc:  # noqa: BLE001 - e.g. the bindings' MLIRError: sent back as a LoweringError
        text = str(exc)
        stage = "input" if type(exc).__module__.split(".")[0] == "mlir" else job
        error = LoweringError(f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no message'}",
                              stage=stage, target=target, diagnostics=text)
    if not _picklable(error):  # a SparseMLIRError carrying something unpicklable: send its text
        error = LoweringError(str(error).splitlines()[0] if str(error) else type(error).__name__, stage=job,
                              target=target, diagnostics=str(error))
    return False, error


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickling raises
        return False
    return True

