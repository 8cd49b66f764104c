"""The two CUDA toolkit files the GPU target uses when present: ``ptxas`` and ``libdevice``.

Neither is required to produce PTX.  ``libdevice`` (NVIDIA's bitcode math
library) is linked when a kernel calls ``exp``/``sqrt``/...; ``ptxas``
assembles PTX into a cubin for export and validates PTX in the tests.  Both
are looked up in ``$CUDA_HOME``/``$CUDA_PATH``, ``/usr/local/cuda`` and the
``nvidia-cuda-nvcc`` wheel.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import tempfile
from pathlib import Path

from sparse_mlir.errors import DeviceError
from sparse_mlir.knobs import knobs

__all__ = ["assemble", "libdevice", "ptxas"]


def _roots(configured: tuple[Path, ...]) -> list[Path]:
    roots = [*configured, Path("/usr/local/cuda")]
    wheel = importlib.util.find_spec("nvidia")
    for location in (wheel.submodule_search_locations or []) if wheel else []:
        roots.append(Path(location) / "cuda_nvcc")
    return roots


def ptxas() -> str | None:
    """Path of ``ptxas``, or ``None``; looked up once per ``CUDA_HOME``/``CUDA_PATH`` (read now)."""
    return _ptxas(knobs.cuda_roots())


def libdevice() -> str | None:
    """Path of ``libdevice.10.bc``, or ``None``; looked up once per ``CUDA_HOME``/``CUDA_PATH`` (read now)."""
    return _libdevice(knobs.cuda_roots())


@functools.lru_cache(maxsize=8)
def _ptxas(configured: tuple[Path, ...]) -> str | None:
    for root in _roots(configured):
        if (root / "bin" / "ptxas").is_file():
            return str(root / "bin" / "ptxas")
    return shutil.which("ptxas")


@functools.lru_cache(maxsize=8)
def _libdevice(configured: tuple[Path, ...]) -> str | None:
    for root in _roots(configured):
        found = sorted((root / "nvvm" / "libdevice").glob("libdevice*.bc"))
        if found:
            return str(found[-1])
    return None


def assemble(ptx: str, chip: str) -> bytes:
    """Assemble PTX for ``chip`` (e.g. ``sm_90``) into a cubin; ``DeviceError`` with ptxas's message if it fails."""
    tool = ptxas()
    if tool is None:
        raise DeviceError("ptxas was not found (set CUDA_HOME or install nvidia-cuda-nvcc); PTX is still usable")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        done = subprocess.run([tool, f"-arch={chip}", "-O3", str(src), "-o", str(out)], capture_output=True,
                              text=True, check=False)
        if done.returncode:
            raise DeviceError(f"ptxas rejected the PTX for {chip}: {done.stderr.strip()}")
        return out.read_bytes()
