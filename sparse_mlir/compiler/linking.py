"""Native steps of an export that come after the build: linking the embeddable library, assembling cubins.

They live in ``compiler/`` because they drive the toolchain (``lowering.toolchain``,
``lowering.cuda_toolkit``), which nothing outside ``compiler/`` imports.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from sparse_mlir.errors import LoweringError
from sparse_mlir.lowering import cuda_toolkit
from sparse_mlir.lowering.toolchain import c_compiler, link_shared

__all__ = ["link_export_library", "assemble_cubin"]


def link_export_library(obj: Path, lib: Path, digest_text: str, openmp: Path | None) -> None:
    """Link ``obj`` into the standalone library ``lib`` with ``digest_text`` in a section of its own.

    The digest's symbol is static (the library still exports only the kernel);
    ``load_kernel`` finds it by its mark in the file's bytes before anything is loaded.
    """
    with tempfile.TemporaryDirectory(prefix="sparse_mlir_export_") as tmp:
        source, digest_obj = Path(tmp) / "manifest_digest.c", Path(tmp) / "manifest_digest.o"
        source.write_text(f'__attribute__((used, section(".sparse_mlir_manifest")))\n'
                          f'static const char sparse_mlir_manifest_digest[] = "{digest_text}";\n')
        done = subprocess.run([c_compiler(), "-c", "-fPIC", "-o", str(digest_obj), str(source)], capture_output=True,
                              text=True)
        if done.returncode:
            raise LoweringError("compiling the manifest digest failed", stage="link", target="cpu",
                                diagnostics=done.stderr)
        link_shared([obj, digest_obj], lib, standalone=True, openmp=openmp)


def assemble_cubin(ptx: str, chip: str) -> bytes | None:
    """The cubin of ``ptx`` for ``chip``, or ``None`` where ptxas is not installed (the PTX still runs)."""
    if cuda_toolkit.ptxas() is None:
        return None
    return cuda_toolkit.assemble(ptx, chip)
