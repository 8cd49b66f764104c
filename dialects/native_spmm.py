"""A register-tiled CSR SpMM, ``C[i,j] = A[i,k] * B[k,j]``, emitted directly instead of sparsified.

The sparsifier's SpMM loads and stores the whole C row once per nonzero
(the loop over B's columns is innermost).  Here each row's C is computed in
column tiles of ``4 x VL`` elements kept in vector registers while the row's
nonzeros stream by: per nonzero, four vector loads of B and four FMAs, and C
is stored once.  Columns past the last whole tile take a scalar loop.  Rows
run as an ``scf.parallel`` loop, which the CPU pipeline threads like any
other.  The function has exactly the signature the sparse assembler would
have given (level buffers, then dense memrefs, returning C), so the C entry
point and everything after it are shared with sparsified kernels.
"""

from __future__ import annotations

from mlir import ir

from sparse_mlir.dsl.ast import Access, Binary
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import CSR, Format

from .kernel import KERNEL_NAME

__all__ = ["native_spmm"]

_UNROLL = 4  # vector accumulators per tile


def _operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str] | None:
    """``(sparse A, dense B)`` when the kernel is exactly a CSR SpMM with a dense result."""
    if spec.sparse_output or len(spec.stages) != 1:
        return None
    stage = spec.stages[0]
    body = stage.body
    if len(stage.reduce) != 1 or len(stage.indices) != 2 or not isinstance(body, Binary) or body.op != "*":
        return None
    if not (isinstance(body.lhs, Access) and isinstance(body.rhs, Access)) or body.lhs.tensor == body.rhs.tensor:
        return None
    (k,), (i, j) = stage.reduce, stage.indices
    for a, b in ((body.lhs, body.rhs), (body.rhs, body.lhs)):
        fmt = formats.get(a.tensor)
        if fmt is not None and fmt.with_widths(32, 32) == CSR and b.tensor not in formats \
                and a.index == (i, k) and b.index == (k, j) and spec.output_indices == (i, j):
            return a.tensor, b.tensor
    return None


def native_spmm(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]]
                ) -> ir.Module | None:
    """The tiled SpMM module for ``spec`` in the current context, or ``None`` when it does not apply."""
    found = _operands(spec, formats)
    if found is None:
        return None
    a_name, b_name = found
    fmt = formats[a_name]
    elt = {"float32": "f32", "float64": "f64", "int32": "i32", "int64": "i64"}[spec.dtype.name]
    lanes = 32 // spec.dtype.itemsize  # one 256-bit register
    tile = _UNROLL * lanes
    vec = f"vector<{lanes}x{elt}>"
    pos_t, crd_t = (f"i{w or 64}" for w in (fmt.pos_width, fmt.crd_width))
    rows = shapes[a_name][0]
    is_float = elt.startswith("f")
    zero = "0.0" if is_float else "0"
    buffers = {"pos1": f"memref<?x{pos_t}>", "crd1": f"memref<?x{crd_t}>", "values": f"memref<?x{elt}>"}
    params, types = [], []
    for name in spec.inputs:
        if name == a_name:
            params += ["%pos", "%crd", "%val"]
            types += [buffers["pos1"], buffers["crd1"], buffers["values"]]
        else:
            params.append("%B")
            types.append(f"memref<?x?x{elt}>")
    params.append("%C")
    types.append(f"memref<?x?x{elt}>")
    signature = ", ".join(f"{p}: {t}" for p, t in zip(params, types))

    def fma(acc: str, b: str, n: int) -> list[str]:
        if is_float:
            return [f"%n{n} = vector.fma %vb, {b}, {acc} : {vec}"]
        return [f"%m{n} = arith.muli %vb, {b} : {vec}", f"%n{n} = arith.addi {acc}, %m{n} : {vec}"]

    scalar_madd = ([f"%m = arith.mulf %v, %b : {elt}", f"%t = arith.addf %acc, %m : {elt}"] if is_float else
                   [f"%m = arith.muli %v, %b : {elt}", f"%t = arith.addi %acc, %m : {elt}"])
    tile_body = []
    for u in range(_UNROLL):
        tile_body.append(f"%j{u} = arith.addi %jj, %c{u * lanes} : index")
    loads = [f"%b{u} = vector.load %B[%k, %j{u}] : memref<?x?x{elt}>, {vec}" for u in range(_UNROLL)]
    fmas = [line for u in range(_UNROLL) for line in fma(f"%a{u}", f"%b{u}", u)]
    iter_args = ", ".join(f"%a{u} = %zv" for u in range(_UNROLL))
    vec_types = ", ".join([vec] * _UNROLL)
    yields = ", ".join(f"%n{u}" for u in range(_UNROLL))
    stores = [f"vector.store %r#{u}, %C[%i, %j{u}] : memref<?x?x{elt}>, {vec}" for u in range(_UNROLL)]
    offsets = sorted({0, 1, tile, *(u * lanes for u in range(_UNROLL))})
    consts = "\n".join(f"    %c{c} = arith.constant {c} : index" for c in offsets)
    text = f"""
module {{
  func.func @{KERNEL_NAME}({signature}) -> memref<?x?x{elt}> attributes {{llvm.emit_c_interface}} {{
{consts}
    %rows = arith.constant {rows} : index
    %N = memref.dim %C, %c1 : memref<?x?x{elt}>
    %rem = arith.remui %N, %c{tile} : index
    %Nv = arith.subi %N, %rem : index
    %zero = arith.constant {zero} : {elt}
    %zv = arith.constant dense<{zero}> : {vec}
    scf.parallel (%i) = (%c0) to (%rows) step (%c1) {{
      %i1 = arith.addi %i, %c1 : index
      %lo_raw = memref.load %pos[%i] : memref<?x{pos_t}>
      %hi_raw = memref.load %pos[%i1] : memref<?x{pos_t}>
      %lo = arith.index_castui %lo_raw : {pos_t} to index
      %hi = arith.index_castui %hi_raw : {pos_t} to index
      scf.for %jj = %c0 to %Nv step %c{tile} {{
        {chr(10).join("        " + line for line in tile_body).strip()}
        %r:{_UNROLL} = scf.for %p = %lo to %hi step %c1 iter_args({iter_args}) -> ({vec_types}) {{
          %k_raw = memref.load %crd[%p] : memref<?x{crd_t}>
          %k = arith.index_castui %k_raw : {crd_t} to index
          %v = memref.load %val[%p] : memref<?x{elt}>
          %vb = vector.broadcast %v : {elt} to {vec}
          {chr(10).join("          " + line for line in loads + fmas).strip()}
          scf.yield {yields} : {vec_types}
        }}
        {chr(10).join("        " + line for line in stores).strip()}
      }}
      scf.for %j = %Nv to %N step %c1 {{
        %s = scf.for %p = %lo to %hi step %c1 iter_args(%acc = %zero) -> ({elt}) {{
          %k_raw = memref.load %crd[%p] : memref<?x{crd_t}>
          %k = arith.index_castui %k_raw : {crd_t} to index
          %v = memref.load %val[%p] : memref<?x{elt}>
          %b = memref.load %B[%k, %j] : memref<?x?x{elt}>
          {chr(10).join("          " + line for line in scalar_madd).strip()}
          scf.yield %t : {elt}
        }}
        memref.store %s, %C[%i, %j] : memref<?x?x{elt}>
      }}
      scf.reduce
    }}
    return %C : memref<?x?x{elt}>
  }}
}}
"""
    module = ir.Module.parse(text)
    module.operation.verify()
    return module
