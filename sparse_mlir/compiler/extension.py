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
    identity = (module, sys.version, sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX"),
                str(include))
    return _shared_library(source, f"the extension {module}", "ext-", identity, [f"-I{include}"],
                           {"module": module, "source": source.name})


def c_library(source: Path, name: str, libraries: tuple[str, ...] = (), version_node: str | None = None) -> Path:
    """The shared library built from the plain C file ``source`` (cached like ``python_extension``), linked with
    ``libraries``; ``version_node`` puts every exported symbol under that symbol version (a library standing in
    for another, whose versioned symbols our kernels import).  ``LoweringError`` when it cannot be built."""
    return _shared_library(source, f"the library {name}", "lib-", (name, libraries, version_node),
                           [f"-l{lib}" for lib in libraries], {"library": name, "source": source.name}, version_node)


def _shared_library(source: Path, what: str, prefix: str, identity: tuple, flags: list[str], meta: dict[str, str],
                    version_node: str | None = None) -> Path:
    """``source`` compiled and linked with ``flags`` into a shared library in the cache, keyed by the source and
    the headers beside it, ``identity``, the machine and the compiler."""
    compiler = c_compiler()
    content = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # the local headers it may include (``kmp_abi.h``)
        content.update(header.name.encode() + b"\0" + header.read_bytes())
    digest = content.hexdigest()
    key = prefix + hashlib.sha256(repr((*identity, digest, platform.machine(), compiler)).encode()).hexdigest()

    def build(path: Path) -> dict[str, str]:
        with replace_atomically(path) as tmp:
            script = tmp.with_name(tmp.name + ".map")
            extra = []
            if version_node is not None:
                script.write_text(f"{version_node} {{ global: *; }};\n")
                extra.append(f"-Wl,--version-script={script}")
            try:
                done = subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-fvisibility=hidden", "-o", str(tmp),
                                       str(source), *flags, *extra], capture_output=True, text=True, check=False)
            finally:
                script.unlink(missing_ok=True)
            if done.returncode:
                raise LoweringError(f"compiling {what} failed", stage="link", target="cpu", diagnostics=done.stderr)
        return {}

    path, _ = cache.load_or_build(key, meta, build)
    return path
