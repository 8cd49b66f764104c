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
  tiling (``_tensor_core_kernel``).

All produce a ``gpu.module`` and ``Launch`` records like the generic path, so
PTX generation, manifests, the runtime and the emulation are shared.  Each
``gpu_*`` function is one kernel family and returns ``None`` for a spec it
does not handle; ``dialects.select.CUDA_EMITTERS`` tries them in order.
Everything else is sparsified.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import numpy as np
from mlir import ir
from mlir.dialects import arith, gpu, memref, nvgpu, vector
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
from sparse_mlir.dialects.native.loops import constant_like, reduce_loop
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
    kernels = KernelModule()
    _tensor_core_kernel(kernels, outputs, inputs, batch, per_warp, fmt.pos_width, m_tiles, "f32")
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
    kernels = KernelModule()
    _tensor_core_kernel(kernels, rows, inner, cols, per_warp, fmt.pos_width, m_tiles, out)
    args = tuple(_args(spec, a, (b, (inner, cols)), (spec.output, (rows, cols))))
    grid = (math.ceil(rows / (16 * m_tiles) / (BLOCK // WARP)), cols // (8 * per_warp), 1)
    launch = Launch("spmm_2to4", grid, (BLOCK, 1, 1), args, aligned=(args[1].ref, args[2].ref),
                    fills_output=True)
    return _with_hopper(kernels.module, (launch,), HopperGemm(rows, inner, cols, True, out), args[2],
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
    kernels = KernelModule()
    _tensor_core_kernel(kernels, rows, inner, cols, per_warp, None, m_tiles, out)
    return _with_hopper(kernels.module, (launch,), HopperGemm(rows, inner, cols, False, out), *args)


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


def _tensor_core_kernel(kernels: KernelModule, rows: int, inner: int, cols: int, per_warp: int,
                        pos_width: int | None, m_tiles: int, out_elt: str) -> None:
    """Add the SpMM on Sparse Tensor Cores (``pos_width`` given, 0 meaning ``index``: 2:4 ``A``;
    ``spmm_2to4``) or the GEMM on Tensor Cores (dense ``A``; ``gemm_f16``) to ``kernels``: the same tiling.

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
    sparse = pos_width is not None
    f16, f32, out = ir.F16Type.get(), ir.F32Type.get(), float_type(out_elt)
    i8, i16 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(16)
    c_t, b_t, a_t = dense_type((rows, cols), out), dense_type((inner, cols), f16), dense_type((rows, inner), f16)
    if sparse:
        params = [dense_type((None,), ir.IntegerType.get_signless(pos_width or 64)), dense_type((None,), i8),
                  dense_type((None,), f16), b_t, c_t]
    else:
        params = [a_t, b_t, c_t]

    def build(*args: ir.Value) -> None:
        if sparse:
            _, crd, val, b, c = args
        else:
            a, b, c = args
        acc_t, frag_t = ir.VectorType.get([2, 2], f32), ir.VectorType.get([4, 2], f16)
        pair_t, b_frag_t = ir.VectorType.get([2], f16), (frag_t if sparse else ir.VectorType.get([2, 2], f16))
        tid, bid, nb = gpu.thread_id(gpu.Dimension.x), gpu.block_id(gpu.Dimension.x), gpu.block_id(gpu.Dimension.y)
        warp_in_block, lane = arith.divui(tid, const(32)), arith.remui(tid, const(32))
        warp_id = arith.addi(arith.muli(bid, const(BLOCK // WARP)), warp_in_block)
        m0 = arith.muli(warp_id, const(16 * m_tiles))
        valid = arith.cmpi(arith.CmpIPredicate.ult, m0, const(rows))
        qr = arith.divui(lane, const(4))
        qc = arith.muli(arith.remui(lane, const(4)), const(2))
        pair = arith.remui(lane, const(2))
        n_base = arith.muli(nb, const(8 * per_warp))
        pair8 = arith.muli(pair, const(8))
        shifts_t = ir.VectorType.get([8], i16)
        shifts = arith.constant(shifts_t, ir.DenseElementsAttr.get(
            np.array([1 << (2 * e) for e in range(8)], dtype=np.int16), type=shifts_t))
        zero_acc, zero_frag = constant_like(acc_t, 0), constant_like(frag_t, 0)
        zero_pair = constant_like(ir.VectorType.get([2, 2], f16), 0)
        zero_meta = constant_like(ir.VectorType.get([2], i16), 0)
        # this lane's two rows in each row tile, and where their stored values start
        tile_rows, bases = [], []
        for mi in range(m_tiles):
            r0 = arith.addi(arith.addi(m0, const(16 * mi)), qr)
            r1 = arith.addi(r0, const(8))
            tile_rows.append((r0, r1))
            bases.append((arith.muli(r0, const(inner // 2)), arith.muli(r1, const(inner // 2))))
        slots = [(mi, t) for mi in range(m_tiles) for t in range(per_warp)]
        halves = [0] if sparse else [0, 1]  # one m16n8k32 MMA, or two m16n8k16 ones, per step

        def fragment(pairs: list[ir.Value], start: ir.Value) -> ir.Value:
            for q, value in enumerate(pairs):
                start = vector.insert(value, start, [], [q])
            return start

        def step(s: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            cs, k0 = arith.muli(s, const(16)), arith.muli(s, const(32))
            k_half = [k0] if sparse else [arith.addi(k0, const(0)), arith.addi(k0, const(16))]
            a_frags = {}
            for mi in range(m_tiles):
                for h in halves:
                    ca = arith.addi(cs if sparse else k_half[h], qc)
                    cb = arith.addi(ca, const(8))
                    pairs = []
                    for row, col in ((0, ca), (1, ca), (0, cb), (1, cb)):
                        if sparse:
                            at = arith.addi(bases[mi][row], col)
                            pairs.append(vector.load(pair_t, val, [at], alignment=4))
                        else:
                            pairs.append(vector.load(pair_t, a, [tile_rows[mi][row], col], alignment=4))
                    a_frags[h, mi] = fragment(pairs, zero_frag)
            metas = {}
            for mi in range(m_tiles):  # the 8 stored offsets of this lane's half of the step, 2 bits each
                meta = zero_meta
                if sparse:
                    for r in range(2):
                        at = arith.addi(arith.addi(bases[mi][r], cs), pair8)
                        offsets = arith.extui(shifts_t, vector.load(ir.VectorType.get([8], i8), crd, [at], alignment=8))
                        bits = vector.reduction(i16, vector.CombiningKind.ADD, arith.muli(offsets, shifts))
                        meta = vector.insert(bits, meta, [], [r])
                metas[mi] = meta
            b_frags = {}
            for t in range(per_warp):  # B fragments: loaded once, used by every row tile
                n = arith.addi(arith.addi(n_base, const(8 * t)), qr)
                for h in halves:
                    pairs = []
                    for offset in ((0, 8, 16, 24) if sparse else (0, 8)):
                        k = arith.addi(arith.addi(k_half[h], qc), const(offset))
                        k1 = arith.addi(k, const(1))
                        pairs.append(vector.from_elements(pair_t, [memref.load(b, [k, n]), memref.load(b, [k1, n])]))
                    b_frags[t, h] = fragment(pairs, zero_frag if sparse else zero_pair)
            results = []
            for (mi, t), acc in zip(slots, accs):
                for h in halves:
                    if sparse:
                        acc = nvgpu.mma_sp_sync(acc_t, a_frags[h, mi], b_frags[t, h], acc, metas[mi], [16, 8, 32])
                    else:
                        acc = nvgpu.mma_sync(acc_t, a_frags[h, mi], b_frags[t, h], acc, [16, 8, 16])
                results.append(acc)
            return results

        with when(valid):
            sums = reduce_loop(const(0), const(inner // 32), [zero_acc] * len(slots), step)
            columns = [arith.addi(arith.addi(n_base, const(8 * t)), qc) for t in range(per_warp)]
            for sum_, (mi, t) in zip(sums, slots):
                for r in range(2):
                    value = as_float(vector.extract(sum_, [], [r]), ir.VectorType.get([2], out))
                    vector.store(value, c, [tile_rows[mi][r], columns[t]], alignment=2 * _BYTES[out_elt])

    kernels.kernel("spmm_2to4" if sparse else "gemm_f16", params, build)
