"""``compile()``: expression + formats + dtype + target -> ``Kernel`` (cached per process)."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from sparse_mlir.compiler.driver import TARGETS, BuildOptions
from sparse_mlir.dsl.patterns import threads_sparse_output
from sparse_mlir.dsl.plan import KernelSpec, plan
from sparse_mlir.errors import DeviceError, DSLError, DTypeError, OptionError
from sparse_mlir.formats import Format
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime.cpu import CpuKernel
from sparse_mlir.runtime.cuda import CudaKernel
from sparse_mlir.runtime.dtype_dispatch import DtypeKernel
from sparse_mlir.runtime.kernel import Kernel
from sparse_mlir.runtime.schedule import AutoKernel
from sparse_mlir.runtime.threads import kernel_runtime
from sparse_mlir.tensor.host import register_compile

__all__ = ["compile"]

_kernels: dict[tuple, Kernel] = {}
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A fork may happen while another thread holds the lock; the child starts with a free one."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def compile(expression: str, *, formats: dict[str, Format | str] | None = None, dtype: Any = None,  # noqa: A001 - as in re.compile
            target: str = "cpu", schedule: str = "default", deterministic: bool = False,
            out_dtype: Any = None) -> Kernel:
    """Compile tensor index notation to a native kernel.

    ``formats`` maps tensor names to formats (``sm.CSR`` or ``"csr"``);
    tensors without one are dense.  ``dtype=None`` (the default) takes the
    dtype from the operands at call time, one build per dtype (a
    ``DtypeKernel``): float32 operands run a float32 kernel, float64 ones a
    float64 kernel; operands that disagree raise ``DTypeError`` naming them
    (nothing is cast).  An explicit ``dtype=`` fixes it: operands of any
    other dtype are refused (``DTypeError`` naming the operand).  The
    expression is parsed and checked here either way.
    Sparse operand shapes are specialized on
    the first call with each shape; later calls reuse the compiled code.
    ``schedule="auto"`` times the variants (threads, serial, dense BLAS when
    the dense copies fit ``SPARSE_MLIR_DENSE_BUDGET``, by default a quarter of
    the available memory) on the first call with each sparse operand
    structure and keeps the fastest; the choice is in ``kernel.schedule``.
    Compiles run in a compiler process; ``SPARSE_MLIR_COMPILE_TIMEOUT``
    (seconds) stops one that runs longer (``LoweringError``).  ``target="cuda"`` returns a
    ``CudaKernel`` that runs on CuPy arrays and ``DeviceSparseTensor``s; it
    compiles to PTX without a GPU or CuPy (``CudaKernel.function``), and
    raises ``DeviceError`` only when asked to run without them.
    ``deterministic=True`` keeps results bit-identical from run to run on
    the GPU (no atomic additions); CPU kernels always are.  Results have the
    kernel's ``dtype``; ``out_dtype="float32"`` keeps a float16 kernel's
    float32 sums instead of rounding them to float16.
    """
    if dtype is None:
        return _by_operand_dtype(expression, formats, target, schedule, deterministic, out_dtype)
    if schedule not in ("default", "auto"):
        raise OptionError(f"schedule must be 'default' or 'auto', got {schedule!r}")
    if not isinstance(target, str) or target not in TARGETS:
        raise DeviceError(f"unknown target {target!r}; targets: cpu, cuda")
    if formats is not None and not isinstance(formats, dict):
        raise DSLError(f"formats must be a dict of tensor name to format, got {type(formats).__name__}")
    spec = _planned(expression, formats, dtype, out_dtype)
    if spec.dtype == np.float16 and target != "cuda":
        raise DTypeError("float16 kernels run on target='cuda' (accumulating in float32); on the CPU use float32")
    make: Callable[[], Kernel]
    if target == "cuda":
        if schedule != "default":
            raise OptionError("schedule='auto' chooses among CPU variants; target 'cuda' takes schedule='default'")
        key: tuple = (_key_of(spec), "cuda", deterministic)
        make = functools.partial(CudaKernel, spec, deterministic=deterministic)
    else:
        threaded = spec.parallelizable or threads_sparse_output(spec, spec.formats)
        options = BuildOptions(target, cpu=knobs.cpu(), openmp=kernel_runtime() if threaded else None)
        key = (_key_of(spec), options, schedule)
        make = functools.partial(AutoKernel if schedule == "auto" else CpuKernel, spec, options)
    return _cached(key, make)


def _by_operand_dtype(expression: str, formats: dict[str, Format | str] | None, target: str, schedule: str,
                      deterministic: bool, out_dtype: Any) -> Kernel:
    """The ``DtypeKernel`` of ``compile(..., dtype=None)``: its default kernel (float64, or ``out_dtype``, the one
    dtype that admits it on every target) is compiled now, which checks the expression and every option."""
    options: dict[str, Any] = {"formats": formats, "target": target, "schedule": schedule,
                               "deterministic": deterministic, "out_dtype": out_dtype}
    default = compile(expression, dtype="float64" if out_dtype is None else out_dtype, **options)

    def build(dtype: np.dtype) -> Kernel:
        return compile(expression, dtype=dtype, **options)

    return _cached(("operand dtype", default), lambda: DtypeKernel(build, default))


def _planned(expression: str, formats: dict[str, Format | str] | None, dtype: Any, out_dtype: Any) -> KernelSpec:
    """``plan(...)``, remembered per argument values: planning (parse, check, place) costs a few hundred
    microseconds, and ``compile`` is called again and again for the same kernel (``A @ x`` does on every call).
    Planning reads nothing but its arguments, so the same arguments always plan the same spec."""
    key = (expression, None if formats is None else tuple(formats.items()), dtype, out_dtype)
    try:
        hash(key)
    except TypeError:  # an unhashable argument: plan() says what is wrong with it
        return plan(expression, formats, dtype, out_dtype)
    return _plan_once(*key)


@functools.lru_cache(maxsize=1024)
def _plan_once(expression: str, formats: tuple | None, dtype: Any, out_dtype: Any) -> KernelSpec:
    return plan(expression, None if formats is None else dict(formats), dtype, out_dtype)


_spec_keys: dict[int, tuple[KernelSpec, tuple]] = {}  # id(spec) -> (spec, its key): held, so the id stays its own


def _key_of(spec: KernelSpec) -> tuple:
    """``spec.key()``, remembered per spec object (``_planned`` hands out the same one for the same arguments):
    the key costs more than the rest of a repeated ``compile`` together."""
    known = _spec_keys.get(id(spec))
    if known is None or known[0] is not spec:
        if len(_spec_keys) > 4096:
            _spec_keys.clear()
        known = _spec_keys[id(spec)] = (spec, spec.key())
    return known[1]


def _cached(key: tuple, make: Callable[[], Kernel]) -> Kernel:
    """One kernel per key in this process."""
    with _lock:
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _kernels[key] = make()
    return kernel


register_compile(compile)  # SparseTensor's ``@`` compiles through this function (the tensor layer is below it)
