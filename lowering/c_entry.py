"""Emit the plain C entry point of a kernel (see ``sparse_mlir.abi.c_signature``) in the LLVM dialect.

The lowered module exports ``_mlir_ciface_kernel(result*, descriptor*...)``
whose memref descriptors are an MLIR convention.  This adds ``NAME(...)``
taking raw pointers and sizes: it checks them (status codes instead of wild
memory accesses), zero-fills a dense output, supplies the implicit positions
of N:M operands, builds the descriptors on the stack, calls the kernel, and
copies a sparse result's buffers into the caller's result struct.  The
wrapper is generated as LLVM-dialect text because it is plain straight-line
code over pointers, then parsed into the module.
"""

from __future__ import annotations

import numpy as np
from mlir import ir

from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.formats import LevelKind
from sparse_mlir.abi.c_signature import (
    BAD_LEVELS,
    NULL_POINTER,
    RESULT_OVERFLOW,
    SIZE_MISMATCH,
    OperandABI,
    Signature,
)
from sparse_mlir.dtypes import index_dtype

__all__ = ["add_c_entry_point", "INTERNAL_ERROR"]

INTERNAL_ERROR = 4  # a dense result not written in place: a compiler bug, never a user error

# The wrapper's loops (the position check, the implicit N:M positions) run on one thread before the kernel, on
# every call, and kernels scalar by design are built with LLVM's vectorizers off (``select.CpuChoice``), which
# left them scalar: on METIS mdual (258k rows, 4 nonzeros each) the position check was 15% of a 2-thread SpMV
# (413 us, 355 us vectorized: session 27).  This annotation vectorizes just these loops: LLVM's loop vectorizer
# still takes a loop that asks for it when it is switched off for the rest.
VECTORIZE = "#llvm.loop_annotation<vectorize = <disable = false>>"

_INT = {1: "i8", 2: "i16", 4: "i32", 8: "i64"}


def _llvm_type(dtype: np.dtype) -> str:
    return TYPE_NAMES[dtype.name]


def _descriptor_type(rank: int) -> str:
    if rank == 0:
        return "!llvm.struct<(ptr, ptr, i64)>"
    return f"!llvm.struct<(ptr, ptr, i64, array<{rank} x i64>, array<{rank} x i64>)>"


class _Text:
    """A tiny SSA text builder: fresh value names, blocks and the checks that branch to failure blocks."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0
        self.blocks = 0
        self.codes: set[int] = set()

    def __call__(self, op: str) -> str:
        name = f"%v{self.count}"
        self.count += 1
        self.lines.append(f"  {name} = {op}")
        return name

    def stmt(self, op: str) -> None:
        self.lines.append(f"  {op}")

    def i64(self, value: int) -> str:
        return self(f"llvm.mlir.constant({value} : i64) : i64")

    def fail_if(self, bad: str, code: int) -> None:
        self.codes.add(code)
        self.blocks += 1
        self.stmt(f"llvm.cond_br {bad}, ^fail{code}, ^ok{self.blocks}")
        self.lines.append(f"^ok{self.blocks}:")

    def back_edge(self, loop: str, arguments: str) -> None:
        """The branch back to a loop header ``loop`` with ``arguments`` (``"%a, %b : i64, i1"``), marked for
        LLVM's loop vectorizer (``VECTORIZE``)."""
        self.stmt(f"llvm.br {loop}({arguments}) {{loop_annotation = {VECTORIZE}}}")

    def ne(self, a: str, b: str) -> str:
        return self(f'llvm.icmp "ne" {a}, {b} : i64')

    def failure_blocks(self) -> list[str]:
        out = []
        for code in sorted(self.codes):
            out += [f"^fail{code}:", f"  %status{code} = llvm.mlir.constant({code} : i32) : i32",
                    f"  llvm.return %status{code} : i32"]
        return out


def _load_index(t: _Text, base: str, at: str, dtype: np.dtype) -> str:
    elt = _INT[dtype.itemsize]
    addr = t(f"llvm.getelementptr {base}[{at}] : (!llvm.ptr, i64) -> !llvm.ptr, {elt}")
    value = t(f"llvm.load {addr} : !llvm.ptr -> {elt}")
    return value if elt == "i64" else t(f"llvm.sext {value} : {elt} to i64")


def _descriptor(t: _Text, ptr: str, sizes: list[str], one: str, zero: str) -> str:
    """Store a row-major descriptor for ``ptr`` on the stack; return its address."""
    dtype = _descriptor_type(len(sizes))
    d = t(f"llvm.mlir.undef : {dtype}")
    d = t(f"llvm.insertvalue {ptr}, {d}[0] : {dtype}")
    d = t(f"llvm.insertvalue {ptr}, {d}[1] : {dtype}")
    d = t(f"llvm.insertvalue {zero}, {d}[2] : {dtype}")
    stride = one
    strides: list[str] = []
    for size in reversed(sizes):
        strides.insert(0, stride)
        stride = t(f"llvm.mul {stride}, {size} : i64")
    for k, (size, st) in enumerate(zip(sizes, strides)):
        d = t(f"llvm.insertvalue {size}, {d}[3, {k}] : {dtype}")
        d = t(f"llvm.insertvalue {st}, {d}[4, {k}] : {dtype}")
    slot = t(f"llvm.alloca {one} x {dtype} : (i64) -> !llvm.ptr")
    t.stmt(f"llvm.store {d}, {slot} : {dtype}, !llvm.ptr")
    return slot


def _sizes(t: _Text, op: OperandABI, args: dict[str, str]) -> list[str]:
    """Each dimension of ``op`` as an i64 value: compiled in, or its C parameter (checked by then)."""
    return [t.i64(s) if s is not None else args[f"{op.name}_d{d}"] for d, s in enumerate(op.shape)]


def _level_sizes(t: _Text, op: OperandABI, args: dict[str, str]) -> list[str]:
    """Each level's size as an i64 value (``Format.level_sizes`` at run time): a dimension, a dimension
    divided by its block (a multiple of it: checked by ``_check_blocks``) or the block itself."""
    fmt = op.format
    assert fmt is not None
    dims = _sizes(t, op, args)
    out = []
    for e in fmt.dim_to_lvl:
        if e.op == "floordiv":
            out.append(t.i64(op.shape[e.dim] // e.factor) if op.shape[e.dim] is not None
                       else t(f"llvm.sdiv {dims[e.dim]}, {t.i64(e.factor)} : i64"))
        else:
            out.append(t.i64(e.factor) if e.op == "mod" else dims[e.dim])
    return out


def _check_blocks(t: _Text, op: OperandABI, args: dict[str, str]) -> None:
    """``SIZE_MISMATCH`` unless each run-time dimension that the format tiles is a multiple of its block
    (N:M columns by ``m``, BSR rows and columns by the block's)."""
    assert op.format is not None
    for d, factor in op.format.block_factors.items():
        if op.shape[d] is None and factor > 1:
            rest = t(f"llvm.srem {args[f'{op.name}_d{d}']}, {t.i64(factor)} : i64")
            t.fail_if(t.ne(rest, t.i64(0)), SIZE_MISMATCH)


def _check_levels(t: _Text, op: OperandABI, args: dict[str, str], sizes: list[str], one: str) -> None:
    """Walk the levels as the kernel will, checking every buffer length against its parent's entries.

    ``args`` maps ``op``'s buffer names (``pos1``, ``pos1_len``...) to values, ``sizes`` are its level sizes.
    """
    fmt = op.format
    assert fmt is not None
    dtypes = dict(op.buffers())
    n = one
    for i, level in enumerate(fmt.levels):
        if level.kind is LevelKind.DENSE:
            n = t(f"llvm.mul {n}, {sizes[i]} : i64")
            continue
        if level.kind is LevelKind.STRUCTURED:
            n = t(f"llvm.mul {n}, {t.i64(level.n)} : i64")
            t.fail_if(t.ne(args[f"crd{i}_len"], n), BAD_LEVELS)
            continue
        if level.has_positions:
            t.fail_if(t.ne(args[f"pos{i}_len"], t(f"llvm.add {n}, {one} : i64")), BAD_LEVELS)
            _check_monotone(t, args[f"pos{i}"], n, dtypes[f"pos{i}"], one)
            n = _load_index(t, args[f"pos{i}"], n, dtypes[f"pos{i}"])
            t.fail_if(t(f'llvm.icmp "slt" {n}, {t.i64(0)} : i64'), BAD_LEVELS)
        t.fail_if(t.ne(args[f"crd{i}_len"], n), BAD_LEVELS)
    t.fail_if(t.ne(args["values_len"], n), BAD_LEVELS)


def _check_monotone(t: _Text, pos: str, n: str, dtype: np.dtype, one: str) -> None:
    """Fail with ``BAD_LEVELS`` unless ``pos[0] == 0`` and ``pos[k] <= pos[k + 1]`` for every ``k < n``.

    With the last position equal to the coordinate count (checked next), this
    keeps every segment the kernel walks inside the coordinate buffer: a
    spike in the middle of an otherwise well-formed position buffer would
    otherwise send it reading far out of bounds.  The loop has no early
    exit, only an or-reduction, and asks to be vectorized (``VECTORIZE``):
    O(rows) at vector width, a small fraction of any kernel that reads
    those rows anyway.
    """
    t.fail_if(t.ne(_load_index(t, pos, t.i64(0), dtype), t.i64(0)), BAD_LEVELS)
    t.blocks += 1
    loop, body, done = f"^mono{t.blocks}", f"^monobody{t.blocks}", f"^monodone{t.blocks}"
    k, bad = f"%mk{t.blocks}", f"%mbad{t.blocks}"
    t.stmt(f"llvm.br {loop}({t.i64(0)}, {t('llvm.mlir.constant(false) : i1')} : i64, i1)")
    t.lines.append(f"{loop}({k}: i64, {bad}: i1):")
    more = t(f'llvm.icmp "slt" {k}, {n} : i64')
    t.stmt(f"llvm.cond_br {more}, {body}, {done}")
    t.lines.append(f"{body}:")
    following = t(f"llvm.add {k}, {one} : i64")
    falls = t(f'llvm.icmp "slt" {_load_index(t, pos, following, dtype)}, {_load_index(t, pos, k, dtype)} : i64')
    t.back_edge(loop, f"{following}, {t(f'llvm.or {bad}, {falls} : i1')} : i64, i1")
    t.lines.append(f"{done}:")
    t.fail_if(bad, BAD_LEVELS)


def _implicit_positions(t: _Text, op: OperandABI, sizes: list[str], zero: str, one: str) -> tuple[str, str]:
    """malloc and fill the positions 0, n, 2n, ... of an N:M level; return (pointer, length).

    ``sizes`` are the operand's level sizes (``_level_sizes``): the groups are all but the last.
    """
    fmt = op.format
    assert fmt is not None
    level = fmt.levels[-1]
    groups = one
    for size in sizes[:-1]:
        groups = t(f"llvm.mul {groups}, {size} : i64")
    width = fmt.pos_width // 8 if fmt.pos_width else 8
    elt = _INT[width]
    length = t(f"llvm.add {groups}, {one} : i64")
    ptr = t(f"llvm.call @malloc({t(f'llvm.mul {length}, {t.i64(width)} : i64')}) : (i64) -> !llvm.ptr")
    t.fail_if(t(f'llvm.icmp "eq" {ptr}, {t("llvm.mlir.zero : !llvm.ptr")} : !llvm.ptr'), NULL_POINTER)
    t.blocks += 1
    loop, body, done = f"^loop{t.blocks}", f"^body{t.blocks}", f"^done{t.blocks}"
    t.stmt(f"llvm.br {loop}({zero} : i64)")
    index = f"%i{t.blocks}"
    t.lines.append(f"{loop}({index}: i64):")
    more = t(f'llvm.icmp "slt" {index}, {length} : i64')
    t.stmt(f"llvm.cond_br {more}, {body}, {done}")
    t.lines.append(f"{body}:")
    value = t(f"llvm.mul {index}, {t.i64(level.n)} : i64")
    if elt != "i64":
        value = t(f"llvm.trunc {value} : i64 to {elt}")
    addr = t(f"llvm.getelementptr {ptr}[{index}] : (!llvm.ptr, i64) -> !llvm.ptr, {elt}")
    t.stmt(f"llvm.store {value}, {addr} : {elt}, !llvm.ptr")
    t.back_edge(loop, f"{t(f'llvm.add {index}, {one} : i64')} : i64")
    t.lines.append(f"{done}:")
    return ptr, length


def wrapper_text(sig: Signature, kernel: str, zero_fill: bool = True) -> str:
    """LLVM-dialect text of ``NAME`` (and ``NAME_free`` for sparse outputs), calling ``kernel``.

    ``zero_fill=False`` is for kernels that store every element of their
    dense output: the memset would be a wasted pass over it.
    """
    params = sig.params()
    t = _Text()
    args = {p.name: f"%a{i}" for i, p in enumerate(params)}
    # noalias: the output never overlaps an input and inputs are only read, which lets LLVM vectorize
    # the kernel's loops without run-time overlap checks once it is inlined here
    header = ", ".join(f"{args[p.name]}: {'i64' if p.ctype == 'int64_t' else '!llvm.ptr {llvm.noalias}'}"
                       for p in params)
    zero, one = t.i64(0), t.i64(1)
    null = t("llvm.mlir.zero : !llvm.ptr")
    # 1. pointers: dense ones always, sparse buffers unless empty
    for p in params:
        if p.kind in ("data", "result"):
            is_null = t(f'llvm.icmp "eq" {args[p.name]}, {null} : !llvm.ptr')
            if p.kind == "data" and p.buffer:  # a sparse buffer may be NULL when empty
                is_null = t(f"llvm.and {is_null}, {t.ne(args[p.name + '_len'], zero)} : i1")
            t.fail_if(is_null, NULL_POINTER)
    # 2. sizes given at run time: none negative, the static ones as compiled, the others equal wherever an index
    # repeats, and a sparse input's a multiple of its format's blocks
    for p in params:
        if p.kind == "dim":
            t.fail_if(t(f'llvm.icmp "slt" {args[p.name]}, {zero} : i64'), SIZE_MISMATCH)
    for static, carriers in sig.extents().values():
        dims = [args[f"{name}_d{d}"] for name, d in carriers]
        reference = t.i64(static) if static is not None else (dims[0] if dims else None)
        for dim in dims:
            if dim != reference:
                t.fail_if(t.ne(dim, reference), SIZE_MISMATCH)
    sparse_inputs = [op for op in sig.inputs if op.sparse]
    for op in sparse_inputs:
        _check_blocks(t, op, args)
    # 3. level buffers of sparse inputs
    level_sizes = {op.name: _level_sizes(t, op, args) for op in sparse_inputs}
    for op in sparse_inputs:
        _check_levels(t, op, {p.buffer + ("_len" if p.kind == "len" else ""): args[p.name]
                              for p in op.params(sig.name) if p.kind != "dim"}, level_sizes[op.name], one)
    # 4. descriptors in the kernel's argument order
    out = sig.output
    if out.sparse:
        _check_result_coordinates(t, sig, args)
    if out.sparse:
        n_results = len(out.format.codegen_format.buffer_names)
        result = t(f"llvm.alloca {one} x !llvm.array<{5 * n_results} x i64> : (i64) -> !llvm.ptr")
    else:
        result = t(f"llvm.alloca {one} x {_descriptor_type(len(out.shape))} : (i64) -> !llvm.ptr")
    slots: list[str] = []
    temporaries: list[str] = []
    for op, buf in sig.kernel_arguments():
        if not op.sparse:
            dims = [args[f"{op.name}_d{d}"] for d in range(len(op.shape))]
            if op.output and zero_fill:
                nbytes = t.i64(op.dtype.itemsize)
                for dim in dims:
                    nbytes = t(f"llvm.mul {nbytes}, {dim} : i64")
                t.stmt(f'"llvm.intr.memset"({args[op.name]}, {t("llvm.mlir.constant(0 : i8) : i8")}, {nbytes}) '
                       f"<{{isVolatile = false}}> : (!llvm.ptr, i8, i64) -> ()")
            slots.append(_descriptor(t, args[op.name], dims, one, zero))
        elif f"{op.name}_{buf}" in args:
            slots.append(_descriptor(t, args[f"{op.name}_{buf}"], [args[f"{op.name}_{buf}_len"]], one, zero))
        else:  # N:M positions
            ptr, length = _implicit_positions(t, op, level_sizes[op.name], zero, one)
            temporaries.append(ptr)
            slots.append(_descriptor(t, ptr, [length], one, zero))
    t.stmt(f"llvm.call @{kernel}({', '.join([result, *slots])}) : ({', '.join(['!llvm.ptr'] * (1 + len(slots)))}) "
           f"-> ()")
    # 5. results
    if out.sparse:
        inputs = [args[p.name] for p in params if p.kind == "data"] + temporaries
        _copy_sparse_result(t, sig, result, args[out.name], inputs)
    for ptr in temporaries:
        t.stmt(f"llvm.call @free({ptr}) : (!llvm.ptr) -> ()")
    if out.sparse:
        _check_result_entries(t, sig, args[out.name])
    if not out.sparse:
        returned = t(f"llvm.load {t(f'llvm.getelementptr {result}[1] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr')} "
                     f": !llvm.ptr -> !llvm.ptr")
        t.fail_if(t(f'llvm.icmp "ne" {returned}, {args[out.name]} : !llvm.ptr'), INTERNAL_ERROR)
    t.stmt(f"llvm.return {t('llvm.mlir.constant(0 : i32) : i32')} : i32")
    body = "\n".join(t.lines + t.failure_blocks())
    text = f"llvm.func @{sig.name}({header}) -> i32 {{\n{body}\n}}\n"
    if out.sparse:
        text += _free_text(sig)
    return text


def _largest(width: int) -> int | None:
    """The largest index a buffer of ``width`` bits holds (signed: see ``dtypes.index_dtype``); ``None``: 64."""
    dtype = index_dtype(width)
    return None if dtype.itemsize == 8 else int(np.iinfo(dtype).max)


def _check_result_coordinates(t: _Text, sig: Signature, args: dict[str, str]) -> None:
    """``RESULT_OVERFLOW`` before the kernel runs when a sparse result's coordinates could not fit its
    coordinate width: a level that stores coordinates over a dimension longer than the width holds would wrap
    them (a silently wrong result)."""
    out = sig.output
    largest = _largest(out.format.crd_width)
    if largest is None:
        return
    extents = sig.extents()
    for e, level in zip(out.format.dim_to_lvl, out.format.levels):
        if level.kind is LevelKind.DENSE:
            continue
        static, carriers = extents[out.index[e.dim]]
        if static is not None:
            size = t.i64(static)
        elif carriers:
            name, d = carriers[0]
            size = args[f"{name}_d{d}"]
        else:
            continue  # sized by nothing at run time: not a shape this signature can take
        t.fail_if(t(f'llvm.icmp "sgt" {size}, {t.i64(largest + 1)} : i64'), RESULT_OVERFLOW)


def _check_result_entries(t: _Text, sig: Signature, target: str) -> None:
    """``RESULT_OVERFLOW`` after the kernel ran when the result has more entries than its position width
    holds (its positions wrapped): the result's buffers are released first, so nothing leaks."""
    largest = _largest(sig.output.format.pos_width)
    if largest is None:
        return
    k = len(sig.result_buffers())
    entries = t(f"llvm.load {t(f'llvm.getelementptr {target}[{2 * (k - 1) + 1}] : (!llvm.ptr) -> !llvm.ptr, i64')} "
                f": !llvm.ptr -> i64")
    t.blocks += 1
    overflow, fits = f"^overflow{t.blocks}", f"^fits{t.blocks}"
    too_many = t(f'llvm.icmp "sgt" {entries}, {t.i64(largest)} : i64')
    t.stmt(f"llvm.cond_br {too_many}, {overflow}, {fits}")
    t.lines.append(f"{overflow}:")
    t.stmt(f"llvm.call @{sig.name}_free({target}) : (!llvm.ptr) -> ()")
    t.stmt(f"llvm.return {t(f'llvm.mlir.constant({RESULT_OVERFLOW} : i32) : i32')} : i32")
    t.lines.append(f"{fits}:")


def _copy_sparse_result(t: _Text, sig: Signature, result: str, target: str, inputs: list[str]) -> None:
    """Result struct: (data, len) per buffer, then the malloc-ed pointers ``NAME_free`` releases.

    The sparsifier may hand back an input buffer as a result buffer (a copy
    ``C = A``, or a COO output's positions): such a buffer is copied, so every
    result is the caller's to keep and to free.
    """
    buffers = sig.result_buffers()
    k = len(buffers)
    for i, (_, dtype) in enumerate(buffers):
        word = lambda w: t(f"llvm.getelementptr {result}[{5 * i + w}] : (!llvm.ptr) -> !llvm.ptr, i64")  # noqa: E731
        allocated = t(f"llvm.load {word(0)} : !llvm.ptr -> !llvm.ptr")
        aligned = t(f"llvm.load {word(1)} : !llvm.ptr -> !llvm.ptr")
        offset = t(f"llvm.load {word(2)} : !llvm.ptr -> i64")
        size = t(f"llvm.load {word(3)} : !llvm.ptr -> i64")
        data = t(f"llvm.getelementptr {aligned}[{offset}] : (!llvm.ptr, i64) -> !llvm.ptr, {_llvm_type(dtype)}")
        aliased = t("llvm.mlir.constant(false) : i1")
        for ptr in inputs:
            same = t(f'llvm.icmp "eq" {allocated}, {ptr} : !llvm.ptr')
            aliased = t(f"llvm.or {aliased}, {same} : i1")
        t.blocks += 1
        copy, keep = f"^copy{t.blocks}", f"^keep{t.blocks}"
        t.stmt(f"llvm.cond_br {aliased}, {copy}, {keep}({allocated}, {data} : !llvm.ptr, !llvm.ptr)")
        t.lines.append(f"{copy}:")
        nbytes = t(f"llvm.mul {size}, {t.i64(dtype.itemsize)} : i64")
        fresh = t(f"llvm.call @malloc({t(f'llvm.add {nbytes}, {t.i64(1)} : i64')}) : (i64) -> !llvm.ptr")
        t.stmt(f'"llvm.intr.memcpy"({fresh}, {data}, {nbytes}) <{{isVolatile = false}}> '
               f": (!llvm.ptr, !llvm.ptr, i64) -> ()")
        t.stmt(f"llvm.br {keep}({fresh}, {fresh} : !llvm.ptr, !llvm.ptr)")
        allocated, data = f"%kept_alloc{t.blocks}", f"%kept_data{t.blocks}"
        t.lines.append(f"{keep}({allocated}: !llvm.ptr, {data}: !llvm.ptr):")
        for slot, value, vtype in ((2 * i, data, "!llvm.ptr"), (2 * i + 1, size, "i64"),
                                   (2 * k + i, allocated, "!llvm.ptr")):
            addr = t(f"llvm.getelementptr {target}[{slot}] : (!llvm.ptr) -> !llvm.ptr, i64")
            t.stmt(f"llvm.store {value}, {addr} : {vtype}, !llvm.ptr")


def _free_text(sig: Signature) -> str:
    k = len(sig.result_buffers())
    lines = [f"llvm.func @{sig.name}_free(%r: !llvm.ptr) {{", "  %null = llvm.mlir.zero : !llvm.ptr",
             "  %isnull = llvm.icmp \"eq\" %r, %null : !llvm.ptr", "  llvm.cond_br %isnull, ^done, ^free",
             "^free:"]
    for i in range(k):
        lines += [f"  %p{i} = llvm.getelementptr %r[{2 * k + i}] : (!llvm.ptr) -> !llvm.ptr, i64",
                  f"  %b{i} = llvm.load %p{i} : !llvm.ptr -> !llvm.ptr",
                  f"  llvm.call @free(%b{i}) : (!llvm.ptr) -> ()",
                  f"  llvm.store %null, %p{i} : !llvm.ptr, !llvm.ptr"]
    lines += ["  llvm.br ^done", "^done:", "  llvm.return", "}"]
    return "\n".join(lines) + "\n"


def add_c_entry_point(module: ir.Module, sig: Signature, kernel: str, zero_fill: bool = True) -> None:
    """Parse the wrapper into ``module`` (an LLVM-dialect module that defines ``kernel``)."""
    n_args = 1 + len(sig.kernel_arguments())
    # declarations make the wrapper verify on its own; the ones the module already has are dropped
    decls = (f"llvm.func @{kernel}({', '.join(['!llvm.ptr'] * n_args)})\n"
             "llvm.func @malloc(i64) -> !llvm.ptr\nllvm.func @free(!llvm.ptr)\n")
    wrapper = ir.Module.parse(decls + wrapper_text(sig, kernel, zero_fill))
    defined = {_symbol(op) for op in module.body.operations}
    for op in list(wrapper.body.operations):
        if _symbol(op) not in defined:
            module.body.append(op.operation)


def _symbol(op: ir.OpView) -> str:
    attrs = op.operation.attributes
    return ir.StringAttr(attrs["sym_name"]).value if "sym_name" in attrs else ""
