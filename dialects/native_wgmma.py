"""Hopper (``sm_90a``) GEMM kernels: TMA loads, an mbarrier ring and ``wgmma`` on shared-memory descriptors.

``C[M,N] = A[M,K] @ B[K,N]`` in float16 with float32 sums, ``A`` dense or
2:4 (values ``[M, K/2]`` plus the in-group offsets), ``B`` row-major.  The
layout follows the sm_90 GEMMs (CUTLASS's warp-specialized kernels):

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
* ``A`` is K-major (no transpose), ``B`` MN-major (``tnspB``): its shared
  layout is four 64-column boxes of ``64 x 128 B`` swizzled rows, so the
  descriptor's leading offset steps a box (8 KiB) and the stride offset
  8 rows (1 KiB);
* 2:4 ``A`` uses ``wgmma.mma_async.sp`` (no dialect has it: ``llvm.inline_asm``)
  with its metadata in the instruction's own layout, one 32-bit word per
  thread and k32 step, made from the stored offsets by a small kernel
  (``nm_metadata``) that runs before the GEMM;
* TMA zero-fills reads past the edges and the epilogue guards its stores, so
  any ``M`` and ``N`` work; TMA needs 16-byte row strides (``K % 8`` dense,
  ``K % 16`` 2:4, ``N % 8``).

Descriptors for TMA are made on the host (``runtime.tensor_maps``) from the
``tensormap`` kernel arguments' geometry.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from mlir import ir
from mlir.dialects import arith, builtin, gpu, llvm, memref, nvgpu, nvvm, scf, vector

from sparse_mlir.gpu_program import KernelArg, Launch

__all__ = ["WgmmaTiling", "TILING", "wgmma_gemm", "metadata_words", "META_FILL", "fits_wgmma", "HOPPER"]

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


def _sparse_mma(acc: ir.Value, desc_a: ir.Value, desc_b: ir.Value, meta: ir.Value) -> ir.Value:
    """``wgmma.mma_async.sp`` m64n256k32 f32 += f16 * f16, B transposed (MN-major), metadata selector 0."""
    n = TILING.block_n // 2
    registers = ", ".join(f"${i}" for i in range(n))
    text = ("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            f"wgmma.mma_async.sp.sync.aligned.m64n{TILING.block_n}k32.f32.f16.f16 "
            f"{{{registers}}}, ${2 * n}, ${2 * n + 1}, ${2 * n + 2}, 0, p, 1, 1, 0, 1;\n}}\n")
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["l", "l", "r"])
    values = [llvm.extractvalue(ir.F32Type.get(), acc, [i]) for i in range(n)]
    return llvm.inline_asm(_accumulator_type(), [*values, desc_a, desc_b, meta], text, constraints,
                           has_side_effects=True)


def _dense_mma(acc: ir.Value, desc_a: ir.Value, desc_b: ir.Value) -> ir.Value:
    """``wgmma.mma_async`` m64n256k16 f32 += f16 * f16, A K-major, B MN-major."""
    return nvvm.WgmmaMmaAsyncOp(
        _accumulator_type(), acc, desc_a, desc_b,
        ir.Attribute.parse(f"#nvvm.shape<m = 64, n = {TILING.block_n}, k = 16>"),
        ir.Attribute.parse("#nvvm.wgmma_type<f16>"), ir.Attribute.parse("#nvvm.wgmma_type<f16>"),
        ir.Attribute.parse("#nvvm.wgmma_type<f32>"), ir.Attribute.parse("#nvvm.wgmma_scale_out<one>"),
        ir.Attribute.parse("#nvvm.wgmma_scale_in<one>"), ir.Attribute.parse("#nvvm.wgmma_scale_in<one>"),
        ir.Attribute.parse("#nvvm.mma_layout<row>"), ir.Attribute.parse("#nvvm.mma_layout<row>")).result


def wgmma_gemm(rows: int, inner: int, cols: int, sparse: bool, out_elt: str, args: tuple[KernelArg, ...]
               ) -> tuple[Launch, ...]:
    """Add the Hopper GEMM (and for 2:4 the metadata kernel) to the ``gpu.module`` at the insertion point.

    ``args`` are the kernel arguments of ``A`` (dense: the matrix; 2:4:
    positions, offsets, values), ``B`` and ``C``; a 2:4 GEMM also takes
    scratch 0 (the metadata words).  Returns the launches, in order.
    """
    t = TILING
    a_box, a_swizzle, a_row_bytes = ((t.block_m, t.block_k // 2), "swizzle_64b", t.block_k) if sparse else \
        ((t.block_m, t.block_k), "swizzle_128b", 2 * t.block_k)
    a_stored = inner // 2 if sparse else inner
    stage_a = t.block_m * a_row_bytes
    stage_b = t.block_k * t.block_n * 2
    stage = stage_a + stage_b
    shared_bytes = t.stages * stage + 1024  # + alignment slack for the 1024-byte swizzle atoms
    steps = math.ceil(inner / t.block_k)
    a_arg, b_arg, c_arg = (args[2] if sparse else args[0]), args[-2], args[-1]
    tma_a = KernelArg("tensormap", a_arg.ref, (a_stored, rows, a_box[1], a_box[0], a_row_bytes, 2))
    tma_b = KernelArg("tensormap", b_arg.ref, (cols, inner, _BOX, t.block_k, 128, 2))
    f16, f32, i32, i64 = ir.F16Type.get(), ir.F32Type.get(), ir.IntegerType.get_signless(32), \
        ir.IntegerType.get_signless(64)
    out_type = f16 if out_elt == "f16" else f32
    c_type = ir.MemRefType.get([rows, cols], out_type)
    meta_words = metadata_words(rows, inner)
    # TMA descriptors arrive as plain pointers (a gpu.func signature keeps no nvgpu type through the NVVM
    # conversion) and are viewed as the descriptor types inside
    pointer = llvm.PointerType.get()
    inputs = [pointer, pointer, c_type]
    if sparse:
        inputs.append(ir.MemRefType.get([meta_words], i32))
    name = "gemm_2to4_sm90" if sparse else "gemm_f16_sm90"
    func = gpu.GPUFuncOp(ir.TypeAttr.get(ir.FunctionType.get(inputs, [])), sym_name=name, kernel=True)
    func.attributes["nvvm.maxntid"] = ir.Attribute.parse(f"array<i32: {3 * WARPGROUP}, 1, 1>")
    func.attributes["nvvm.minctasm"] = ir.Attribute.parse("1 : i32")
    block = func.body.blocks.append(*inputs)
    with ir.InsertionPoint(block):
        desc_a, desc_b = (builtin.unrealized_conversion_cast([kind], [value]) for kind, value in
                          ((_tensor_map_type(a_box, a_swizzle), block.arguments[0]),
                           (_tensor_map_type((t.block_k, _BOX), "swizzle_128b"), block.arguments[1])))
        c_out = block.arguments[2]
        meta = block.arguments[3] if sparse else None
        _gemm_body(desc_a, desc_b, c_out, meta, rows, inner, cols, sparse, out_type, stage_a, stage, steps)
        gpu.ReturnOp([])
    grid = (math.ceil(rows / t.block_m), math.ceil(cols / t.block_n), 1)
    launches = []
    scratch_args: tuple[KernelArg, ...] = ()
    if sparse:
        meta_arg = KernelArg("scratch", 0, (meta_words,))
        scratch_args = (meta_arg,)
        _metadata_kernel(rows, inner)
        launches.append(Launch("nm_metadata", (math.ceil(meta_words / WARPGROUP), 1, 1), (WARPGROUP, 1, 1),
                               (args[1], meta_arg), fills_output=True, chips=(HOPPER,)))
    launches.append(Launch(name, grid, (3 * WARPGROUP, 1, 1), (tma_a, tma_b, c_arg, *scratch_args),
                           shared_bytes=shared_bytes, fills_output=True, chips=(HOPPER,)))
    return tuple(launches)


def _gemm_body(desc_a: ir.Value, desc_b: ir.Value, c_out: ir.Value, meta: ir.Value | None, rows: int, inner: int,
               cols: int, sparse: bool, out_type: ir.Type, stage_a: int, stage: int, steps: int) -> None:
    t = TILING
    i1, i32, i64 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    index = ir.IndexType.get()
    shared = _shared()
    smem = gpu.dynamic_shared_memory(ir.MemRefType.get([ir.ShapedType.get_dynamic_size()], ir.IntegerType.get_signless(8),
                                                       memory_space=shared))
    base = arith.index_cast(i64, memref.extract_aligned_pointer_as_index(smem))
    aligned = arith.andi(arith.addi(base, _c(1023, i64)), _c(-1024, i64))
    pad = arith.index_cast(index, arith.subi(aligned, base))
    tid = gpu.thread_id(gpu.Dimension.x)
    warpgroup = arith.divui(tid, _c(WARPGROUP))
    thread = arith.remui(tid, _c(WARPGROUP))
    m0 = arith.muli(gpu.block_id(gpu.Dimension.x), _c(t.block_m))
    n0 = arith.muli(gpu.block_id(gpu.Dimension.y), _c(t.block_n))
    barriers = ir.Type.parse(f"!nvgpu.mbarrier.group<memorySpace = {shared}, num_barriers = {t.stages}>")
    full, empty = nvgpu.mbarrier_create(barriers), nvgpu.mbarrier_create(barriers)
    first = arith.cmpi(arith.CmpIPredicate.eq, tid, _c(0))
    for s in range(t.stages):
        nvgpu.mbarrier_init(full, _c(1), _c(s), predicate=first)
        nvgpu.mbarrier_init(empty, _c(8), _c(s), predicate=first)  # the eight consumer warps
    nvgpu.tma_prefetch_descriptor(desc_a, predicate=first)
    nvgpu.tma_prefetch_descriptor(desc_b, predicate=first)
    gpu.barrier()
    ticks = _c(10_000_000)
    a_box = (t.block_m, t.block_k // 2) if sparse else (t.block_m, t.block_k)

    def view(offset: ir.Value, shape: tuple[int, int]) -> ir.Value:
        return memref.view(ir.MemRefType.get(list(shape), ir.F16Type.get(), memory_space=shared), smem,
                           arith.addi(pad, offset), [])

    producer = arith.cmpi(arith.CmpIPredicate.eq, warpgroup, _c(0))
    branch = scf.IfOp(producer, has_else=True)
    with ir.InsertionPoint(branch.then_block):
        nvvm.setmaxregister(t.producer_registers, nvvm.SetMaxRegisterAction.decrease)
        loop = scf.ForOp(_c(0), _c(steps), _c(1))
        with ir.InsertionPoint(loop.body):
            k = loop.induction_variable
            s = arith.remui(k, _c(t.stages))
            phase = arith.index_cast(i1, arith.remui(arith.divui(k, _c(t.stages)), _c(2)))
            nvgpu.MBarrierTryWaitParityOp(empty, arith.xori(phase, _c(1, i1)), ticks, s)
            nvgpu.mbarrier_arrive_expect_tx(full, _c(stage), s, predicate=first)
            at = arith.muli(s, _c(stage))
            nvgpu.TmaAsyncLoadOp(view(at, a_box), full, desc_a,
                                 [arith.muli(k, _c(a_box[1])), m0], s, predicate=first)
            k_row = arith.muli(k, _c(t.block_k))
            for box in range(t.block_n // _BOX):
                offset = arith.addi(at, _c(stage_a + box * t.block_k * _BOX * 2))
                nvgpu.TmaAsyncLoadOp(view(offset, (t.block_k, _BOX)), full, desc_b,
                                     [arith.addi(n0, _c(box * _BOX)), k_row], s, predicate=first)
            scf.YieldOp([])
        scf.YieldOp([])
    with ir.InsertionPoint(branch.else_block):
        nvvm.setmaxregister(t.consumer_registers, nvvm.SetMaxRegisterAction.increase)
        _consumer(full, empty, smem, aligned, c_out, meta, warpgroup, thread, m0, n0, rows, inner, cols, sparse,
                  out_type, stage_a, stage, steps, ticks)
        scf.YieldOp([])


def _consumer(full: ir.Value, empty: ir.Value, smem: ir.Value, aligned: ir.Value, c_out: ir.Value,
              meta: ir.Value | None, warpgroup: ir.Value, thread: ir.Value, m0: ir.Value, n0: ir.Value, rows: int,
              inner: int, cols: int, sparse: bool, out_type: ir.Type, stage_a: int, stage: int, steps: int,
              ticks: ir.Value) -> None:
    t = TILING
    i1, i32, i64 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    index = ir.IndexType.get()
    half = arith.subi(warpgroup, _c(1))  # which 64 rows of the tile
    lane = arith.remui(thread, _c(32))
    warp_leader = arith.cmpi(arith.CmpIPredicate.eq, lane, _c(0))
    a_rows_bytes = (t.block_k if sparse else 2 * t.block_k)  # bytes per A row in a stage
    a_half = arith.index_cast(i64, arith.muli(half, _c(64 * a_rows_bytes)))
    mmas = t.block_k // (32 if sparse else 16)
    a_step = 32  # bytes of A per MMA along K: 16 stored elements (k32 sparse, k16 dense)
    b_step = (32 if sparse else 16) * 128  # bytes of B per MMA: 32 or 16 rows of 128-byte box rows
    a_stride = 512 if sparse else 1024  # 8 rows of the swizzle atom
    a_mode = 2 if sparse else 1  # 64B / 128B swizzle
    tiles_k = math.ceil(inner / t.block_k)
    meta_base = None
    if sparse:  # words of this thread: [(row tile), (k32 step), thread]
        row_tile = arith.addi(arith.divui(m0, _c(64)), half)
        meta_base = arith.addi(arith.muli(row_tile, _c(tiles_k * mmas * WARPGROUP)), thread)
    zero = llvm.mlir_zero(_accumulator_type())
    loop = scf.ForOp(_c(0), _c(steps), _c(1), [zero])
    with ir.InsertionPoint(loop.body):
        k = loop.induction_variable
        acc = loop.inner_iter_args[0]
        s = arith.remui(k, _c(t.stages))
        phase = arith.index_cast(i1, arith.remui(arith.divui(k, _c(t.stages)), _c(2)))
        words = []
        if sparse:
            for j in range(mmas):
                at = arith.addi(meta_base, arith.muli(arith.addi(arith.muli(k, _c(mmas)), _c(j)), _c(WARPGROUP)))
                words.append(memref.load(meta, [at]))
        nvgpu.MBarrierTryWaitParityOp(full, phase, ticks, s)
        stage_at = arith.addi(aligned, arith.index_cast(i64, arith.muli(s, _c(stage))))
        a_at = arith.addi(stage_at, a_half)
        b_at = arith.addi(stage_at, _c(stage_a, i64))
        nvvm.WgmmaFenceAlignedOp()
        for j in range(mmas):
            da = _descriptor(arith.addi(a_at, _c(j * a_step, i64)), 16, a_stride, a_mode)
            db = _descriptor(arith.addi(b_at, _c(j * b_step, i64)), t.block_k * 128, 1024, 1)
            acc = _sparse_mma(acc, da, db, words[j]) if sparse else _dense_mma(acc, da, db)
        nvvm.WgmmaGroupSyncAlignedOp()
        nvvm.WgmmaWaitGroupSyncOp(1)
        # the group of step k-1 is done: its stage may be refilled
        release = arith.andi(warp_leader, arith.cmpi(arith.CmpIPredicate.ugt, k, _c(0)))
        with ir.InsertionPoint(scf.IfOp(release).then_block):
            previous = arith.remui(arith.addi(k, _c(t.stages - 1)), _c(t.stages))
            nvgpu.mbarrier_arrive(empty, previous)
            scf.YieldOp([])
        scf.YieldOp([acc])
    nvvm.WgmmaWaitGroupSyncOp(0)
    _epilogue(loop.results[0], c_out, half, thread, m0, n0, rows, cols, out_type)


def _epilogue(acc: ir.Value, c_out: ir.Value, half: ir.Value, thread: ir.Value, m0: ir.Value, n0: ir.Value,
              rows: int, cols: int, out_type: ir.Type) -> None:
    """Registers to ``C``: register ``4j + 2h + e`` holds row ``l/4 + 8h`` and column ``8j + 2(l%4) + e`` of the
    warp's 16 rows (the wgmma accumulator layout); pairs are stored together, rows and columns guarded."""
    f32 = ir.F32Type.get()
    warp = arith.divui(thread, _c(32))
    lane = arith.remui(thread, _c(32))
    row_base = arith.addi(arith.addi(m0, arith.muli(half, _c(64))),
                          arith.addi(arith.muli(warp, _c(16)), arith.divui(lane, _c(4))))
    col_base = arith.addi(n0, arith.muli(arith.remui(lane, _c(4)), _c(2)))
    pair = ir.VectorType.get([2], out_type)
    for h in range(2):
        row = arith.addi(row_base, _c(8 * h))
        row_ok = arith.cmpi(arith.CmpIPredicate.ult, row, _c(rows))
        for j in range(TILING.block_n // 8):
            col = arith.addi(col_base, _c(8 * j))
            values = [llvm.extractvalue(f32, acc, [4 * j + 2 * h + e]) for e in range(2)]
            if out_type != f32:
                values = [arith.truncf(out_type, v) for v in values]
            ok = arith.andi(row_ok, arith.cmpi(arith.CmpIPredicate.ult, col, _c(cols)))
            with ir.InsertionPoint(scf.IfOp(ok).then_block):
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
