"""Hand-scheduled CUDA kernels, emitted as ``gpu.func``s instead of sparsified.

The sparsified kernels map one row to one thread: neighbouring threads read
far-apart nonzeros (uncoalesced) and one long row stalls its warp.  These
follow the vector-CSR, merge-path and Sputnik layouts instead:

* **SpMV** ``y[i] = A[i,j] * x[j]`` (CSR): a group of lanes per row, and
  row splitting for skewed rows: ``gpu_spmv`` (its own module, shape-generic).
* **SpMM** ``C[i,j] = A[i,k] * B[k,j] (+ bias)`` (CSR): a warp per row and
  column tile, 16-byte vectors per lane (``gpu_spmm``, its own module,
  shape-generic: a kernel per tiling, picked at launch).
* **float16**: the kernels above sum in float32; a 2:4 ``A`` runs on Sparse
  Tensor Cores (``mma.sp``) and a dense one on Tensor Cores, with the same
  tiling (``_tensor_core_text``).

All produce a ``gpu.module`` and ``Launch`` records like the generic path, so
PTX generation, manifests, the runtime and the emulation are shared.  Each
``gpu_*`` function is one kernel family and returns ``None`` for a spec it
does not handle; ``dialects.select.CUDA_EMITTERS`` tries them in order.
Everything else is sparsified.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from mlir import ir
from mlir.dialects import arith, memref
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.native.gpu_build import (
    KernelModule,
    as_float,
    const,
    dense_type,
    float_type,
    global_thread,
    when,
)
from sparse_mlir.dialects.native.gpu_spmm import spmm_launches
from sparse_mlir.dialects.native.wgmma import (
    HOPPER,
    HopperGemm,
    fits_wgmma,
    metadata_words,
    wgmma_gemm,
)

from sparse_mlir.abi.gpu_program import CHIPS, GridRule, KernelArg, Launch, SizeOf
from sparse_mlir.dsl.patterns import (
    dense_matmul_operands,
    is_csr,
    linear_operands,
    spmm_operands,
)
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = [
    "BLOCK",
    "WARP",
    "NativeKernels",
    "gpu_gemm_f16",
    "gpu_linear",
    "gpu_linear_2to4",
    "gpu_spmm",
    "gpu_spmm_2to4",
]

WARP = 32
BLOCK = 128  # threads per block: four warps
_BYTES = {"f16": 2, "f32": 4, "f64": 8}
Shapes = dict[str, tuple[int | None, ...]]


class NativeKernels(NamedTuple):
    """A ``gpu.module`` of hand-scheduled kernels, their launches in order, and the scratch buffers they share."""

    module: ir.Module
    launches: tuple[Launch, ...]
    scratch: tuple[tuple[tuple[int, ...], str], ...] = ()


def _convert(name: str, value: str, source: str, target: str) -> tuple[list[str], str]:
    """Lines giving ``value`` (of type ``source``) as ``target``, and the result's name (no line if equal)."""
    if source == target:
        return [], value
    wider = _BYTES[target.split("x")[-1].rstrip(">")] > _BYTES[source.split("x")[-1].rstrip(">")]
    return [f"{name} = arith.{'extf' if wider else 'truncf'} {value} : {source} to {target}"], name


def _types(spec: KernelSpec) -> tuple[str, str] | None:
    """The data's and the result's MLIR element types; ``None`` (no hand-scheduled kernel) unless floats."""
    if spec.dtype.kind != "f":
        return None
    return TYPE_NAMES[spec.dtype.name], TYPE_NAMES[spec.output_dtype.name]


def gpu_spmm_2to4(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes) -> NativeKernels | None:
    """float16 SpMM with 2:4 ``A`` on Sparse Tensor Cores (and wgmma.sp on sm_90a), or ``None``."""
    types, spmm = _types(spec), spmm_operands(spec, formats)
    if types is None or types[0] != "f16" or spmm is None:
        return None
    return _sparse_tensor_core(spec, formats, shapes, spmm, types[1])


def gpu_gemm_f16(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes) -> NativeKernels | None:
    """float16 dense GEMM on Tensor Cores (and wgmma on sm_90a), the 2:4 kernel's reference, or ``None``."""
    types, gemm = _types(spec), dense_matmul_operands(spec, formats)
    if types is None or types[0] != "f16" or gemm is None:
        return None
    return _dense_tensor_core(spec, shapes, *gemm, types[1])


def gpu_linear(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes) -> NativeKernels | None:
    """The Linear orientation with CSR ``W``: transpose, warp-per-row SpMM, transpose; or ``None``."""
    types, roles = _types(spec), linear_operands(spec, formats)
    if types is None or roles is None or not is_csr(formats[roles["w"]]):
        return None
    return _linear(spec, shapes, formats[roles["w"]], roles, *types)


def gpu_linear_2to4(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes) -> NativeKernels | None:
    """float16 Linear orientation with 2:4 ``W`` on Sparse Tensor Cores (one wgmma.sp GEMM on sm_90a), or ``None``."""
    types, roles = _types(spec), linear_operands(spec, formats)
    if types is None or types[0] != "f16" or roles is None:
        return None
    return _linear_tensor_core(spec, shapes, formats[roles["w"]], roles, types[1])


def gpu_spmm(spec: KernelSpec, formats: dict[str, Format], shapes: Shapes) -> NativeKernels | None:
    """CSR SpMM ``C[i,j] = A[i,k] * B[k,j] (+ bias)``: a warp per row and column tile (``gpu_spmm``), or ``None``.

    Shape-generic with ``None`` sizes: one kernel per tiling, the launch that
    fits the call's sizes runs (``gpu_spmm.spmm_launches``).
    """
    types, spmm = _types(spec), spmm_operands(spec, formats)
    if types is None or spmm is None or not is_csr(formats[spmm[0]]):
        return None
    elt, out = (float_type(t) for t in types)
    a, b, bias, bias_dim = spmm
    rows, inner = shapes[a]
    cols = shapes[spec.output][1]
    if (rows is None) != (cols is None):  # the tiling needs both sizes, or neither (shape-generic)
        return None
    dense = [(b, (inner, cols))] + ([(bias, (rows,) if bias_dim == 0 else (cols,))] if bias else [])
    args = tuple(_args(spec, a, *dense, (spec.output, (rows, cols))))
    kernels = KernelModule()
    launches = spmm_launches(kernels, elt, out, formats[a], rows, inner, cols, bias_dim if bias else -1, args)
    return NativeKernels(kernels.module, launches)


def _linear(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], fmt: Format, roles: dict[str, str | None],
            elt: str, out: str) -> NativeKernels:
    """``Y[b,o] = X[b,i] * W[o,i] (+ bias)``: ``XT = X^T``, the warp-per-row SpMM ``T = W @ XT``, ``Y = T^T``.

    ``XT`` and ``T`` are scratch buffers; a bias over ``o`` (``b``) is the
    SpMM's row (column) bias.  The planner lays the kernel out the same way
    (``plan._contiguous_layouts``), but sparsified, its SpMM ran one thread
    per row over every column.
    """
    w, x, bias = roles["w"], roles["x"], roles["bias"]
    outputs, inputs = shapes[w]
    batch = shapes[x][0]
    bias_dim = -1 if bias is None else (0 if roles["bias_index"] == roles["o"] else 1)
    dense = [(x, (batch, inputs))] + ([(bias, (outputs,) if bias_dim == 0 else (batch,))] if bias else [])
    args = _args(spec, w, *dense, (spec.output, (batch, outputs)))  # W's buffers, X, [bias], Y
    xt, t = KernelArg("scratch", 0, (inputs, batch)), KernelArg("scratch", 1, (outputs, batch))
    elt_t, out_t = float_type(elt), float_type(out)
    kernels = KernelModule()
    _transpose(kernels, "transpose_in", elt_t, elt_t, (batch, inputs))
    _transpose(kernels, "transpose_out", out_t, out_t, (outputs, batch))
    # the SpMM's rows and columns are Y's columns and rows (T = Y^T): its grid and tiling are read from Y
    y = args[-1].ref
    # one launch, or (shape-generic) one per tiling variant, as the SpMM's
    products = spmm_launches(kernels, elt_t, out_t, fmt, outputs, inputs, batch, bias_dim,
                             (*args[:3], xt, *args[4:-1], t), extents=((y, 1), (y, 0)))
    launches = (_transpose_launch("transpose_in", args[3], xt, (batch, inputs), args[3]), *products,
                _transpose_launch("transpose_out", t, args[-1], (outputs, batch), args[-1]))
    if batch is None:  # X^T and T take their sizes from X and Y at the call
        sizes = ((SizeOf(args[3].ref, 1), SizeOf(args[3].ref, 0)), (SizeOf(y, 1), SizeOf(y, 0)))
    else:
        sizes = ((inputs, batch), (outputs, batch))
    scratch = ((sizes[0], spec.dtype.name), (sizes[1], spec.output_dtype.name))
    return NativeKernels(kernels.module, launches, scratch)


def _linear_tensor_core(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], fmt: Format,
                        roles: dict[str, str | None], out: str) -> NativeKernels | None:
    """float16 ``Y[b,o] = X[b,i] * W[o,i] (+ bias)`` with 2:4 ``W`` on Sparse Tensor Cores.

    Portable: ``XT = X^T``, the ``mma.sp`` SpMM ``T = W @ XT`` in float32,
    then ``Y = T^T (+ bias)`` rounded to ``Y``'s type.  sm_90a: one wgmma.sp
    GEMM reads ``X`` as it is stored (a K-major B operand), stores ``Y``
    transposed and adds the bias in its epilogue.
    """
    if not fmt.is_nm or (fmt.levels[-1].n, fmt.levels[-1].m) != (2, 4) or fmt.crd_width != 8:
        return None
    w, x, bias = roles["w"], roles["x"], roles["bias"]
    outputs, inputs = shapes[w]
    batch = shapes[x][0]
    if batch is None or outputs % 16 or inputs % 32 or batch % 8:
        return None
    bias_dim = -1 if bias is None else (0 if roles["bias_index"] == roles["o"] else 1)
    dense = [(x, (batch, inputs))] + ([(bias, (outputs,) if bias_dim == 0 else (batch,))] if bias else [])
    args = _args(spec, w, *dense, (spec.output, (batch, outputs)))  # W's buffers, X, [bias], Y
    xt, t = KernelArg("scratch", 0, (inputs, batch)), KernelArg("scratch", 1, (outputs, batch))
    per_warp, m_tiles = _tensor_core_tiles(outputs, batch)
    product = Launch("spmm_2to4", (math.ceil(outputs / (16 * m_tiles) / (BLOCK // WARP)), batch // (8 * per_warp), 1),
                     (BLOCK, 1, 1), (*args[:3], xt, t), aligned=(args[1].ref, args[2].ref), fills_output=True)
    bias_arg = (args[4],) if bias else ()
    back = Launch("transpose_out", (math.ceil(outputs * batch / BLOCK), 1, 1), (BLOCK, 1, 1),
                  (t, *bias_arg, args[-1]), fills_output=True)
    kernels = KernelModule(ir.Module.parse(_module_of(_tensor_core_text(outputs, inputs, batch, per_warp,
                                                                        _index_types(fmt)[0], m_tiles, "f32"))))
    _transpose(kernels, "transpose_in", ir.F16Type.get(), ir.F16Type.get(), (batch, inputs))
    _transpose(kernels, "transpose_out", ir.F32Type.get(), float_type(out), (outputs, batch), bias_dim)
    module = kernels.module
    scratch = (((inputs, batch), "float16"), ((outputs, batch), "float32"))
    gemm = HopperGemm(outputs, inputs, batch, True, out, b_k_major=True, c_transposed=True, bias_dim=bias_dim)
    return _with_hopper(module, (_transpose_launch("transpose_in", args[3], xt, (batch, inputs), args[3]), product,
                                 back),
                        gemm, args[2], args[3], args[-1], crd=args[1], bias=args[4] if bias else None,
                        scratch=scratch)


def _transpose(kernels: KernelModule, name: str, elt: ir.Type, out: ir.Type, shape: tuple[int | None, int | None],
               bias_dim: int = -1) -> None:
    """Add ``dst[c, r] = src[r, c] (+ bias[r] or bias[c])`` for ``src`` of ``shape``, summed and rounded to
    ``out`` (float16 ``bias`` is widened to ``elt`` first).

    A thread per element of ``dst``, consecutive threads on consecutive
    elements (coalesced stores); the sizes are read from ``src``'s
    descriptor (``None`` sizes: shape-generic).
    """
    rows, cols = shape
    params = [dense_type((rows, cols), elt)]
    if bias_dim >= 0:
        params.append(dense_type((rows if bias_dim == 0 else cols,), ir.F16Type.get()))
    params.append(dense_type((cols, rows), out))

    def build(src: ir.Value, *rest: ir.Value) -> None:
        dst = rest[-1]
        height = memref.dim(src, const(0))
        at = global_thread()
        with when(arith.cmpi(arith.CmpIPredicate.ult, at, arith.muli(height, memref.dim(src, const(1))))):
            c, r = arith.divui(at, height), arith.remui(at, height)
            value = memref.load(src, [r, c])
            if bias_dim >= 0:
                value = arith.addf(value, as_float(memref.load(rest[0], [r if bias_dim == 0 else c]), elt))
            memref.store(as_float(value, out), dst, [c, r])

    kernels.kernel(name, params, build)


def _transpose_launch(name: str, src: KernelArg, dst: KernelArg, shape: tuple[int | None, int | None],
                      entries: KernelArg) -> Launch:
    """A thread per element of ``dst``; it stores every element (a kernel's scratch, or the output).  The grid is
    constant for a static ``shape``, else (shape-generic) sized from ``entries``, a buffer of as many elements."""
    grid = (math.ceil(shape[0] * shape[1] / BLOCK), 1, 1) if None not in shape else GridRule(entries.ref, BLOCK)
    return Launch(name, grid, (BLOCK, 1, 1), (src, dst), fills_output=True)


def _sparse_tensor_core(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                        spmm: tuple[str, str, str | None, int], out: str
                        ) -> NativeKernels | None:
    """The 2:4 Sparse Tensor Core SpMM, for float16 NM(2,4) ``A`` with 8-bit offsets and whole MMA tiles."""
    a, b, bias, _ = spmm
    fmt = formats[a]
    rows, inner = shapes[a]
    cols = shapes[spec.output][1]
    if bias is not None or not fmt.is_nm or (fmt.levels[-1].n, fmt.levels[-1].m) != (2, 4) or fmt.crd_width != 8 \
            or cols is None or rows % 16 or inner % 32 or cols % 8:
        return None
    per_warp, m_tiles = _tensor_core_tiles(rows, cols)
    text = _tensor_core_text(rows, inner, cols, per_warp, _index_types(fmt)[0], m_tiles, out)
    args = tuple(_args(spec, a, (b, (inner, cols)), (spec.output, (rows, cols))))
    grid = (math.ceil(rows / (16 * m_tiles) / (BLOCK // WARP)), cols // (8 * per_warp), 1)
    launch = Launch("spmm_2to4", grid, (BLOCK, 1, 1), args, aligned=(args[1].ref, args[2].ref),
                    fills_output=True)
    return _with_hopper(ir.Module.parse(_module_of(text)), (launch,), HopperGemm(rows, inner, cols, True, out), args[2],
                        args[3], args[4], crd=args[1])


def _with_hopper(module: ir.Module, portable: tuple[Launch, ...], gemm: HopperGemm, a: KernelArg, b: KernelArg,
                 c: KernelArg, crd: KernelArg | None = None, bias: KernelArg | None = None,
                 scratch: tuple[tuple[tuple[int, ...], str], ...] = ()) -> NativeKernels:
    """``portable`` (every chip but sm_90a), plus the TMA + wgmma GEMM for sm_90a where TMA can address it.

    The Hopper GEMM's metadata words, if any, are scratch 0: the portable
    launches' own scratch buffers follow.
    """
    if not fits_wgmma(gemm.rows, gemm.inner, gemm.cols, gemm.sparse):
        return NativeKernels(module, portable, scratch)
    with ir.InsertionPoint(module.body.operations[0].regions[0].blocks[0]), ir.Location.unknown():
        hopper = wgmma_gemm(gemm, a, b, c, crd, bias)
    own = (((metadata_words(gemm.rows, gemm.inner),), "int32"),) if gemm.sparse else ()
    portable = tuple(replace(launch, chips=tuple(chip for chip in CHIPS if chip != HOPPER),
                             args=tuple(replace(arg, ref=arg.ref + len(own)) if arg.kind == "scratch" else arg
                                        for arg in launch.args)) for launch in portable)
    return NativeKernels(module, (*portable, *hopper), own + scratch)


def _tensor_core_tiles(rows: int, cols: int) -> tuple[int, int]:
    """(column tiles of 8, row tiles of 16) per warp: 4 x 4 where the shape allows, so each B fragment serves 4
    MMAs (loading B, not the MMAs, bounded both kernels at 1 x 4: 2:4 only 1.09x the dense one on an H200)."""
    return (4 if cols % 32 == 0 else 1), (4 if rows % 64 == 0 else 1)


def _dense_tensor_core(spec: KernelSpec, shapes: dict[str, tuple[int | None, ...]], a: str, b: str, out: str
                       ) -> NativeKernels | None:
    """The float16 GEMM on Tensor Cores with the 2:4 kernel's tiling (its dense reference)."""
    rows, inner = shapes[a]
    cols = shapes[b][1]
    if rows is None or inner is None or cols is None or rows % 16 or inner % 32 or cols % 8:
        return None
    per_warp, m_tiles = _tensor_core_tiles(rows, cols)
    order = [*spec.inputs, spec.output]
    args = (KernelArg("buffer", order.index(a), (rows, inner)), KernelArg("buffer", order.index(b), (inner, cols)),
            KernelArg("buffer", order.index(spec.output), (rows, cols)))
    grid = (math.ceil(rows / (16 * m_tiles) / (BLOCK // WARP)), cols // (8 * per_warp), 1)
    launch = Launch("gemm_f16", grid, (BLOCK, 1, 1), args, aligned=(args[0].ref,), fills_output=True)
    return _with_hopper(ir.Module.parse(_module_of(_tensor_core_text(rows, inner, cols, per_warp, None, m_tiles, out))),
                        (launch,), HopperGemm(rows, inner, cols, False, out), *args)


def _args(spec: KernelSpec, sparse: str, *dense: tuple[str, tuple[int, ...]]) -> list[KernelArg]:
    """Kernel arguments in the emitted ``gpu.func``'s order: A's pos, crd, values, then the dense operands."""
    order = [n for n in spec.inputs] + ([spec.output] if not spec.sparse_output else [])
    refs: dict[str, int] = {}
    position = 0
    for name in order:
        refs[name] = position
        position += 3 if name == sparse else 1
    base = refs[sparse]
    return [KernelArg("buffer", base, (None,)), KernelArg("buffer", base + 1, (None,)),
            KernelArg("buffer", base + 2, (None,))] + [KernelArg("buffer", refs[n], shape) for n, shape in dense]


def _memref(shape: tuple[int | None, ...], elt: str) -> str:
    """``memref<AxBxT>``; a ``None`` size (a shape-generic kernel's) is ``?``."""
    return f"memref<{'x'.join('?' if s is None else str(s) for s in shape)}x{elt}>"


def _index_types(fmt: Format) -> tuple[str, str]:
    return f"i{fmt.pos_width or 64}", f"i{fmt.crd_width or 64}"


_ACC = "vector<2x2xf32>"  # an m16n8 MMA's float32 accumulator fragment
_FRAG = "vector<4x2xf16>"


def _tensor_core_text(rows: int, inner: int, cols: int, per_warp: int, pos_t: str | None, m_tiles: int,
                      out_elt: str) -> str:
    """SpMM on Sparse Tensor Cores (``pos_t`` given: 2:4 ``A``) or GEMM on Tensor Cores (dense ``A``), same tiling.

    A warp owns ``m_tiles`` tiles of 16 rows and ``per_warp`` tiles of 8
    columns and walks K in steps of 32; float16 in, float32 sums,
    ``out_elt`` (float16, or float32 with ``out_dtype``) out.  Each B
    fragment is loaded once per step and used by all the warp's row tiles,
    each A fragment by all its column tiles.  Per step,
    row tile and column tile the 2:4 kernel issues one
    ``nvgpu.mma.sp.sync`` m16n8k32, the dense one two ``nvgpu.mma.sync``
    m16n8k16, so the pair isolates what sparsity gains.  Fragment layouts
    follow the PTX ISA (as upstream's ``sparse-mma-2-4-f16`` test does):
    lane ``l`` holds rows ``l/4`` and ``l/4 + 8``, columns ``2*(l%4) + {0,1}``
    and ``+8`` of A, and K pairs ``2*(l%4) + {0,1} + 8q`` of B's column
    ``l/4``.  The 2:4 metadata is built from the stored in-group offsets
    (eight 2-bit fields per 16-bit half, lanes 4i and 4i+1 supply it): no
    separate metadata array.
    """
    sparse = pos_t is not None
    stored = inner // 2
    c_t, b_t, a_t = (_memref((rows, cols), out_elt), _memref((inner, cols), "f16"), _memref((rows, inner), "f16"))
    c_pair = f"vector<2x{out_elt}>"  # two neighbouring columns of C per lane and row
    body = [*(f"%c{c} = arith.constant {c} : index" for c in (0, 1, 2, 4, 8, 16, 32)),
            f"%rows = arith.constant {rows} : index", f"%stored = arith.constant {stored} : index",
            f"%steps = arith.constant {inner // 32} : index", f"%warps = arith.constant {BLOCK // WARP} : index",
            f"%tile_cols = arith.constant {8 * per_warp} : index",
            f"%warp_rows = arith.constant {16 * m_tiles} : index",
            "%tid = gpu.thread_id x", "%bid = gpu.block_id x", "%nb = gpu.block_id y",
            "%warp_in_block = arith.divui %tid, %c32 : index", "%lane = arith.remui %tid, %c32 : index",
            "%warp = arith.muli %bid, %warps : index", "%warp_id = arith.addi %warp, %warp_in_block : index",
            "%m0 = arith.muli %warp_id, %warp_rows : index", "%valid = arith.cmpi ult, %m0, %rows : index",
            "%qr = arith.divui %lane, %c4 : index", "%q4 = arith.remui %lane, %c4 : index",
            "%qc = arith.muli %q4, %c2 : index", "%pair = arith.remui %lane, %c2 : index",
            "%n_base = arith.muli %nb, %tile_cols : index", "%pair8 = arith.muli %pair, %c8 : index",
            "%shifts = arith.constant dense<[1, 4, 16, 64, 256, 1024, 4096, 16384]> : vector<8xi16>",
            f"%zero_acc = arith.constant dense<0.0> : {_ACC}", f"%zero_frag = arith.constant dense<0.0> : {_FRAG}",
            "%zero_pair = arith.constant dense<0.0> : vector<2x2xf16>",
            "%zero_meta = arith.constant dense<0> : vector<2xi16>"]
    for mi in range(m_tiles):  # this lane's two rows in each row tile, and where their stored values start
        body += [f"%mt{mi} = arith.constant {16 * mi} : index", f"%m{mi}b = arith.addi %m0, %mt{mi} : index",
                 f"%r0_{mi} = arith.addi %m{mi}b, %qr : index", f"%r1_{mi} = arith.addi %r0_{mi}, %c8 : index",
                 f"%base0_{mi} = arith.muli %r0_{mi}, %stored : index",
                 f"%base1_{mi} = arith.muli %r1_{mi}, %stored : index"]
    body.append("scf.if %valid {")
    slots = [(mi, t) for mi in range(m_tiles) for t in range(per_warp)]
    accs = ", ".join(f"%acc{mi}_{t} = %zero_acc" for mi, t in slots)
    types = ", ".join([_ACC] * len(slots))
    loop = [f"%sums:{len(slots)} = scf.for %s = %c0 to %steps step %c1 iter_args({accs}) -> ({types}) {{",
            "%cs = arith.muli %s, %c16 : index", "%k0 = arith.muli %s, %c32 : index"]

    def fragment(name: str, pairs: list[str], shape: str, zero: str) -> list[str]:
        lines, value = [], zero
        for i, pair in enumerate(pairs):
            lines.append(f"%{name}{i} = vector.insert {pair}, {value} [{i}] : vector<2xf16> into {shape}")
            value = f"%{name}{i}"
        return lines

    def a_pairs(tag: str, mi: int, first_col: str, load: Callable[[str, str, str], list[str]]
                ) -> tuple[list[str], list[str]]:
        """A's four pairs for one MMA: rows r0/r1 of row tile ``mi`` x columns first_col + qc and + 8."""
        lines = [f"%ca{tag} = arith.addi {first_col}, %qc : index", f"%cb{tag} = arith.addi %ca{tag}, %c8 : index"]
        names = []
        for name, row, col in (("00", "0", "a"), ("10", "1", "a"), ("01", "0", "b"), ("11", "1", "b")):
            lines += load(f"%a{tag}_{name}", f"{row}_{mi}", f"%c{col}{tag}")
            names.append(f"%a{tag}_{name}")
        return lines, names

    def b_pair(tag: str, k: str, n: str) -> list[str]:
        """``%{tag}`` = (B[k, n], B[k+1, n])."""
        return [f"{tag}k1 = arith.addi {k}, %c1 : index", f"{tag}x = memref.load %b[{k}, {n}] : {b_t}",
                f"{tag}y = memref.load %b[{tag}k1, {n}] : {b_t}",
                f"{tag} = vector.from_elements {tag}x, {tag}y : vector<2xf16>"]

    halves = [""] if sparse else ["h0", "h1"]  # one m16n8k32 MMA, or two m16n8k16 ones, per step
    if not sparse:
        loop += ["%kh0 = arith.addi %k0, %c0 : index", "%kh1 = arith.addi %k0, %c16 : index"]
    a_frags: dict[tuple[str, int], str] = {}
    for mi in range(m_tiles):
        for h in halves:
            if sparse:
                def load(out: str, row: str, col: str) -> list[str]:
                    return [f"{out}_at = arith.addi %base{row}, {col} : index",
                            f"{out} = vector.load %val[{out}_at] {{alignment = 4}} : memref<?xf16>, vector<2xf16>"]

                lines, names = a_pairs(f"{h}m{mi}", mi, "%cs", load)
            else:
                def load(out: str, row: str, col: str) -> list[str]:
                    return [f"{out} = vector.load %a[%r{row}, {col}] {{alignment = 4}} : {a_t}, vector<2xf16>"]

                lines, names = a_pairs(f"{h}m{mi}", mi, f"%k{h}", load)
            loop += lines + fragment(f"fa{h}m{mi}_", names, _FRAG, "%zero_frag")
            a_frags[(h, mi)] = f"%fa{h}m{mi}_3"
    metas = {}
    for mi in range(m_tiles):  # the 8 stored offsets of this lane's half of the step, 2 bits each, rows r0, r1
        meta = "%zero_meta"
        if sparse:
            for r in range(2):
                tag = f"{r}_{mi}"
                loop += [f"%mo{tag} = arith.addi %base{tag}, %cs : index",
                         f"%mi{tag} = arith.addi %mo{tag}, %pair8 : index",
                         f"%mb{tag} = vector.load %crd[%mi{tag}] {{alignment = 8}} : memref<?xi8>, vector<8xi8>",
                         f"%mw{tag} = arith.extui %mb{tag} : vector<8xi8> to vector<8xi16>",
                         f"%ms{tag} = arith.muli %mw{tag}, %shifts : vector<8xi16>",
                         f"%mv{tag} = vector.reduction <add>, %ms{tag} : vector<8xi16> into i16",
                         f"%meta{tag} = vector.insert %mv{tag}, {meta} [{r}] : i16 into vector<2xi16>"]
                meta = f"%meta{tag}"
        metas[mi] = meta
    b_frags: dict[tuple[int, str], str] = {}
    for t in range(per_warp):  # B fragments: loaded once, used by every row tile
        loop += [f"%tn{t} = arith.constant {8 * t} : index", f"%nt{t} = arith.addi %n_base, %tn{t} : index",
                 f"%n{t} = arith.addi %nt{t}, %qr : index"]
        for h in halves:
            k_first = "%k0" if sparse else f"%k{h}"
            pairs = []
            for q, offset in enumerate((0, 8, 16, 24) if sparse else (0, 8)):
                tag = f"%b{t}{h}_{q}"
                loop += [f"{tag}o = arith.constant {offset} : index", f"{tag}a = arith.addi {k_first}, %qc : index",
                         f"{tag}k = arith.addi {tag}a, {tag}o : index", *b_pair(tag, f"{tag}k", f"%n{t}")]
                pairs.append(tag)
            loop += fragment(f"fb{t}{h}_", pairs, _FRAG if sparse else "vector<2x2xf16>",
                             "%zero_frag" if sparse else "%zero_pair")
            b_frags[(t, h)] = f"%fb{t}{h}_{len(pairs) - 1}"
    results = []
    for mi, t in slots:
        acc = f"%acc{mi}_{t}"
        for h in halves:
            out = f"%d{mi}_{t}{h}"
            if sparse:
                loop.append(f"{out} = nvgpu.mma.sp.sync({a_frags[(h, mi)]}, {b_frags[(t, h)]}, {acc}) "
                            f"metadata({metas[mi]}) {{mmaShape = [16, 8, 32]}} : ({_FRAG}, {_FRAG}, {_ACC}) -> {_ACC}")
            else:
                loop.append(f"{out} = nvgpu.mma.sync({a_frags[(h, mi)]}, {b_frags[(t, h)]}, {acc}) "
                            f"{{mmaShape = [16, 8, 16]}} : ({_FRAG}, vector<2x2xf16>, {_ACC}) -> {_ACC}")
            acc = out
        results.append(acc)
    loop += [f"scf.yield {', '.join(results)} : {types}", "}"]
    body += loop
    for t in range(per_warp):
        body += [f"%ct{t} = arith.constant {8 * t} : index", f"%cn{t} = arith.addi %n_base, %ct{t} : index",
                 f"%ccol{t} = arith.addi %cn{t}, %qc : index"]
    for slot, (mi, t) in enumerate(slots):
        for r in range(2):
            tag = f"{mi}_{t}_{r}"
            narrow, value = _convert(f"%h{tag}", f"%o{tag}", "vector<2xf32>", c_pair)
            body += [f"%o{tag} = vector.extract %sums#{slot}[{r}] : vector<2xf32> from {_ACC}", *narrow,
                     (f"vector.store {value}, %c[%r{r}_{mi}, %ccol{t}] {{alignment = {2 * _BYTES[out_elt]}}} : {c_t}, "
                      f"{c_pair}")]
    body += ["}", "gpu.return"]
    if sparse:
        return _function("spmm_2to4", f"%pos: memref<?x{pos_t}>, %crd: memref<?xi8>, %val: memref<?xf16>, "
                                      f"%b: {b_t}, %c: {c_t}", body)
    return _function("gemm_f16", f"%a: {a_t}, %b: {b_t}, %c: {c_t}", body)


def _function(name: str, params: str, body: list[str]) -> str:
    inner = "\n".join("      " + line for line in body)
    return f"    gpu.func @{name}({params}) kernel {{\n{inner}\n    }}\n"


def _module_of(*functions: str) -> str:
    return "module attributes {gpu.container_module} {\n  gpu.module @kernels {\n" + "".join(functions) + "  }\n}\n"
