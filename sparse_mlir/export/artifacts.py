"""Ahead-of-time export: object file, shared library, C header and JSON manifest.

A shape-generic kernel (the hand-scheduled CPU ones and the CUDA CSR SpMV:
``compiler.driver.shape_generic``) exports without ``shapes=`` and takes every size at run time, the sparse
operands' as ``NAME_d0..`` parameters checked against their buffers and the
dense operands; given ``shapes=``, it is fixed to them like any other.  The
sparse assembler needs static sparse shapes, so a sparsifier kernel fixes
every sparse operand's shape at export (``shapes=``); its dense sizes stay
run-time arguments.
The library exports exactly ``NAME`` (and ``NAME_free`` for a sparse
output): every other symbol is local, so several kernels link into one
program.  It needs libc and libm only.  ``load_kernel`` runs it from Python
without MLIR; C and C++ include ``NAME.h``.  The library (for a GPU export,
every PTX file) also carries ``manifest_sha256``, the digest of the manifest
fields that decide how it is called, so ``load_kernel`` refuses a manifest
that does not match its code (``runtime.artifact``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from sparse_mlir._version import __version__
from sparse_mlir.abi.c_signature import Signature
from sparse_mlir.compiler import driver
from sparse_mlir.compiler.driver import BuildOptions, tool_versions
from sparse_mlir.compiler.linking import assemble_cubin, link_export_library
from sparse_mlir.dsl.patterns import threads_sparse_output
from sparse_mlir.dsl.plan import RESERVED_IN_C
from sparse_mlir.errors import DeviceError, FormatError, LoweringError, OptionError, ShapeError
from sparse_mlir.export.c_header import c_header
from sparse_mlir.export.cuda_header import cuda_header
from sparse_mlir.runtime.artifact import (
    DIGEST_MARK,
    MANIFEST_SCHEMA,
    manifest_digest,
    ptx_digest_line,
)
from sparse_mlir.runtime.kernel import Kernel, check_shapes_given
from sparse_mlir.runtime.threads import openmp_library

__all__ = ["export"]

DEFAULT_CPU = "x86-64-v2"


def export(kernel: Kernel, out_dir: str | Path, name: str,
           shapes: dict[str, tuple[int, ...]] | None = None, *, cpu: str = DEFAULT_CPU,
           threads: bool = False) -> dict[str, Path]:
    """Write ``NAME.o``, ``libNAME.so``, ``NAME.h``, ``NAME.json`` and ``NAME.mlir`` (the kernel's MLIR, for
    reading) into ``out_dir``, replacing files of those names; return their paths.

    A ``target="cuda"`` kernel writes PTX per chip (cubins too when ptxas is
    available) and a manifest of its launches instead (``_export_cuda``).

    ``shapes`` gives the shape of every sparse operand (and of any operand
    that fixes a sparse output's size); a shape-generic kernel needs none
    (``None`` or ``{}``: every size at run time), and is fixed to them if given.  ``cpu`` is the ``-mcpu`` of the
    code: portable ``x86-64-v2`` by default, ``native`` for this machine.
    ``threads`` exports an OpenMP-threaded kernel: it then needs an OpenMP
    runtime with the ``__kmpc`` ABI at link and run time (``libiomp5.so``
    from ``pip install intel-openmp``, in ``<prefix>/lib``, or LLVM's
    ``libomp.so``), found like any shared library (link with ``-liomp5``,
    ``LD_LIBRARY_PATH`` or a run path); ``OMP_NUM_THREADS`` sets the count.
    """
    _check_name(name)
    if kernel.target == "cuda":
        return _export_cuda(kernel, Path(out_dir), name, shapes or {})
    spec = kernel.spec
    if not shapes and driver.shape_generic(spec, spec.formats, BuildOptions("cpu")):
        sizes = driver.generic_shapes(spec)
    else:
        sizes = spec.specialized_shapes(_static_extents(kernel, shapes or {}))  # only static indices are looked up
    folder = _output_folder(out_dir)
    obj, lib, header, manifest = (folder / f"{name}.o", folder / f"lib{name}.so", folder / f"{name}.h",
                                  folder / f"{name}.json")
    openmp = None
    if threads and (spec.parallelizable or threads_sparse_output(spec, spec.formats)):
        openmp = openmp_library()
        if openmp is None:
            raise DeviceError("threads=True needs an OpenMP runtime: pip install intel-openmp")
    artifact = driver.build(spec, spec.formats, sizes, BuildOptions("cpu", cpu=cpu, openmp=openmp, object_file=True),
                            name)
    shutil.copyfile(artifact.path, obj)
    data = _as_json({"schema": MANIFEST_SCHEMA, "kind": "cpu", "cpu": cpu, "sparse_mlir": __version__,
                     "threads": openmp is not None, "openmp_runtime": openmp.name if openmp else None,
                     "tools": tool_versions(), "library": lib.name, "object": obj.name, "header": header.name,
                     "signature": artifact.signature.to_json()})
    digest = data["manifest_sha256"] = manifest_digest(data)
    link_export_library(obj, lib, f"{DIGEST_MARK.decode()}{digest}", openmp)
    if lib.read_bytes().count(DIGEST_MARK + digest.encode()) != 1:
        raise LoweringError("the linker dropped the manifest digest from the library", stage="link", target="cpu")
    header.write_text(c_header(artifact.signature, openmp))
    source = folder / f"{name}.mlir"
    source.write_text(artifact.ir["input"])
    data["sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (lib, obj, header)}
    manifest.write_text(json.dumps(data, indent=1))
    return {"object": obj, "library": lib, "header": header, "manifest": manifest, "source": source}


def _output_folder(out_dir: str | Path) -> Path:
    """``out_dir``, made if missing; a path that cannot be a folder (a file, or below one) is an ``OptionError``."""
    folder = Path(out_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise OptionError(f"export folder {str(out_dir)!r} cannot be made: {exc.strerror} ({exc.filename})") from None
    return folder


def _check_name(name: str) -> None:
    """A C identifier that C and C++ leave free (``NAME.h`` declares ``NAME`` and ``NAME_free``), that the
    generated code does not keep for itself (``_mlir_...``, ``__kmpc_...``, the OpenMP runtime's) and that no
    function of the C runtime has: a library exporting ``exp`` called itself where its kernel computes ``exp``
    (wrong results), and one exporting ``memset`` would take over every caller's in the program linking it.
    The kernel's own symbols (``kernel``, ``malloc``) are refused where they are known, in the lowering."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", name):
        raise FormatError(f"export name {name!r} must be a C identifier")
    if name in RESERVED_IN_C or name.startswith(("_mlir", "__", "omp_", "kmp_", "ompt_")):
        raise FormatError(f"export name {name!r} is reserved in C or C++ or by the generated code; choose "
                          f"another name")
    taken = [n for n in (name, f"{name}_free") if _c_runtime_has(n)]
    if taken:
        raise FormatError(f"export name {name!r}: {taken[0]!r} is a function of the C runtime (libc, libm), which "
                          f"the kernel or a program linking it calls; choose another name")


def _c_runtime_has(symbol: str) -> bool:
    """Whether the C math library or the C library it depends on defines ``symbol`` (``dlsym`` on libm)."""
    library = _c_runtime()
    return library is not None and hasattr(library, symbol)


@functools.cache
def _c_runtime() -> ctypes.CDLL | None:
    found = ctypes.util.find_library("m")
    try:
        return ctypes.CDLL(found) if found else ctypes.CDLL(None)
    except OSError:
        return None


def _export_cuda(kernel: Any, folder: Path, name: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Path]:
    """``NAME.json`` (signature, launches, checksums), ``NAME.<chip>.ptx``, with ptxas ``NAME.<chip>.cubin``,
    ``NAME.h``, a C launcher over the CUDA Driver API (``gpu_header``), and ``NAME.mlir``.

    A shape-generic GPU kernel (``kernel.shape_generic``: the CSR SpMV)
    exported without ``shapes`` takes every size at run time (its launcher's
    ``NAME_d{k}`` parameters); given ``shapes``, and for every other GPU
    kernel (specialized for every operand's shape), ``shapes`` must give all
    inputs (the output's follows) and fixes them.
    """
    if shapes or not kernel.shape_generic:
        kernel.specialize(shapes, fixed=True)
    else:
        kernel.specialize({})
    program, sig = kernel.program, Signature(name, kernel.signature.expression, kernel.signature.operands)
    folder = _output_folder(folder)
    code: dict[str, str] = {}
    sums: dict[str, str] = {}
    for chip, ptx in program.ptx.items():
        code[chip] = f"{name}.{chip}.ptx"
        cubin = assemble_cubin(ptx, chip)
        if cubin is not None:
            (folder / f"{name}.{chip}.cubin").write_bytes(cubin)
            code[f"{chip}.cubin"] = f"{name}.{chip}.cubin"
            sums[code[f"{chip}.cubin"]] = hashlib.sha256(cubin).hexdigest()
    header = folder / f"{name}.h"
    data = _as_json({"schema": MANIFEST_SCHEMA, "kind": "cuda", "sparse_mlir": __version__, "tools": tool_versions(),
                     "code": code, "header": header.name, "program": program.to_json(include_ptx=False),
                     "sha256": sums, "signature": sig.to_json()})
    # each PTX file carries the digest of the manifest (signature, launches, cubin checksums): load_kernel refuses
    # a manifest that does not match its code
    digest = data["manifest_sha256"] = manifest_digest(data)
    for chip, ptx in program.ptx.items():
        (folder / code[chip]).write_text(ptx + ("" if ptx.endswith("\n") else "\n") + ptx_digest_line(digest))
    source = folder / f"{name}.mlir"
    source.write_text(kernel.ir["input"])
    header.write_text(cuda_header(sig, program))
    data["sha256"] = {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in (*code.values(), header.name)}
    manifest = folder / f"{name}.json"
    manifest.write_text(json.dumps(data, indent=1))
    return {"manifest": manifest, "header": header, "source": source,
            **{f"code:{chip}": folder / f for chip, f in code.items()}}


def _as_json(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as ``json.loads`` will read it back (tuples become lists), so its digest is the one checked."""
    return json.loads(json.dumps(data))


def _static_extents(kernel: Kernel, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Sizes of the indices a sparse operand fixes, from the given shapes; errors name what is missing."""
    spec = kernel.spec
    extents: dict[str, tuple[int, str]] = {}
    for name, shape in check_shapes_given(spec, shapes, ()).items():  # integers, ranks, fitting their formats
        for idx, size in zip(spec.operand_index(name), shape):
            if idx in extents and extents[idx][0] != size:
                raise ShapeError(f"index {idx!r}: {extents[idx][1]} gives size {extents[idx][0]} but {name} "
                                 f"gives {size}")
            extents[idx] = (size, name)
    missing = sorted(spec.static_indices - extents.keys())
    if missing:
        need = sorted({n for n in (*spec.inputs, spec.output) if set(spec.operand_index(n)) & set(missing)
                       and spec.is_sparse(n)}) or missing
        raise ShapeError(f"exporting needs the shape of every sparse operand (the sparse ABI is shape-specialized):"
                         f" give shapes for {', '.join(need)}")
    return {i: extents[i][0] for i in spec.static_indices}


