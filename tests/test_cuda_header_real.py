"""Generated C launchers compile against NVIDIA's real ``cuda.h``, not only the recording stand-in.

The stand-in (``tests/support/fake_cuda/cuda.h``) declares what the launchers call
the way this project believes the driver declares it; the real header (from
the ``nvidia-cuda-runtime`` wheel of the test extra) is the judge, for the
launchers and for the stand-in's own prototypes.  Without the header the
tests skip, except under CI=true while the test extra names the wheel: there
a missing header is an install that went wrong.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

import sparse_mlir as sm
from sparse_mlir.export.cuda_header import cuda_header

ROOT = Path(__file__).resolve().parents[1]
FAKE = Path(__file__).resolve().parent / "support" / "fake_cuda" / "cuda.h"
WHEEL = "nvidia-cuda-runtime"


def _include_dir() -> Path | None:
    """The directory of the real ``cuda.h``: the CUDA 13 runtime wheel, else a toolkit (CUDA_HOME, /usr/local)."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(location).glob("cu*/include"), reverse=True)
        candidates.append(Path(location) / "cuda_runtime" / "include")
    candidates += [Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda.h").is_file()), None)


def _in_test_extra() -> bool:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return any(re.match(rf"{re.escape(WHEEL)}\b(?!-)", requirement) for requirement in extra)


@pytest.fixture(scope="module")
def include() -> Path:
    found = _include_dir()
    if found is None:
        if os.environ.get("CI") == "true" and _in_test_extra():
            pytest.fail(f"{WHEEL} is in the test extra but no cuda.h was found: the test install is incomplete")
        pytest.skip("no real cuda.h (pip install nvidia-cuda-runtime)")
    return found


def _syntax_check(include: Path, tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    (tmp_path / "main.c").write_text(source)
    return subprocess.run(["cc", "-std=c99", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I", str(include),
                           "-I", str(tmp_path), str(tmp_path / "main.c")], capture_output=True, text=True)


KERNELS = {  # expression, formats, dtype, shapes (None: the shape-generic build, every size a launcher parameter)
    "spmv": ("y[i] = A[i,j]*x[j]", {"A": "csr"}, "float32", {"A": (100, 50), "x": (50,)}),
    "spmv_generic": ("y[i] = A[i,j]*x[j]", {"A": "csr"}, "float16", None),  # lanes and row splitting
    "spmm_generic": ("C[i,j] = A[i,k]*B[k,j] + b[j]", {"A": "csr"}, "float32", None),  # a variant per tiling
    "coo_spmm_generic": ("C[i,j] = A[i,k]*B[k,j]", {"A": "coo"}, "float64", None),
    # TMA tensor maps, sm_90a launches with more than 48 KiB of dynamic shared memory, N:M positions
    "spmm_2to4_f16": ("C[i,j] = A[i,k]*B[k,j]", {"A": "2:4"}, "float16", {"A": (256, 512), "B": (512, 256)}),
    "linear": ("Y[b,o] = X[b,i]*A[o,i] + b[o]", {"A": "csr"}, "float32", {"A": (40, 64), "X": (16, 64), "b": (40,)}),
    "linear_2to4_f16": ("Y[b,o] = X[b,i]*W[o,i] + bias[o]", {"W": "2:4"}, "float16",
                        {"W": (64, 128), "X": (128, 128), "bias": (64,)}),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_the_c_launcher_compiles_against_the_real_cuda_h(name, include, tmp_path):
    expr, formats, dtype, shapes = KERNELS[name]
    kernel = sm.compile(expr, formats=formats, dtype=dtype, target="cuda")
    function = kernel.specialize({}) if shapes is None else kernel.specialize(shapes, fixed=True)
    text = cuda_header(function.signature, function.program)
    if name == "spmm_2to4_f16":
        assert "cuTensorMapEncodeTiled" in text and "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES" in text
    (tmp_path / "kernel.h").write_text(text)
    done = _syntax_check(include, tmp_path, '#include "kernel.h"\nint main(void) { return 0; }\n')
    assert done.returncode == 0, done.stderr


def _fake_prototypes() -> dict[str, str]:
    """The driver functions the stand-in header defines: name -> parameter list."""
    text = FAKE.read_text()
    return dict(re.findall(r"static inline CUresult (cu\w+)\(([^)]*)\)\s*\{", text))


def test_the_stand_in_header_declares_the_driver_functions_as_the_real_one(include, tmp_path):
    """Each function of ``fake_cuda/cuda.h`` must have the real type: a pointer to it must take the real one."""
    prototypes = _fake_prototypes()
    assert {"cuLaunchKernel", "cuModuleLoad", "cuModuleGetFunction", "cuFuncSetAttribute",
            "cuTensorMapEncodeTiled", "cuMemAllocAsync", "cuMemFreeAsync", "cuMemsetD8Async"} <= prototypes.keys()
    body = "".join(f"CUresult (*check_{name})({' '.join(params.split())}) = {name};\n"
                   for name, params in prototypes.items())
    done = _syntax_check(include, tmp_path, f"#include <cuda.h>\n{body}int main(void) {{ return 0; }}\n")
    assert done.returncode == 0, done.stderr


def test_a_mismatched_prototype_is_caught(include, tmp_path):
    """The check above can fail: cuFuncSetAttribute with an int where the driver takes a CUfunction_attribute."""
    body = "CUresult (*check)(CUfunction f, CUfunction_attribute a, int v, int extra) = cuFuncSetAttribute;\n"
    done = _syntax_check(include, tmp_path, f"#include <cuda.h>\n{body}int main(void) {{ return 0; }}\n")
    assert done.returncode != 0 and "incompatible" in done.stderr
