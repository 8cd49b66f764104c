"""Building a small CPython extension module of the package from its C source, once per machine, in the cache.

The runtime's C-level call path (``runtime/fast_call.c``) is plain C against
the Python C API, shipped as source so the wheel stays pure Python.  It is
compiled with the C compiler that already links every kernel, against this
interpreter's headers, into the kernel cache, where the usual cache rules
apply (a private root, entries checked by SHA-256, one build per key across
processes).  The key covers the source, the interpreter (version, ABI tag,
headers), the machine and the compiler, so an upgrade of any of them builds a
fresh module instead of loading one built against another ABI.

No MLIR here: a process that only runs cached kernels builds this too.
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

from sparse_mlir.compiler import cache
from sparse_mlir.errors import LoweringError
from sparse_mlir.files import replace_atomically
from sparse_mlir.lowering.toolchain import c_compiler

__all__ = ["c_library", "python_extension"]


def _headers() -> Path:
    """This interpreter's ``Python.h`` folder; ``LoweringError`` when the headers are not installed."""
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise LoweringError(f"no Python.h in {include}: install this Python's development headers (e.g. "
                            f"python3-dev) for the C-level call path", stage="link", target="cpu")
    return include


def python_extension(source: Path, module: str) -> Path:
    """The shared library of extension ``module`` built from ``source`` (cached); ``LoweringError`` when it
    cannot be built here (no headers, no C compiler, a compile error)."""
    include = _headers()
    compiler = c_compiler()
    text = source.read_bytes()
    identity = repr((module, hashlib.sha256(text).hexdigest(), sys.version, sys.implementation.cache_tag,
                     sysconfig.get_config_var("EXT_SUFFIX"), str(include), platform.machine(), compiler))
    key = "ext-" + hashlib.sha256(identity.encode()).hexdigest()

    def build(path: Path) -> dict[str, str]:
        with replace_atomically(path) as tmp:
            done = subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-fvisibility=hidden", f"-I{include}",
                                   "-o", str(tmp), str(source)], capture_output=True, text=True, check=False)
            if done.returncode:
                raise LoweringError(f"compiling the extension {module} failed", stage="link", target="cpu",
                                    diagnostics=done.stderr)
        return {}

    path, _ = cache.load_or_build(key, {"module": module, "source": source.name}, build)
    return path


def c_library(source: Path, name: str, libraries: tuple[str, ...] = (), version_node: str | None = None) -> Path:
    """The shared library built from the plain C file ``source`` (cached like ``python_extension``), linked with
    ``libraries``; ``version_node`` puts every exported symbol under that symbol version (a library standing in
    for another, whose versioned symbols our kernels import).  ``LoweringError`` when it cannot be built."""
    compiler = c_compiler()
    text = source.read_bytes()
    identity = repr((name, hashlib.sha256(text).hexdigest(), libraries, version_node, platform.machine(), compiler))
    key = "lib-" + hashlib.sha256(identity.encode()).hexdigest()

    def build(path: Path) -> dict[str, str]:
        with replace_atomically(path) as tmp:
            flags = []
            if version_node is not None:
                script = tmp.with_name(tmp.name + ".map")
                script.write_text(f"{version_node} {{ global: *; }};\n")
                flags.append(f"-Wl,--version-script={script}")
            try:
                done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-o", str(tmp),
                                       str(source), *flags, *(f"-l{lib}" for lib in libraries)],
                                      capture_output=True, text=True, check=False)
            finally:
                if version_node is not None:
                    script.unlink(missing_ok=True)
            if done.returncode:
                raise LoweringError(f"compiling the library {name} failed", stage="link", target="cpu",
                                    diagnostics=done.stderr)
        return {}

    path, _ = cache.load_or_build(key, {"library": name, "source": source.name}, build)
    return path
