"""Load-balanced CUDA kernels for CSR SpMV and SpMM, emitted as ``gpu.func``s instead of sparsified.

The sparsified kernels map one row to one thread: neighbouring threads read
far-apart nonzeros (uncoalesced) and one long row stalls its warp.  These
follow the vector-CSR and Sputnik layouts instead:

* **SpMV** ``y[i] = A[i,j] * x[j]``: a row is a group of ``lanes`` threads
  (a power of two up to a warp, picked at launch from the mean row length:
  ``LaneRule``) that read the row's nonzeros contiguously and combine
  their partial sums with warp shuffles.
* **SpMM** ``C[i,j] = A[i,k] * B[k,j] (+ bias)``: a warp per row and column
  tile; lane ``l`` owns 16-byte vectors ``l, l+32, ...`` of the tile (single
  elements when the row length is not a multiple of 16 bytes), so every
  load of a B row and every store of C is one coalesced 128-bit access per
  lane, and each nonzero is read once per warp (a broadcast).  The bias
  seeds the sums.  Vector accesses need 16-byte aligned B, C and bias
  (``Launch.aligned``; the runtime checks).

Both produce the same ``gpu.module`` + ``Launch`` records as the generic
path, so PTX generation, manifests and the runtime are shared.  Only CSR
``float32``/``float64`` with 32- or 64-bit indices take this path; everything
else is sparsified.
"""

from __future__ import annotations

import math

from mlir import ir

from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format
from sparse_mlir.gpu_program import KernelArg, LaneRule, Launch

from .patterns import is_csr, spmm_operands, spmv_operands

__all__ = ["native_gpu", "WARP", "BLOCK"]

WARP = 32
BLOCK = 128  # threads per block: four warps
_TILE = 4  # most vectors a lane owns in one SpMM column tile
_FLOAT = {"float32": "f32", "float64": "f64"}


def native_gpu(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]]
               ) -> tuple[ir.Module, tuple[Launch, ...]] | None:
    """The module and launches of a hand-scheduled kernel for ``spec``, or ``None`` if none applies."""
    if spec.dtype.name not in _FLOAT:
        return None
    elt = _FLOAT[spec.dtype.name]
    if (found := spmv_operands(spec, formats)) is not None:
        a, x = found
        fmt = formats[a]
        rows, cols = shapes[a]
        text = _spmv_text(elt, fmt, rows, cols)
        args = tuple(_args(spec, a, (x, (cols,)), (spec.output, (rows,))))
        launch = Launch("spmv", (1, 1, 1), (BLOCK, 1, 1), (*args, KernelArg("lanes", 0)),
                        lanes=LaneRule(ref=args[1].ref, rows=rows))
        return ir.Module.parse(text), (launch,)
    spmm = spmm_operands(spec, formats)
    if spmm is None or not is_csr(formats[spmm[0]]):
        return None
    a, b, bias, bias_dim = spmm
    rows, inner = shapes[a]
    cols = shapes[spec.output][1]
    if cols is None:
        return None
    fmt = formats[a]
    width, per_lane = _spmm_shape(elt, cols)
    tiles = math.ceil(cols / (WARP * width * per_lane))
    text = _spmm_text(elt, fmt, rows, inner, cols, bias_dim if bias else -1)
    dense = [(b, (inner, cols))] + ([(bias, (rows,) if bias_dim == 0 else (cols,))] if bias else [])
    args = tuple(_args(spec, a, *dense, (spec.output, (rows, cols))))
    aligned = tuple(arg.ref for arg in args[3:]) if width > 1 else ()
    launch = Launch("spmm", (math.ceil(rows / (BLOCK // WARP)), tiles, 1), (BLOCK, 1, 1), args, aligned=aligned)
    return ir.Module.parse(text), (launch,)


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


def _memref(shape: tuple[int, ...], elt: str) -> str:
    return f"memref<{'x'.join(str(s) for s in shape)}x{elt}>"


def _index_types(fmt: Format) -> tuple[str, str]:
    return f"i{fmt.pos_width or 64}", f"i{fmt.crd_width or 64}"


def _row_bounds(pos_t: str, row: str, valid: str) -> list[str]:
    """``%start``/``%end`` of ``row``'s nonzeros, both 0 when ``valid`` is false (the row is past the end)."""
    return [f"%safe_row = arith.select {valid}, {row}, %c0 : index",
            f"%s_raw = memref.load %pos[%safe_row] : memref<?x{pos_t}>",
            "%next_row = arith.addi %safe_row, %c1 : index",
            f"%e_raw = memref.load %pos[%next_row] : memref<?x{pos_t}>",
            f"%s_idx = arith.index_castui %s_raw : {pos_t} to index",
            f"%e_idx = arith.index_castui %e_raw : {pos_t} to index",
            f"%start = arith.select {valid}, %s_idx, %c0 : index",
            f"%end = arith.select {valid}, %e_idx, %c0 : index"]


def _spmv_text(elt: str, fmt: Format, rows: int, cols: int) -> str:
    pos_t, crd_t = _index_types(fmt)
    body = ["%c0 = arith.constant 0 : index", "%c1 = arith.constant 1 : index",
            f"%rows = arith.constant {rows} : index", f"%zero = arith.constant 0.0 : {elt}",
            "%tid = gpu.thread_id x", "%bid = gpu.block_id x", "%bdim = gpu.block_dim x",
            "%first_thread = arith.muli %bid, %bdim : index", "%gtid = arith.addi %first_thread, %tid : index",
            "%row = arith.divui %gtid, %lanes : index", "%lane = arith.remui %gtid, %lanes : index",
            "%valid = arith.cmpi ult, %row, %rows : index", *_row_bounds(pos_t, "%row", "%valid"),
            "%k0 = arith.addi %start, %lane : index",
            f"%partial = scf.for %k = %k0 to %end step %lanes iter_args(%acc = %zero) -> ({elt}) {{",
            f"  %j_raw = memref.load %crd[%k] : memref<?x{crd_t}>",
            f"  %j = arith.index_castui %j_raw : {crd_t} to index",
            f"  %a = memref.load %val[%k] : memref<?x{elt}>",
            f"  %xj = memref.load %x[%j] : {_memref((cols,), elt)}",
            f"  %sum = math.fma %a, %xj, %acc : {elt}",
            f"  scf.yield %sum : {elt}", "}",
            "%width = arith.constant 32 : i32", "%lanes_i32 = arith.index_cast %lanes : index to i32"]
    # butterfly over the group: every lane of the warp takes part, offsets below the group size stay inside it
    value = "%partial"
    for step, offset in enumerate((16, 8, 4, 2, 1)):
        body += [f"%off{step} = arith.constant {offset} : i32",
                 f"%other{step}, %ok{step} = gpu.shuffle xor {value}, %off{step}, %width : {elt}",
                 f"%inside{step} = arith.cmpi ult, %off{step}, %lanes_i32 : i32",
                 f"%add{step} = arith.addf {value}, %other{step} : {elt}",
                 f"%red{step} = arith.select %inside{step}, %add{step}, {value} : {elt}"]
        value = f"%red{step}"
    body += ["%leader = arith.cmpi eq, %lane, %c0 : index", "%write = arith.andi %valid, %leader : i1",
             "scf.if %write {", f"  memref.store {value}, %y[%row] : {_memref((rows,), elt)}", "}", "gpu.return"]
    params = (f"%pos: memref<?x{pos_t}>, %crd: memref<?x{crd_t}>, %val: memref<?x{elt}>, "
              f"%x: {_memref((cols,), elt)}, %y: {_memref((rows,), elt)}, %lanes: index")
    return _module("spmv", params, body)


def _spmm_shape(elt: str, cols: int) -> tuple[int, int]:
    """``(width, per_lane)``: elements per vector access (16 bytes when the rows allow it) and vectors per lane."""
    width = 16 // (4 if elt == "f32" else 8)
    if cols % width:
        width = 1
    return width, max(1, min(_TILE, math.ceil(cols / (WARP * width))))


def _spmm_text(elt: str, fmt: Format, rows: int, inner: int, cols: int, bias_dim: int) -> str:
    pos_t, crd_t = _index_types(fmt)
    width, per_lane = _spmm_shape(elt, cols)
    b_t, c_t = _memref((inner, cols), elt), _memref((rows, cols), elt)
    vec = f"vector<{width}x{elt}>"

    def load(buffer: str, index: str, memref: str) -> str:
        if width == 1:
            return f"memref.load {buffer}[{index}] : {memref}"
        return f"vector.load {buffer}[{index}] {{alignment = 16}} : {memref}, {vec}"

    body = ["%c0 = arith.constant 0 : index", "%c1 = arith.constant 1 : index",
            f"%rows = arith.constant {rows} : index", f"%cols = arith.constant {cols} : index",
            f"%warp = arith.constant {WARP} : index", f"%zero = arith.constant 0.0 : {elt}",
            f"%width = arith.constant {width} : index",
            "%tid = gpu.thread_id x", "%bid = gpu.block_id x", "%tile = gpu.block_id y",
            f"%warps = arith.constant {BLOCK // WARP} : index",
            "%warp_in_block = arith.divui %tid, %warp : index", "%lane = arith.remui %tid, %warp : index",
            "%lane_col = arith.muli %lane, %width : index",
            "%first_row = arith.muli %bid, %warps : index", "%row = arith.addi %first_row, %warp_in_block : index",
            "%valid = arith.cmpi ult, %row, %rows : index", *_row_bounds(pos_t, "%row", "%valid"),
            f"%tile_cols = arith.constant {WARP * width * per_lane} : index",
            "%tile_col = arith.muli %tile, %tile_cols : index"]
    # lane's columns (whole vectors: cols is a multiple of the width), clamped for loads and guarded for stores
    for t in range(per_lane):
        body += [f"%off{t} = arith.constant {t * WARP * width} : index",
                 f"%cb{t} = arith.addi %tile_col, %off{t} : index",
                 f"%col{t} = arith.addi %cb{t}, %lane_col : index", f"%in{t} = arith.cmpi ult, %col{t}, %cols : index",
                 f"%safe{t} = arith.select %in{t}, %col{t}, %c0 : index"]
        if bias_dim == 0:
            scalar = f"%bias_row{t} = memref.load %bias[%safe_row] : {_memref((rows,), elt)}"
            body += [scalar] if width == 1 else [scalar, f"%seed{t} = vector.broadcast %bias_row{t} : {elt} to {vec}"]
            if width == 1:
                body.append(f"%seed{t} = arith.addf %bias_row{t}, %zero : {elt}")
        elif bias_dim == 1:
            body.append(f"%seed{t} = {load('%bias', f'%safe{t}', _memref((cols,), elt))}")
        else:
            body.append(f"%seed{t} = arith.constant {'0.0' if width == 1 else f'dense<0.0> : {vec}'}"
                        + (f" : {elt}" if width == 1 else ""))
    acc_t = elt if width == 1 else vec
    accs = ", ".join(f"%acc{t} = %seed{t}" for t in range(per_lane))
    types = ", ".join([acc_t] * per_lane)
    body += [f"%sums:{per_lane} = scf.for %k = %start to %end step %c1 iter_args({accs}) -> ({types}) {{",
             f"  %k_raw = memref.load %crd[%k] : memref<?x{crd_t}>",
             f"  %kk = arith.index_castui %k_raw : {crd_t} to index",
             f"  %a = memref.load %val[%k] : memref<?x{elt}>"]
    if width > 1:
        body.append(f"  %av = vector.broadcast %a : {elt} to {vec}")
    for t in range(per_lane):
        body += [f"  %b{t} = {load('%b', f'%kk, %safe{t}', b_t)}",
                 f"  %n{t} = math.fma {'%a' if width == 1 else '%av'}, %b{t}, %acc{t} : {acc_t}"]
    body += [f"  scf.yield {', '.join(f'%n{t}' for t in range(per_lane))} : {types}", "}"]
    for t in range(per_lane):
        store = (f"  memref.store %sums#{t}, %c[%row, %col{t}] : {c_t}" if width == 1 else
                 f"  vector.store %sums#{t}, %c[%row, %col{t}] {{alignment = 16}} : {c_t}, {vec}")
        body += [f"%w{t} = arith.andi %valid, %in{t} : i1", f"scf.if %w{t} {{", store, "}"]
    body.append("gpu.return")
    bias = "" if bias_dim < 0 else f"%bias: {_memref((rows,) if bias_dim == 0 else (cols,), elt)}, "
    params = (f"%pos: memref<?x{pos_t}>, %crd: memref<?x{crd_t}>, %val: memref<?x{elt}>, %b: {b_t}, {bias}"
              f"%c: {c_t}")
    return _module("spmm", params, body)


def _module(name: str, params: str, body: list[str]) -> str:
    inner = "\n".join("      " + line for line in body)
    return ("module attributes {gpu.container_module} {\n"
            "  gpu.module @kernels {\n"
            f"    gpu.func @{name}({params}) kernel {{\n{inner}\n    }}\n"
            "  }\n}\n")
