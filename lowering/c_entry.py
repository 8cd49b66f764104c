"""Emit the plain C entry point of a kernel (see ``sparse_mlir.abi.c_signature``) in the LLVM dialect.

The lowered module exports ``_mlir_ciface_kernel(result*, descriptor*...)``
whose memref descriptors are an MLIR convention.  This adds ``NAME(...)``
taking raw pointers and sizes: it checks them (status codes instead of wild
memory accesses), zero-fills a dense output, supplies the implicit positions
of N:M operands, builds the descriptors on the stack, calls the kernel, and
copies a sparse result's buffers into the caller's result struct.  It is
plain code over pointers, added after the kernel is lowered, so it is built
straight in the LLVM dialect, with the MLIR bindings' op builders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mlir import ir
from mlir.dialects import llvm

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
from sparse_mlir.errors import FormatError

__all__ = ["add_c_entry_point", "INTERNAL_ERROR"]

INTERNAL_ERROR = 4  # a dense result not written in place: a compiler bug, never a user error

# The wrapper's loops (the position check, the implicit N:M positions) run on one thread before the kernel, on
# every call, and kernels scalar by design are built with LLVM's vectorizers off (``select.CpuChoice``), which
# left them scalar: on METIS mdual (258k rows, 4 nonzeros each) the position check was 15% of a 2-thread SpMV
# (413 us, 355 us vectorized: session 27).  This annotation vectorizes just these loops: LLVM's loop vectorizer
# still takes a loop that asks for it when it is switched off for the rest.
VECTORIZE = "#llvm.loop_annotation<vectorize = <disable = false>>"

# LLVM's ``icmp`` predicates (``LLVM::ICmpPredicate``)
_EQ, _NE, _SLT, _SGT = 0, 1, 2, 4
# a ``getelementptr`` index taken from its dynamic operands rather than its constant ones
_DYNAMIC_INDEX = -(2**31)


def _descriptor_type(rank: int) -> ir.Type:
    if rank == 0:
        return ir.Type.parse("!llvm.struct<(ptr, ptr, i64)>")
    return ir.Type.parse(f"!llvm.struct<(ptr, ptr, i64, array<{rank} x i64>, array<{rank} x i64>)>")


class _Entry:
    """One ``llvm.func`` being built: the block ops go into now, and a block per failure status (returning it),
    made when a check first needs it.  Methods build one op each, at the end of the current block."""

    def __init__(self, func: llvm.LLVMFuncOp, arg_types: Sequence[ir.Type]) -> None:
        self.func = func
        self.block = func.body.blocks.append(*arg_types)
        self.failures: dict[int, ir.Block] = {}
        self.i1, self.i8 = ir.IntegerType.get_signless(1), ir.IntegerType.get_signless(8)
        self.i32, self.i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        self.ptr = llvm.PointerType.get()
        self._none = ir.Attribute.parse("#llvm.overflow<none>")

    @property
    def ip(self) -> ir.InsertionPoint:
        return ir.InsertionPoint(self.block)

    # -- values ---------------------------------------------------------------------------------------------
    def constant(self, value: int, type_: ir.Type | None = None) -> ir.Value:
        type_ = type_ or self.i64
        return llvm.ConstantOp(type_, ir.IntegerAttr.get(type_, value), ip=self.ip).result

    def add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return llvm.add(a, b, self._none, ip=self.ip)

    def mul(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return llvm.mul(a, b, self._none, ip=self.ip)

    def size_mul(self, a: ir.Value, b: ir.Value, code: int = SIZE_MISMATCH) -> ir.Value:
        """``a * b`` of sizes or entry counts, returning ``code`` when it overflows int64 (no buffer is that long;
        the wrapped product had let 2^62 x 8 at 2:4 pass with no coordinates at all)."""
        return self._checked(llvm.intr_smul_with_overflow, a, b, code)

    def size_add(self, a: ir.Value, b: ir.Value, code: int = SIZE_MISMATCH) -> ir.Value:
        """``a + b``, as ``size_mul`` (``rows + 1`` wrapped to INT64_MIN for INT64_MAX rows)."""
        return self._checked(llvm.intr_sadd_with_overflow, a, b, code)

    def _checked(self, op: Any, a: ir.Value, b: ir.Value, code: int) -> ir.Value:
        x, y = _constant_of(a), _constant_of(b)
        if x is not None and y is not None:  # compiled-in sizes: folded (they fit; no status to return for them)
            return self.constant(x * y if op is llvm.intr_smul_with_overflow else x + y)
        pair = op(llvm.StructType.get_literal([self.i64, self.i1]), a, b, ip=self.ip)
        self.fail_if(llvm.extractvalue(self.i1, pair, [1], ip=self.ip), code)
        return llvm.extractvalue(self.i64, pair, [0], ip=self.ip)

    def trunc(self, type_: ir.Type, value: ir.Value) -> ir.Value:
        return llvm.trunc(type_, value, self._none, ip=self.ip)

    def sdiv(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return llvm.sdiv(a, b, ip=self.ip)

    def srem(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return llvm.srem(a, b, ip=self.ip)

    def or_(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return llvm.or_(a, b, ip=self.ip)

    def and_(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return llvm.and_(a, b, ip=self.ip)

    def icmp(self, predicate: int, a: ir.Value, b: ir.Value) -> ir.Value:
        return llvm.icmp(ir.IntegerAttr.get(self.i64, predicate), a, b, ip=self.ip)

    def ne(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.icmp(_NE, a, b)

    def null(self) -> ir.Value:
        return llvm.mlir_zero(self.ptr, ip=self.ip)

    def element(self, base: ir.Value, at: ir.Value | int, element: ir.Type) -> ir.Value:
        """The address of ``base[at]`` for elements of ``element`` (``at`` a value or a constant)."""
        dynamic, raw = ([at], [_DYNAMIC_INDEX]) if isinstance(at, ir.Value) else ([], [at])
        return llvm.getelementptr(self.ptr, base, dynamic, raw, ir.TypeAttr.get(element), None, ip=self.ip)

    def load(self, type_: ir.Type, address: ir.Value) -> ir.Value:
        return llvm.load(type_, address, ip=self.ip)

    def store(self, value: ir.Value, address: ir.Value) -> None:
        llvm.store(value, address, ip=self.ip)

    def alloca(self, type_: ir.Type) -> ir.Value:
        return llvm.alloca(self.ptr, self.constant(1), ir.TypeAttr.get(type_), ip=self.ip)

    def call(self, callee: str, arguments: Sequence[ir.Value], result: ir.Type | None = None) -> ir.Value | None:
        op = llvm.CallOp(result, list(arguments), [], ir.DenseI32ArrayAttr.get([]),
                         callee=ir.FlatSymbolRefAttr.get(callee), ip=self.ip)
        return op.result if result is not None else None

    # -- control flow ---------------------------------------------------------------------------------------
    def new_block(self, *types: ir.Type) -> ir.Block:
        return self.func.body.blocks.append(*types)

    def branch(self, target: ir.Block, arguments: Sequence[ir.Value] = (), vectorize: bool = False) -> None:
        """Branch to ``target``; ``vectorize``: a loop's back edge, marked for LLVM's loop vectorizer."""
        annotation = ir.Attribute.parse(VECTORIZE) if vectorize else None
        llvm.br(list(arguments), target, loop_annotation=annotation, ip=self.ip)

    def branch_if(self, condition: ir.Value, then: ir.Block, otherwise: ir.Block,
                  otherwise_arguments: Sequence[ir.Value] = ()) -> None:
        """Branch to ``then`` when ``condition`` (an ``i1``), else to ``otherwise`` with its arguments."""
        llvm.cond_br(condition, [], list(otherwise_arguments), then, otherwise, ip=self.ip)

    def fail_if(self, bad: ir.Value, code: int) -> None:
        """Return status ``code`` when ``bad`` (an ``i1``); go on in a new block otherwise."""
        ok = self.new_block()
        self.branch_if(bad, self._failure(code), ok)
        self.block = ok

    def _failure(self, code: int) -> ir.Block:
        block = self.failures.get(code)
        if block is None:
            block = self.failures[code] = self.new_block()
            current, self.block = self.block, block
            self.ret(code)
            self.block = current
        return block

    def loop(self, count: ir.Value, carried: Sequence[ir.Value],
             body: Callable[[ir.Value, list[ir.Value]], list[ir.Value]]) -> list[ir.Value]:
        """``for k in 0..count`` carrying ``carried`` (``body(k, values)`` returns the next ones), its back edge
        marked for the vectorizer (``VECTORIZE``); returns the carried values at the end."""
        header = self.new_block(self.i64, *[v.type for v in carried])
        inside, after = self.new_block(), self.new_block()
        self.branch(header, [self.constant(0), *carried])
        self.block = header
        k, values = header.arguments[0], list(header.arguments)[1:]
        self.branch_if(self.icmp(_SLT, k, count), inside, after)
        self.block = inside
        following = self.add(k, self.constant(1))
        self.branch(header, [following, *body(k, values)], vectorize=True)
        self.block = after
        return values

    def ret(self, status: int) -> None:
        llvm.return_(arg=self.constant(status, self.i32), ip=self.ip)


def _constant_of(value: ir.Value) -> int | None:
    """The integer an ``llvm.mlir.constant`` result holds, else ``None``."""
    op = getattr(value.owner, "operation", value.owner)  # an OpView's operation; a block argument's owner: a Block
    if isinstance(op, ir.Operation) and op.name == "llvm.mlir.constant":
        return ir.IntegerAttr(op.attributes["value"]).value
    return None


def _llvm_type(dtype: np.dtype) -> ir.Type:
    return ir.Type.parse(TYPE_NAMES[dtype.name])


def _index_type(dtype: np.dtype) -> ir.Type:
    return ir.IntegerType.get_signless(8 * dtype.itemsize)


def _load_index(e: _Entry, base: ir.Value, at: ir.Value | int, dtype: np.dtype) -> ir.Value:
    """``base[at]`` of an index buffer of ``dtype``, as an ``i64`` (sign-extended)."""
    element = _index_type(dtype)
    value = e.load(element, e.element(base, at, element))
    return value if dtype.itemsize == 8 else llvm.sext(e.i64, value, ip=e.ip)


def _descriptor(e: _Entry, pointer: ir.Value, sizes: list[ir.Value]) -> ir.Value:
    """Store a row-major descriptor for ``pointer`` on the stack; return its address."""
    type_ = _descriptor_type(len(sizes))
    d = llvm.mlir_undef(type_, ip=e.ip)

    def put(value: ir.Value, *position: int) -> ir.Value:
        return llvm.insertvalue(d, value, ir.DenseI64ArrayAttr.get(list(position)), ip=e.ip)

    d = put(pointer, 0)
    d = put(pointer, 1)
    d = put(e.constant(0), 2)
    stride = e.constant(1)
    strides: list[ir.Value] = []
    for size in reversed(sizes):
        strides.insert(0, stride)
        stride = e.mul(stride, size)
    for k, (size, st) in enumerate(zip(sizes, strides)):
        d = put(size, 3, k)
        d = put(st, 4, k)
    slot = e.alloca(type_)
    e.store(d, slot)
    return slot


def _sizes(e: _Entry, op: OperandABI, args: dict[str, ir.Value]) -> list[ir.Value]:
    """Each dimension of ``op`` as an i64 value: compiled in, or its C parameter (checked by then)."""
    return [e.constant(s) if s is not None else args[f"{op.name}_d{d}"] for d, s in enumerate(op.shape)]


def _level_sizes(e: _Entry, op: OperandABI, args: dict[str, ir.Value]) -> list[ir.Value]:
    """Each level's size as an i64 value (``Format.level_sizes`` at run time): a dimension, a dimension
    divided by its block (a multiple of it: checked by ``_check_blocks``) or the block itself."""
    fmt = op.format
    assert fmt is not None
    dims = _sizes(e, op, args)
    out = []
    for x in fmt.dim_to_lvl:
        if x.op == "floordiv":
            out.append(e.constant(op.shape[x.dim] // x.factor) if op.shape[x.dim] is not None
                       else e.sdiv(dims[x.dim], e.constant(x.factor)))
        else:
            out.append(e.constant(x.factor) if x.op == "mod" else dims[x.dim])
    return out


def _check_blocks(e: _Entry, op: OperandABI, args: dict[str, ir.Value]) -> None:
    """``SIZE_MISMATCH`` unless each run-time dimension that the format tiles is a multiple of its block
    (N:M columns by ``m``, BSR rows and columns by the block's)."""
    assert op.format is not None
    for d, factor in op.format.block_factors.items():
        if op.shape[d] is None and factor > 1:
            rest = e.srem(args[f"{op.name}_d{d}"], e.constant(factor))
            e.fail_if(e.ne(rest, e.constant(0)), SIZE_MISMATCH)


def _check_levels(e: _Entry, op: OperandABI, args: dict[str, ir.Value], sizes: list[ir.Value]) -> None:
    """Walk the levels as the kernel will, checking every buffer length against its parent's entries.

    ``args`` maps ``op``'s buffer names (``pos1``, ``pos1_len``...) to values, ``sizes`` are its level sizes.
    """
    fmt = op.format
    assert fmt is not None
    dtypes = dict(op.buffers())
    n = e.constant(1)
    for i, level in enumerate(fmt.levels):
        if level.kind is LevelKind.DENSE:
            n = e.size_mul(n, sizes[i])
            continue
        if level.kind is LevelKind.STRUCTURED:  # n may come from positions: their values are what is wrong
            n = e.size_mul(n, e.constant(level.n), BAD_LEVELS)
            e.fail_if(e.ne(args[f"crd{i}_len"], n), BAD_LEVELS)
            continue
        if level.has_positions:
            e.fail_if(e.ne(args[f"pos{i}_len"], e.size_add(n, e.constant(1), BAD_LEVELS)), BAD_LEVELS)
            _check_monotone(e, args[f"pos{i}"], n, dtypes[f"pos{i}"])
            n = _load_index(e, args[f"pos{i}"], n, dtypes[f"pos{i}"])
            e.fail_if(e.icmp(_SLT, n, e.constant(0)), BAD_LEVELS)
        e.fail_if(e.ne(args[f"crd{i}_len"], n), BAD_LEVELS)
    e.fail_if(e.ne(args["values_len"], n), BAD_LEVELS)


def _check_monotone(e: _Entry, pos: ir.Value, n: ir.Value, dtype: np.dtype) -> None:
    """Fail with ``BAD_LEVELS`` unless ``pos[0] == 0`` and ``pos[k] <= pos[k + 1]`` for every ``k < n``.

    With the last position equal to the coordinate count (checked next), this
    keeps every segment the kernel walks inside the coordinate buffer: a
    spike in the middle of an otherwise well-formed position buffer would
    otherwise send it reading far out of bounds.  The loop has no early
    exit, only an or-reduction, and asks to be vectorized (``VECTORIZE``):
    O(rows) at vector width, a small fraction of any kernel that reads
    those rows anyway.
    """
    e.fail_if(e.ne(_load_index(e, pos, 0, dtype), e.constant(0)), BAD_LEVELS)

    def step(k: ir.Value, carried: list[ir.Value]) -> list[ir.Value]:
        falls = e.icmp(_SLT, _load_index(e, pos, e.add(k, e.constant(1)), dtype), _load_index(e, pos, k, dtype))
        return [e.or_(carried[0], falls)]

    (bad,) = e.loop(n, [e.constant(0, e.i1)], step)
    e.fail_if(bad, BAD_LEVELS)


def _implicit_positions(e: _Entry, op: OperandABI, sizes: list[ir.Value]) -> tuple[ir.Value, ir.Value]:
    """malloc and fill the positions 0, n, 2n, ... of an N:M level; return (pointer, length).

    ``sizes`` are the operand's level sizes (``_level_sizes``): the groups are all but the last.
    """
    fmt = op.format
    assert fmt is not None
    level = fmt.levels[-1]
    groups = e.constant(1)
    for size in sizes[:-1]:
        groups = e.size_mul(groups, size)
    width = fmt.pos_width // 8 if fmt.pos_width else 8
    element = ir.IntegerType.get_signless(8 * width)
    length = e.size_add(groups, e.constant(1))
    pointer = e.call("malloc", [e.size_mul(length, e.constant(width))], e.ptr)
    e.fail_if(e.icmp(_EQ, pointer, e.null()), NULL_POINTER)

    def fill(k: ir.Value, _: list[ir.Value]) -> list[ir.Value]:
        value = e.mul(k, e.constant(level.n))
        if width != 8:
            value = e.trunc(element, value)
        e.store(value, e.element(pointer, k, element))
        return []

    e.loop(length, [], fill)
    return pointer, length


def _largest(width: int) -> int | None:
    """The largest index a buffer of ``width`` bits holds (signed: see ``dtypes.index_dtype``); ``None``: 64."""
    dtype = index_dtype(width)
    return None if dtype.itemsize == 8 else int(np.iinfo(dtype).max)


def _check_result_coordinates(e: _Entry, sig: Signature, args: dict[str, ir.Value]) -> None:
    """``RESULT_OVERFLOW`` before the kernel runs when a sparse result's coordinates could not fit its
    coordinate width: a level that stores coordinates over a dimension longer than the width holds would wrap
    them (a silently wrong result)."""
    out = sig.output
    largest = _largest(out.format.crd_width)
    if largest is None:
        return
    extents = sig.extents()
    for x, level in zip(out.format.dim_to_lvl, out.format.levels):
        if level.kind is LevelKind.DENSE:
            continue
        static, carriers = extents[out.index[x.dim]]
        if static is not None:
            size = e.constant(static)
        elif carriers:
            name, d = carriers[0]
            size = args[f"{name}_d{d}"]
        else:
            continue  # sized by nothing at run time: not a shape this signature can take
        e.fail_if(e.icmp(_SGT, size, e.constant(largest + 1)), RESULT_OVERFLOW)


def _check_result_entries(e: _Entry, sig: Signature, target: ir.Value) -> None:
    """``RESULT_OVERFLOW`` after the kernel ran when the result has more entries than its position width
    holds (its positions wrapped): the result's buffers are released first, so nothing leaks."""
    largest = _largest(sig.output.format.pos_width)
    if largest is None:
        return
    k = len(sig.result_buffers())
    entries = e.load(e.i64, e.element(target, 2 * (k - 1) + 1, e.i64))
    overflow, fits = e.new_block(), e.new_block()
    e.branch_if(e.icmp(_SGT, entries, e.constant(largest)), overflow, fits)
    e.block = overflow
    e.call(f"{sig.name}_free", [target])
    e.ret(RESULT_OVERFLOW)
    e.block = fits


def _copy_sparse_result(e: _Entry, sig: Signature, result: ir.Value, target: ir.Value,
                        inputs: list[ir.Value]) -> None:
    """Result struct: (data, len) per buffer, then the malloc-ed pointers ``NAME_free`` releases.

    The sparsifier may hand back an input buffer as a result buffer (a copy
    ``C = A``, or a COO output's positions): such a buffer is copied, so every
    result is the caller's to keep and to free.
    """
    buffers = sig.result_buffers()
    k = len(buffers)
    for i, (_, dtype) in enumerate(buffers):
        def word(w: int, i: int = i) -> ir.Value:
            return e.element(result, 5 * i + w, e.i64)

        allocated = e.load(e.ptr, word(0))
        aligned = e.load(e.ptr, word(1))
        offset = e.load(e.i64, word(2))
        size = e.load(e.i64, word(3))
        data = e.element(aligned, offset, _llvm_type(dtype))
        aliased = e.constant(0, e.i1)
        for pointer in inputs:
            aliased = e.or_(aliased, e.icmp(_EQ, allocated, pointer))
        copy, keep = e.new_block(), e.new_block(e.ptr, e.ptr)
        e.branch_if(aliased, copy, keep, [allocated, data])
        e.block = copy
        nbytes = e.mul(size, e.constant(dtype.itemsize))
        fresh = e.call("malloc", [e.add(nbytes, e.constant(1))], e.ptr)
        llvm.intr_memcpy(fresh, data, nbytes, False, ip=e.ip)
        e.branch(keep, [fresh, fresh])
        e.block = keep
        allocated, data = keep.arguments[0], keep.arguments[1]
        for slot, value in ((2 * i, data), (2 * i + 1, size), (2 * k + i, allocated)):
            e.store(value, e.element(target, slot, e.i64))


def _add_free(module: ir.Module, sig: Signature) -> None:
    """``NAME_free(result*)``: free each malloc-ed block of a sparse result and clear its pointer."""
    k = len(sig.result_buffers())
    with ir.InsertionPoint(module.body):
        func = llvm.LLVMFuncOp(f"{sig.name}_free", ir.TypeAttr.get(ir.Type.parse("!llvm.func<void (ptr)>")))
    e = _Entry(func, [llvm.PointerType.get()])
    result = e.block.arguments[0]
    free, done = e.new_block(), e.new_block()
    e.branch_if(e.icmp(_EQ, result, e.null()), done, free)
    e.block = free
    for i in range(k):
        slot = e.element(result, 2 * k + i, e.i64)
        e.call("free", [e.load(e.ptr, slot)])
        e.store(e.null(), slot)
    e.branch(done)
    e.block = done
    llvm.return_(ip=e.ip)


def _add_entry(module: ir.Module, sig: Signature, kernel: str, zero_fill: bool, unread: frozenset[int]) -> None:
    """``NAME(...)``, calling ``kernel``.

    ``zero_fill=False`` is for kernels that store every element of their
    dense output: the memset would be a wasted pass over it.  ``unread``
    are the kernel arguments (by position) the kernel never reads: implicit
    N:M positions among them are passed empty, not built.  Building them
    was a ``malloc`` and a fill of a position per group on every call: 16
    MiB for a 4096^2 weight at 2:4 (256 MiB at 16384^2), though no time
    that could be measured there (N=32: 2.80-3.14 ms either way; session 27).
    """
    params = sig.params()
    ptr, i64 = llvm.PointerType.get(), ir.IntegerType.get_signless(64)
    types = [i64 if p.ctype == "int64_t" else ptr for p in params]
    # noalias: the output never overlaps an input and inputs are only read, which lets LLVM vectorize
    # the kernel's loops without run-time overlap checks once it is inlined here
    noalias = ir.DictAttr.get({"llvm.noalias": ir.UnitAttr.get()})
    arg_attrs = ir.ArrayAttr.get([noalias if t == ptr else ir.DictAttr.get({}) for t in types])
    signature = ir.Type.parse(f"!llvm.func<i32 ({', '.join(str(t) for t in types)})>")
    with ir.InsertionPoint(module.body):
        func = llvm.LLVMFuncOp(sig.name, ir.TypeAttr.get(signature), arg_attrs=arg_attrs)
    e = _Entry(func, types)
    args = {p.name: e.block.arguments[i] for i, p in enumerate(params)}
    zero = e.constant(0)
    null = e.null()
    # 1. pointers: dense ones always, sparse buffers unless empty
    for p in params:
        if p.kind in ("data", "result"):
            is_null = e.icmp(_EQ, args[p.name], null)
            if p.kind == "data" and p.buffer:  # a sparse buffer may be NULL when empty
                is_null = e.and_(is_null, e.ne(args[p.name + "_len"], zero))
            e.fail_if(is_null, NULL_POINTER)
    # 2. sizes given at run time: none negative, the static ones as compiled, the others equal wherever an index
    # repeats, and a sparse input's a multiple of its format's blocks
    for p in params:
        if p.kind == "dim":
            e.fail_if(e.icmp(_SLT, args[p.name], zero), SIZE_MISMATCH)
        elif p.kind == "len":  # a negative length matched a wrapped ``rows + 1`` and the walk read past the end
            e.fail_if(e.icmp(_SLT, args[p.name], zero), BAD_LEVELS)
    for static, carriers in sig.extents().values():
        dims = [args[f"{name}_d{d}"] for name, d in carriers]
        reference = e.constant(static) if static is not None else (dims[0] if dims else None)
        for dim in dims:
            if dim != reference:
                e.fail_if(e.ne(dim, reference), SIZE_MISMATCH)
    sparse_inputs = [op for op in sig.inputs if op.sparse]
    for op in sparse_inputs:
        _check_blocks(e, op, args)
    # 3. level buffers of sparse inputs
    level_sizes = {op.name: _level_sizes(e, op, args) for op in sparse_inputs}
    for op in sparse_inputs:
        _check_levels(e, op, {p.buffer + ("_len" if p.kind == "len" else ""): args[p.name]
                              for p in op.params(sig.name) if p.kind != "dim"}, level_sizes[op.name])
    # 4. descriptors in the kernel's argument order
    out = sig.output
    if out.sparse:
        _check_result_coordinates(e, sig, args)
        n_results = len(out.format.codegen_format.buffer_names)
        result = e.alloca(ir.Type.parse(f"!llvm.array<{5 * n_results} x i64>"))
    else:
        result = e.alloca(_descriptor_type(len(out.shape)))
    slots: list[ir.Value] = []
    temporaries: list[ir.Value] = []
    for position, (op, buf) in enumerate(sig.kernel_arguments()):
        if not op.sparse:
            dims = [args[f"{op.name}_d{d}"] for d in range(len(op.shape))]
            if op.output and zero_fill:
                nbytes = e.constant(op.dtype.itemsize)
                for dim in dims:
                    nbytes = e.size_mul(nbytes, dim)
                llvm.intr_memset(args[op.name], e.constant(0, e.i8), nbytes, False, ip=e.ip)
            slots.append(_descriptor(e, args[op.name], dims))
        elif f"{op.name}_{buf}" in args:
            slots.append(_descriptor(e, args[f"{op.name}_{buf}"], [args[f"{op.name}_{buf}_len"]]))
        elif position in unread:  # N:M positions the kernel computes instead
            slots.append(_descriptor(e, null, [zero]))
        else:  # N:M positions
            pointer, length = _implicit_positions(e, op, level_sizes[op.name])
            temporaries.append(pointer)
            slots.append(_descriptor(e, pointer, [length]))
    e.call(kernel, [result, *slots])
    # 5. results
    if out.sparse:
        inputs = [args[p.name] for p in params if p.kind == "data"] + temporaries
        _copy_sparse_result(e, sig, result, args[out.name], inputs)
    for pointer in temporaries:
        e.call("free", [pointer])
    if out.sparse:
        _check_result_entries(e, sig, args[out.name])
    else:
        returned = e.load(ptr, e.element(result, 1, ptr))
        e.fail_if(e.icmp(_NE, returned, args[out.name]), INTERNAL_ERROR)
    e.ret(0)


def add_c_entry_point(module: ir.Module, sig: Signature, kernel: str, zero_fill: bool = True,
                      unread: frozenset[int] = frozenset()) -> None:
    """Add ``NAME`` (and ``NAME_free`` for a sparse output) to ``module``, an LLVM-dialect module that defines
    ``kernel``, declaring ``malloc`` and ``free`` unless it has them.  ``unread``: the positions of the kernel
    arguments it never reads (``lowering.cpu.unread_arguments``)."""
    defined = {_symbol(op) for op in module.body.operations}
    clash = sorted({sig.name, f"{sig.name}_free"} & (defined | {"malloc", "free", kernel}))
    if clash:  # mlir-translate would fail on the redefinition with a page of IR, never naming it
        raise FormatError(f"export name {sig.name!r}: {clash[0]!r} is a function of the kernel's own code; "
                          f"choose another name")
    with ir.Location.unknown(module.context):
        with ir.InsertionPoint(module.body):
            for name, signature in (("malloc", "!llvm.func<ptr (i64)>"), ("free", "!llvm.func<void (ptr)>")):
                if name not in defined:
                    llvm.LLVMFuncOp(name, ir.TypeAttr.get(ir.Type.parse(signature)))
            if kernel not in defined:  # a module with nothing else in it (the IR tests): the kernel declared
                arguments = ", ".join(["ptr"] * (1 + len(sig.kernel_arguments())))
                llvm.LLVMFuncOp(kernel, ir.TypeAttr.get(ir.Type.parse(f"!llvm.func<void ({arguments})>")))
        _add_entry(module, sig, kernel, zero_fill, unread)
        if sig.output.sparse:
            _add_free(module, sig)


def _symbol(op: ir.OpView) -> str:
    attrs = op.operation.attributes
    return ir.StringAttr(attrs["sym_name"]).value if "sym_name" in attrs else ""
