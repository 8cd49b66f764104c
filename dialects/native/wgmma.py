"""Hopper (``sm_90a``) GEMM kernels: TMA loads, an mbarrier ring and ``wgmma`` on shared-memory descriptors.

``C[M,N] (+ bias) = A[M,K] @ B`` in float16 with float32 sums, ``A`` dense
or 2:4 (values ``[M, K/2]`` plus the in-group offsets), ``B`` stored
``[K,N]`` (a GEMM) or ``[N,K]`` (the Linear orientation's ``X``), ``C``
stored ``[M,N]`` or transposed (``HopperGemm``).  The layout follows the
sm_90 GEMMs (CUTLASS's warp-specialized kernels):

* a block owns a ``128 x 256`` tile of ``C`` and has three warpgroups: the
  first (the producer, 40 registers) issues one TMA load of ``A`` and four of
  ``B`` (64-column boxes, 128-byte swizzle) per ``K`` step of 64 into a ring
  of ``STAGES`` shared-memory stages; the other two (consumers, 232
  registers) each multiply 64 rows of the tile by the whole ``B`` tile with
  ``wgmma.mma_async`` m64n256 (k16 dense, k32 sparse) and keep the
  ``64 x 256`` float32 accumulator in registers (128 per thread);
* ``full[s]`` (TMA bytes arrived) and ``empty[s]`` (the eight consumer warps
  are done reading) mbarriers hand stages back and forth; a consumer keeps
  one wgmma group in flight (``wait_group 1``) and releases the stage the
  previous group read;
* ``A`` is K-major (no transpose).  A ``[K,N]`` ``B`` is MN-major
  (``tnspB``): its shared layout is four 64-column boxes of ``64 x 128 B``
  swizzled rows, so the descriptor's leading offset steps a box (8 KiB) and
  the stride offset 8 rows (1 KiB).  An ``[N,K]`` ``B`` is K-major like
  ``A``: one ``256 x 128 B`` box, K advancing within the swizzled rows;
* 2:4 ``A`` uses ``wgmma.mma_async.sp`` (no dialect has it: ``llvm.inline_asm``)
  with its metadata in the instruction's own layout, one 32-bit word per
  thread and k32 step, made from the stored offsets by a small kernel
  (``nm_metadata``) that runs before the GEMM;
* TMA zero-fills reads past the edges and the epilogue guards its stores, so
  any ``M`` and ``N`` work; TMA needs 16-byte row strides (``K % 8`` dense,
  ``K % 16`` 2:4, ``N % 8``).  The epilogue adds the bias in float32 and
  rounds to the output type (``out_dtype``).

Descriptors for TMA are made on the host (``runtime.tensor_maps``) from the
``tensormap`` kernel arguments' geometry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from mlir import ir
from mlir.dialects import arith, builtin, gpu, llvm, memref, nvgpu, nvvm, scf, vector

from sparse_mlir.abi.gpu_program import KernelArg, Launch

__all__ = ["HOPPER", "META_FILL", "TILING", "HopperGemm", "WgmmaTiling", "fits_wgmma", "metadata_words", "wgmma_gemm"]

HOPPER = "sm_90a"
WARPGROUP = 128
META_FILL = 0x44444444  # offsets (0, 1) in every group: a valid pattern for padding past the matrix


class WgmmaTiling(NamedTuple):
    block_m: int = 128  # two consumer warpgroups of 64 rows
    block_n: int = 256
    block_k: int = 64
    stages: int = 4
    producer_registers: int = 40
    consumer_registers: int = 232


TILING = WgmmaTiling()
_BOX = 64  # float16 elements in a 128-byte swizzled row


def fits_wgmma(rows: int, inner: int, cols: int, sparse: bool) -> bool:
    """Whether TMA can address the operands: 16-byte row strides and at least one whole ``K`` step."""
    return inner % (16 if sparse else 8) == 0 and cols % 8 == 0 and rows > 0 and inner >= 32


def metadata_words(rows: int, inner: int) -> int:
    """32-bit metadata words the 2:4 kernel reads: one per thread of a warpgroup, per 64-row tile and k32 step."""
    return math.ceil(rows / 64) * math.ceil(inner / TILING.block_k) * (TILING.block_k // 32) * WARPGROUP


def _c(value: int, ty: ir.Type | None = None) -> ir.Value:
    return arith.constant(ty or ir.IndexType.get(), value)


def _shared() -> ir.Attribute:
    return ir.Attribute.parse("#gpu.address_space<workgroup>")


def _tensor_map_type(box: tuple[int, int], swizzle: str) -> ir.Type:
    """``box`` is (rows, elements per row) of one TMA load."""
    return ir.Type.parse(f"!nvgpu.tensormap.descriptor<tensor = memref<{box[0]}x{box[1]}xf16, 3>, "
                         f"swizzle = {swizzle}, l2promo = l2promo_128b, oob = zero, interleave = none>")


def _descriptor(address: ir.Value, leading: int, stride: int, swizzle_mode: int) -> ir.Value:
    """A wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format") for ``address`` (i64)."""
    i64 = ir.IntegerType.get_signless(64)
    low = arith.shrui(arith.andi(address, _c(0x3FFFF, i64)), _c(4, i64))
    fixed = ((leading >> 4) << 16) | ((stride >> 4) << 32) | (swizzle_mode << 62)
    return arith.ori(low, _c(fixed - (1 << 64) if fixed >= 1 << 63 else fixed, i64))


def _accumulator_type() -> ir.Type:
    return llvm.StructType.get_literal([ir.F32Type.get()] * (TILING.block_n // 2))


def _sparse_mma(acc: ir.Value, desc_a: ir.Value, desc_b: ir.Value, meta: ir.Value, b_k_major: bool) -> ir.Value:
    """``wgmma.mma_async.sp`` m64n256k32 f32 += f16 * f16, metadata selector 0; B transposed unless K-major."""
    n = TILING.block_n // 2
    registers = ", ".join(f"${i}" for i in range(n))
    text = ("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            f"wgmma.mma_async.sp.sync.aligned.m64n{TILING.block_n}k32.f32.f16.f16 "
            f"{{{registers}}}, ${2 * n}, ${2 * n + 1}, ${2 * n + 2}, 0, p, 1, 1, 0, {0 if b_k_major else 1};\n}}\n")
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["l", "l", "r"])
    values = [llvm.extractvalue(ir.F32Type.get(), acc, [i]) for i in range(n)]
    return llvm.inline_asm(_accumulator_type(), [*values, desc_a, desc_b, meta], text, constraints,
                           has_side_effects=True)


def _dense_mma(acc: ir.Value, desc_a: ir.Value, desc_b: ir.Value, b_k_major: bool) -> ir.Value:
    """``wgmma.mma_async`` m64n256k16 f32 += f16 * f16, A K-major, B MN-major (``row``) or K-major (``col``)."""
    return nvvm.WgmmaMmaAsyncOp(
        _accumulator_type(), acc, desc_a, desc_b,
        ir.Attribute.parse(f"#nvvm.shape<m = 64, n = {TILING.block_n}, k = 16>"),
        ir.Attribute.parse("#nvvm.wgmma_type<f16>"), ir.Attribute.parse("#nvvm.wgmma_type<f16>"),
        ir.Attribute.parse("#nvvm.wgmma_type<f32>"), ir.Attribute.parse("#nvvm.wgmma_scale_out<one>"),
        ir.Attribute.parse("#nvvm.wgmma_scale_in<one>"), ir.Attribute.parse("#nvvm.wgmma_scale_in<one>"),
        ir.Attribute.parse("#nvvm.mma_layout<row>"),
        ir.Attribute.parse(f"#nvvm.mma_layout<{'col' if b_k_major else 'row'}>")).result


@dataclass(frozen=True)
class HopperGemm:
    """One GEMM's geometry: ``C[M,N] (+ bias) = A[M,K] @ B``, with ``B`` given as ``[K,N]`` or ``[N,K]``.

    ``b_k_major``: ``B`` is stored ``[N,K]`` (the Linear orientation's ``X``,
    read without a transpose); ``c_transposed``: ``C`` is stored ``[N,M]``
    (the Linear orientation's ``Y``); ``bias_dim`` 0 adds ``bias[m]``, 1 adds
    ``bias[n]``, -1 none.
    """

    rows: int
    inner: int
    cols: int
    sparse: bool
    out_elt: str = "f16"
    b_k_major: bool = False
    c_transposed: bool = False
    bias_dim: int = -1

    @property
    def stages(self) -> int:
        return TILING.stages + (1 if self.sparse else 0)  # a 2:4 stage is 40 KiB, a dense one 48: 5 or 4 fit

    @property
    def a_row_bytes(self) -> int:  # bytes of one A row in a stage: the stored half of K for 2:4
        return TILING.block_k if self.sparse else 2 * TILING.block_k

    @property
    def stage_a(self) -> int:
        return TILING.block_m * self.a_row_bytes

    @property
    def stage(self) -> int:
        return self.stage_a + TILING.block_k * TILING.block_n * 2

    @property
    def shared_bytes(self) -> int:
        return self.stages * self.stage + 1024  # + alignment slack for the 1024-byte swizzle atoms

    @property
    def steps(self) -> int:
        return math.ceil(self.inner / TILING.block_k)

    @property
    def a_box(self) -> tuple[int, int]:
        return TILING.block_m, self.a_row_bytes // 2

    @property
    def b_box(self) -> tuple[int, int]:
        """One TMA load of B: K-major, the whole 256 x 64 tile; otherwise 64 rows of K x 64 columns."""
        return (TILING.block_n, TILING.block_k) if self.b_k_major else (TILING.block_k, _BOX)


def wgmma_gemm(gemm: HopperGemm, a: KernelArg, b: KernelArg, c: KernelArg, crd: KernelArg | None = None,
               bias: KernelArg | None = None) -> tuple[Launch, ...]:
    """Add the Hopper GEMM (and for 2:4 the metadata kernel) to the ``gpu.module`` at the insertion point.

    ``a`` is A's matrix (2:4: its values, ``crd`` its offsets), ``b``, ``c``
    and ``bias`` the other buffers; a 2:4 GEMM also takes scratch 0 (the
    metadata words).  Returns the launches, in order.
    """
    t = TILING
    g = gemm
    a_stored = g.inner // 2 if g.sparse else g.inner
    tma_a = KernelArg("tensormap", a.ref, (a_stored, g.rows, g.a_box[1], g.a_box[0], g.a_row_bytes, 2))
    b_dims = (g.inner, g.cols) if g.b_k_major else (g.cols, g.inner)
    tma_b = KernelArg("tensormap", b.ref, (*b_dims, g.b_box[1], g.b_box[0], 128, 2))
    i32 = ir.IntegerType.get_signless(32)
    out_type = ir.F16Type.get() if g.out_elt == "f16" else ir.F32Type.get()
    c_type = ir.MemRefType.get([g.cols, g.rows] if g.c_transposed else [g.rows, g.cols], out_type)
    meta_words = metadata_words(g.rows, g.inner)
    # TMA descriptors arrive as plain pointers (a gpu.func signature keeps no nvgpu type through the NVVM
    # conversion) and are viewed as the descriptor types inside
    pointer = llvm.PointerType.get()
    inputs = [pointer, pointer, c_type]
    if bias is not None:
        inputs.append(ir.MemRefType.get([g.rows if g.bias_dim == 0 else g.cols], ir.F16Type.get()))
    if g.sparse:
        inputs.append(ir.MemRefType.get([meta_words], i32))
    name = f"{'gemm_2to4' if g.sparse else 'gemm_f16'}_sm90{'_linear' if g.b_k_major else ''}"
    func = gpu.GPUFuncOp(ir.TypeAttr.get(ir.FunctionType.get(inputs, [])), sym_name=name, kernel=True)
    func.attributes["nvvm.maxntid"] = ir.Attribute.parse(f"array<i32: {3 * WARPGROUP}, 1, 1>")
    func.attributes["nvvm.minctasm"] = ir.Attribute.parse("1 : i32")
    block = func.body.blocks.append(*inputs)
    with ir.InsertionPoint(block):
        desc_a, desc_b = (builtin.unrealized_conversion_cast([kind], [value]) for kind, value in
                          ((_tensor_map_type(g.a_box, "swizzle_64b" if g.sparse else "swizzle_128b"),
                            block.arguments[0]),
                           (_tensor_map_type(g.b_box, "swizzle_128b"), block.arguments[1])))
        rest = list(block.arguments[3:])
        bias_value = rest.pop(0) if bias is not None else None
        meta = rest.pop(0) if g.sparse else None
        _gemm_body(g, desc_a, desc_b, block.arguments[2], bias_value, meta)
        gpu.ReturnOp([])
    grid = (math.ceil(g.rows / t.block_m), math.ceil(g.cols / t.block_n), 1)
    launches = []
    scratch_args: tuple[KernelArg, ...] = ()
    if g.sparse:
        assert crd is not None, "a 2:4 GEMM reads its offsets"
        meta_arg = KernelArg("scratch", 0, (meta_words,))
        scratch_args = (meta_arg,)
        _metadata_kernel(g.rows, g.inner)
        launches.append(Launch("nm_metadata", (math.ceil(meta_words / WARPGROUP), 1, 1), (WARPGROUP, 1, 1),
                               (crd, meta_arg), fills_output=True, chips=(HOPPER,), derives=True))
    bias_args = (bias,) if bias is not None else ()
    launches.append(Launch(name, grid, (3 * WARPGROUP, 1, 1), (tma_a, tma_b, c, *bias_args, *scratch_args),
                           shared_bytes=g.shared_bytes, fills_output=True, chips=(HOPPER,)))
    return tuple(launches)


def _gemm_body(g: HopperGemm, desc_a: ir.Value, desc_b: ir.Value, c_out: ir.Value, bias: ir.Value | None,
               meta: ir.Value | None) -> None:
    t = TILING
    i1, i64 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(64)
    index = ir.IndexType.get()
    shared = _shared()
    smem = gpu.dynamic_shared_memory(ir.MemRefType.get([ir.ShapedType.get_dynamic_size()],
                                                       ir.IntegerType.get_signless(8), memory_space=shared))
    base = arith.index_cast(i64, memref.extract_aligned_pointer_as_index(smem))
    aligned = arith.andi(arith.addi(base, _c(1023, i64)), _c(-1024, i64))
    pad = arith.index_cast(index, arith.subi(aligned, base))
    tid = gpu.thread_id(gpu.Dimension.x)
    warpgroup = arith.divui(tid, _c(WARPGROUP))
    thread = arith.remui(tid, _c(WARPGROUP))
    m0 = arith.muli(gpu.block_id(gpu.Dimension.x), _c(t.block_m))
    n0 = arith.muli(gpu.block_id(gpu.Dimension.y), _c(t.block_n))
    barriers = ir.Type.parse(f"!nvgpu.mbarrier.group<memorySpace = {shared}, num_barriers = {g.stages}>")
    full, empty = nvgpu.mbarrier_create(barriers), nvgpu.mbarrier_create(barriers)
    first = arith.cmpi(arith.CmpIPredicate.eq, tid, _c(0))
    for s in range(g.stages):
        nvgpu.mbarrier_init(full, _c(1), _c(s), predicate=first)
        nvgpu.mbarrier_init(empty, _c(8), _c(s), predicate=first)  # the eight consumer warps
    nvgpu.tma_prefetch_descriptor(desc_a, predicate=first)
    nvgpu.tma_prefetch_descriptor(desc_b, predicate=first)
    gpu.barrier()
    ticks = _c(10_000_000)

    def view(offset: ir.Value, shape: tuple[int, int]) -> ir.Value:
        return memref.view(ir.MemRefType.get(list(shape), ir.F16Type.get(), memory_space=shared), smem,
                           arith.addi(pad, offset), [])

    producer = arith.cmpi(arith.CmpIPredicate.eq, warpgroup, _c(0))
    branch = scf.IfOp(producer, has_else=True)
    with ir.InsertionPoint(branch.then_block):
        nvvm.setmaxregister(t.producer_registers, nvvm.SetMaxRegisterAction.decrease)
        loop = scf.ForOp(_c(0), _c(g.steps), _c(1))
        with ir.InsertionPoint(loop.body):
            k = loop.induction_variable
            s = arith.remui(k, _c(g.stages))
            phase = arith.index_cast(i1, arith.remui(arith.divui(k, _c(g.stages)), _c(2)))
            nvgpu.MBarrierTryWaitParityOp(empty, arith.xori(phase, _c(1, i1)), ticks, s)
            nvgpu.mbarrier_arrive_expect_tx(full, _c(g.stage), s, predicate=first)
            at = arith.muli(s, _c(g.stage))
            nvgpu.TmaAsyncLoadOp(view(at, g.a_box), full, desc_a,
                                 [arith.muli(k, _c(g.a_box[1])), m0], s, predicate=first)
            k_first = arith.muli(k, _c(t.block_k))
            b_at = arith.addi(at, _c(g.stage_a))
            if g.b_k_major:  # one box: 256 rows of N, 64 of K each
                nvgpu.TmaAsyncLoadOp(view(b_at, g.b_box), full, desc_b, [k_first, n0], s, predicate=first)
            else:  # four boxes of 64 columns, each 64 rows of K
                for box in range(t.block_n // _BOX):
                    nvgpu.TmaAsyncLoadOp(view(arith.addi(b_at, _c(box * t.block_k * _BOX * 2)), g.b_box), full,
                                         desc_b, [arith.addi(n0, _c(box * _BOX)), k_first], s, predicate=first)
            scf.YieldOp([])
        scf.YieldOp([])
    with ir.InsertionPoint(branch.else_block):
        nvvm.setmaxregister(t.consumer_registers, nvvm.SetMaxRegisterAction.increase)
        acc = _consumer(g, full, empty, aligned, meta, warpgroup, thread, m0, ticks)
        _epilogue(g, acc, c_out, bias, arith.subi(warpgroup, _c(1)), thread, m0, n0)
        scf.YieldOp([])


def _consumer(g: HopperGemm, full: ir.Value, empty: ir.Value, aligned: ir.Value, meta: ir.Value | None,
              warpgroup: ir.Value, thread: ir.Value, m0: ir.Value, ticks: ir.Value) -> ir.Value:
    """The MMA loop of one consumer warpgroup over its 64 rows; returns the accumulator."""
    t = TILING
    i1, i64 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(64)
    half = arith.subi(warpgroup, _c(1))  # which 64 rows of the tile
    lane = arith.remui(thread, _c(32))
    warp_leader = arith.cmpi(arith.CmpIPredicate.eq, lane, _c(0))
    a_half = arith.index_cast(i64, arith.muli(half, _c(64 * g.a_row_bytes)))
    k_per_mma = 32 if g.sparse else 16
    mmas = t.block_k // k_per_mma
    a_stride = 512 if g.sparse else 1024  # 8 rows of the swizzle atom
    a_mode = 2 if g.sparse else 1  # 64B / 128B swizzle
    if g.b_k_major:  # 256 rows of 128 swizzled bytes: like A, K advances within the row
        b_step, b_leading, b_stride = k_per_mma * 2, 16, 1024
    else:  # four 64-column boxes (8 KiB apart) of K rows of 128 bytes: K advances by rows
        b_step, b_leading, b_stride = k_per_mma * 128, t.block_k * 128, 1024
    meta_base = None
    if g.sparse:  # words of this thread: [(row tile), (k32 step), thread]
        row_tile = arith.addi(arith.divui(m0, _c(64)), half)
        meta_base = arith.addi(arith.muli(row_tile, _c(g.steps * mmas * WARPGROUP)), thread)
    zero = llvm.mlir_zero(_accumulator_type())
    loop = scf.ForOp(_c(0), _c(g.steps), _c(1), [zero])
    with ir.InsertionPoint(loop.body):
        k = loop.induction_variable
        acc = loop.inner_iter_args[0]
        s = arith.remui(k, _c(g.stages))
        phase = arith.index_cast(i1, arith.remui(arith.divui(k, _c(g.stages)), _c(2)))
        words = []
        if g.sparse:
            for j in range(mmas):
                at = arith.addi(meta_base, arith.muli(arith.addi(arith.muli(k, _c(mmas)), _c(j)), _c(WARPGROUP)))
                words.append(memref.load(meta, [at]))
        nvgpu.MBarrierTryWaitParityOp(full, phase, ticks, s)
        stage_at = arith.addi(aligned, arith.index_cast(i64, arith.muli(s, _c(g.stage))))
        a_at = arith.addi(stage_at, a_half)
        b_at = arith.addi(stage_at, _c(g.stage_a, i64))
        nvvm.WgmmaFenceAlignedOp()
        for j in range(mmas):
            da = _descriptor(arith.addi(a_at, _c(j * 32, i64)), 16, a_stride, a_mode)
            db = _descriptor(arith.addi(b_at, _c(j * b_step, i64)), b_leading, b_stride, 1)
            acc = _sparse_mma(acc, da, db, words[j], g.b_k_major) if g.sparse else \
                _dense_mma(acc, da, db, g.b_k_major)
        nvvm.WgmmaGroupSyncAlignedOp()
        nvvm.WgmmaWaitGroupSyncOp(1)
        # the group of step k-1 is done: its stage may be refilled
        release = arith.andi(warp_leader, arith.cmpi(arith.CmpIPredicate.ugt, k, _c(0)))
        with ir.InsertionPoint(scf.IfOp(release).then_block):
            previous = arith.remui(arith.addi(k, _c(g.stages - 1)), _c(g.stages))
            nvgpu.mbarrier_arrive(empty, previous)
            scf.YieldOp([])
        scf.YieldOp([acc])
    nvvm.WgmmaWaitGroupSyncOp(0)
    return loop.results[0]


def _epilogue(g: HopperGemm, acc: ir.Value, c_out: ir.Value, bias: ir.Value | None, half: ir.Value,
              thread: ir.Value, m0: ir.Value, n0: ir.Value) -> None:
    """Registers to ``C``: register ``4j + 2h + e`` holds row ``l/4 + 8h`` and column ``8j + 2(l%4) + e`` of the
    warp's 16 rows (the wgmma accumulator layout).  The bias is added in float32, then the sums are rounded
    to ``C``'s type; rows and columns past the edges are not stored.  Pairs of columns are stored together,
    or, into a transposed ``C``, one element at a time."""
    f32 = ir.F32Type.get()
    out_type = ir.F16Type.get() if g.out_elt == "f16" else f32
    warp = arith.divui(thread, _c(32))
    lane = arith.remui(thread, _c(32))
    row_base = arith.addi(arith.addi(m0, arith.muli(half, _c(64))),
                          arith.addi(arith.muli(warp, _c(16)), arith.divui(lane, _c(4))))
    col_base = arith.addi(n0, arith.muli(arith.remui(lane, _c(4)), _c(2)))
    pair = ir.VectorType.get([2], out_type)

    def bias_at(at: ir.Value) -> ir.Value:
        safe = arith.minui(at, _c((g.rows if g.bias_dim == 0 else g.cols) - 1))
        return arith.extf(f32, memref.load(bias, [safe]))

    for h in range(2):
        row = arith.addi(row_base, _c(8 * h))
        row_ok = arith.cmpi(arith.CmpIPredicate.ult, row, _c(g.rows))
        row_bias = bias_at(row) if g.bias_dim == 0 else None
        for j in range(TILING.block_n // 8):
            col = arith.addi(col_base, _c(8 * j))
            values = [llvm.extractvalue(f32, acc, [4 * j + 2 * h + e]) for e in range(2)]
            if row_bias is not None:
                values = [arith.addf(v, row_bias) for v in values]
            elif g.bias_dim == 1:
                values = [arith.addf(v, bias_at(arith.addi(col, _c(e)))) for e, v in enumerate(values)]
            if out_type != f32:
                values = [arith.truncf(out_type, v) for v in values]
            ok = arith.andi(row_ok, arith.cmpi(arith.CmpIPredicate.ult, col, _c(g.cols)))
            with ir.InsertionPoint(scf.IfOp(ok).then_block):
                if g.c_transposed:  # C[n, m]; cols is a multiple of 8, so col + 1 is inside too
                    memref.store(values[0], c_out, [col, row])
                    memref.store(values[1], c_out, [arith.addi(col, _c(1)), row])
                else:
                    vector.store(vector.from_elements(pair, values), c_out, [row, col])
                scf.YieldOp([])


def _metadata_kernel(rows: int, inner: int) -> None:
    """``nm_metadata(crd, meta)``: the 2:4 offsets as ``wgmma.sp`` metadata, one 32-bit word per thread.

    Word ``(tile, step, t)`` is read by thread ``t`` of the warpgroup that
    multiplies rows ``64 tile ...`` at k32 step ``step``: warp ``t/32`` owns
    16 of those rows and lanes ``4g`` and ``4g+1`` supply rows ``g`` (low
    half) and ``g + 8`` (high half), columns 0-15 and 16-31 of the step
    (sparsity selector 0; lanes ``4g+2``/``4g+3`` repeat them).  Each half is
    eight 2-bit offsets, the stored values' order.  Words past the matrix
    hold ``META_FILL``.
    """
    i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
    stored = inner // 2
    words = metadata_words(rows, inner)
    steps = math.ceil(inner / TILING.block_k) * (TILING.block_k // 32)
    inputs = [ir.MemRefType.get([ir.ShapedType.get_dynamic_size()], i8), ir.MemRefType.get([words], i32)]
    func = gpu.GPUFuncOp(ir.TypeAttr.get(ir.FunctionType.get(inputs, [])), sym_name="nm_metadata", kernel=True)
    block = func.body.blocks.append(*inputs)
    with ir.InsertionPoint(block):
        crd, meta = block.arguments
        at = arith.addi(arith.muli(gpu.block_id(gpu.Dimension.x), _c(WARPGROUP)), gpu.thread_id(gpu.Dimension.x))
        with ir.InsertionPoint(scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, at, _c(words))).then_block):
            thread = arith.remui(at, _c(WARPGROUP))
            step = arith.remui(arith.divui(at, _c(WARPGROUP)), _c(steps))
            tile = arith.divui(at, _c(WARPGROUP * steps))
            lane = arith.remui(thread, _c(32))
            row0 = arith.addi(arith.addi(arith.muli(tile, _c(64)), arith.muli(arith.divui(thread, _c(32)), _c(16))),
                              arith.divui(lane, _c(4)))
            first = arith.addi(arith.muli(step, _c(16)), arith.muli(arith.remui(lane, _c(2)), _c(8)))
            word = _c(0, i32)
            for h in range(2):
                row = arith.addi(row0, _c(8 * h))
                inside = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, row, _c(rows)),
                                    arith.cmpi(arith.CmpIPredicate.ult, first, _c(stored)))
                branch = scf.IfOp(inside, [i32], has_else=True)
                with ir.InsertionPoint(branch.then_block):
                    bits = _c(0, i32)
                    start = arith.addi(arith.muli(row, _c(stored)), first)
                    for i in range(8):
                        offset = arith.extui(i32, memref.load(crd, [arith.addi(start, _c(i))]))
                        bits = arith.ori(bits, arith.shli(arith.andi(offset, _c(3, i32)), _c(2 * i, i32)))
                    scf.YieldOp([bits])
                with ir.InsertionPoint(branch.else_block):
                    scf.YieldOp([_c(META_FILL & 0xFFFF, i32)])
                word = arith.ori(word, arith.shli(branch.results[0], _c(16 * h, i32)))
            memref.store(word, meta, [at])
            scf.YieldOp([])
        gpu.ReturnOp([])
