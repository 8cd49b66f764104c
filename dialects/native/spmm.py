"""A register-tiled SpMM, ``C[i,j] = A[i,k] * B[k,j]`` with CSR or N:M ``A``, emitted instead of sparsified.

The sparsifier's SpMM loads and stores the whole C row once per nonzero
(the loop over B's columns is innermost).  Here each row's C is computed in
column tiles kept in vector registers (512-bit where the CPU has AVX-512)
while the row's nonzeros stream by: per nonzero, one vector load of B and
one FMA per register, and C is stored once.  Tiles come in tiers of 8, 2
and 1 registers, so a short N (32 columns) still gets independent FMA
chains, then one masked vector takes the last columns (a single last
column is a scalar loop); in tiles narrower than 8 registers CSR rows take
``CSR_UNROLL`` nonzeros a step into as many accumulator sets, so 8 chains
are in flight (DLMC 2048 x 512 at 90%, one thread: N=16 1.33x, N=32
1.2x).  N:M rows walk their groups with the ``n`` entries unrolled and no
position loads (positions are implicit), in blocks of rows that go through
B panel by panel, so a panel stays in L1 for the whole block
(``_rows_loop``; 1.2-1.3x on 2:4).  CSR rows are not walked that way yet: in a
C model (``benchmarks/models/csr_spmm_panels.c``) blocks of 64 rows walking
B in 64 KiB panels, each row resuming at a cursor, ran DLMC 512^2 at 90%
1.2x faster than whole rows, but the same walk emitted here (an
``scf.while`` stopping at the panel's end) measured no gain (session 24).
Rows (or blocks) run as an ``scf.parallel`` loop, which the CPU pipeline
threads like any other.  The kernel stores every element of C
(``FILLS_OUTPUT``: the C entry point skips zeroing it).  The function has exactly the signature
the sparse assembler would have given (level buffers, then dense memrefs,
returning C), so the C entry point and everything after it are shared with
sparsified kernels; sizes left ``None`` (a shape-generic build) are read
from ``C`` (rows) and ``B`` (columns of A, groups of N:M rows).
``native_spmm`` matches a planned spec; ``spmm_module``
builds the module from a ``SpmmProblem`` (format, sizes, inputs, bias or
epilogue: no spec), which ``native_linear`` also uses for its middle stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mlir import ir
from sparse_mlir.dialects.encoding import TYPE_NAMES
from sparse_mlir.dialects.epilogue import (
    SCALAR_EPILOGUE,
    VECTOR_EPILOGUE,
    Epilogue,
    epilogue_functions,
)
from sparse_mlir.dialects.linalg import FILLS_OUTPUT, KERNEL_NAME
from sparse_mlir.dialects.native.loops import LINE_BYTES, THREAD_COUNT
from sparse_mlir.dialects.native.target import CpuTarget

from sparse_mlir.dsl.patterns import is_csr, spmm_epilogue, spmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import Format

__all__ = ["ACCUMULATORS", "B_ALIGNMENT", "COPY_REUSE", "CSR_UNROLL", "SpmmProblem", "aligned_b", "column_tiers",
           "last_columns", "multiply_add", "native_spmm", "spmm_module"]

ACCUMULATORS = 8  # vector registers of C per column tile: independent FMA chains, half the register file
# N:M rows sharing each panel of B: more rows reuse a panel more, but each row streams its values from its own
# place, and 16-64 rows outran the prefetchers (2:4 at 4096^2, N=32: 8 rows 1.6-1.9 ns per nonzero, 64 rows 2.5)
ROW_BLOCK = 8
# CSR nonzeros a step at most in a tile of fewer than ``ACCUMULATORS`` vectors: a 2-vector tile (N=32 in
# float32) otherwise has two FMA chains, each waiting on the last (DLMC 2048 x 512 at 90%, 1 thread: N=16
# 1.33x, N=32 1.2x, N=64 1.15x; unrolling N:M groups the same way lost 4% at N=32)
CSR_UNROLL = 4
B_ALIGNMENT = LINE_BYTES  # where ``aligned_b`` puts B
COPY_REUSE = 4  # nonzeros of A per row of B at least for B to be copied to that boundary
# ranges of rows ``_work_queue`` cuts per thread: more balance the threads better, each costs an atomic increment
# on a line the threads share
RANGES_PER_THREAD = 16


class _Stream:
    """Text for walking one row's nonzeros: CSR segments, or N:M groups with implicit positions."""

    def __init__(self, fmt: Format, cols: int | None):
        self.nm = fmt.levels[-1] if fmt.is_nm else None
        self.crd_t = f"i{fmt.crd_width or 64}"
        self.pos_t = f"i{fmt.pos_width or 64}"
        # groups per row; None: read at run time from B's rows (a shape-generic build)
        self.groups = (cols // self.nm.m if cols is not None else None) if self.nm else 0

    def setup(self) -> list[str]:
        """Row bounds (CSR) or the row's first entry (N:M), from ``%i``."""
        if self.nm:
            return ["%base = arith.muli %i, %row_len : index"]
        return ["%i1 = arith.addi %i, %c1 : index",
                f"%lo_raw = memref.load %pos[%i] : memref<?x{self.pos_t}>",
                f"%hi_raw = memref.load %pos[%i1] : memref<?x{self.pos_t}>",
                f"%lo = arith.index_castui %lo_raw : {self.pos_t} to index",
                f"%hi = arith.index_castui %hi_raw : {self.pos_t} to index"]

    def loop(self, tag: str, iter_args: str, result_types: str, results: str, update, final: list[str],
             unroll: int = 1, rest_final: list[str] = ()) -> list[str]:
        """``results = for nonzero (k, v) of the row: update(...)``; ``update(k, v, step)`` gives body lines.

        CSR rows with ``unroll`` above 1 take that many nonzeros a step
        (``update`` gets steps ``0..unroll-1``, ``final`` yields after them),
        then the rest one a step (step 0 only, ``rest_final`` yields).  N:M
        rows take a group a step (its ``n`` entries are the steps).
        """
        elt_load = "memref.load %val[{p}] : memref<?x{elt}>"

        def entry(p: str, k: str, v: str) -> list[str]:
            """CSR: the column ``k`` and value ``v`` of the nonzero at position ``p``."""
            return [f"{k}r = memref.load %crd[{p}] : memref<?x{self.crd_t}>",
                    f"{k} = arith.index_castui {k}r : {self.crd_t} to index",
                    f"{v} = {elt_load.format(p=p, elt='{elt}')}"]

        if not self.nm and unroll == 1:
            head = f"{results} = scf.for %p{tag} = %lo to %hi step %c1 iter_args({iter_args}) -> ({result_types}) {{"
            body = [*entry(f"%p{tag}", f"%k{tag}", f"%v{tag}"), *update(f"%k{tag}", f"%v{tag}", 0)]
            return [head, *body, *final, "}"]
        if not self.nm:
            name, count = results.split(":")
            names = [pair.split(" = ")[0] for pair in iter_args.split(", ")]
            head = [f"%{tag}un = arith.constant {unroll} : index", f"%{tag}len = arith.subi %hi, %lo : index",
                    f"%{tag}over = arith.remui %{tag}len, %{tag}un : index",
                    f"%{tag}mid = arith.subi %hi, %{tag}over : index",
                    f"{name}m:{count} = scf.for %p{tag} = %lo to %{tag}mid step %{tag}un iter_args({iter_args}) "
                    f"-> ({result_types}) {{"]
            body = []
            for e in range(unroll):
                body += [f"%p{tag}o{e} = arith.constant {e} : index",
                         f"%p{tag}e{e} = arith.addi %p{tag}, %p{tag}o{e} : index",
                         *entry(f"%p{tag}e{e}", f"%k{tag}e{e}", f"%v{tag}e{e}"),
                         *update(f"%k{tag}e{e}", f"%v{tag}e{e}", e)]
            rest_args = ", ".join(f"{n} = {name}m#{i}" for i, n in enumerate(names))
            rest = [f"{results} = scf.for %p{tag} = %{tag}mid to %hi step %c1 iter_args({rest_args}) "
                    f"-> ({result_types}) {{", *entry(f"%p{tag}", f"%k{tag}", f"%v{tag}"),
                    *update(f"%k{tag}", f"%v{tag}", 0), *rest_final, "}"]
            return [*head, *body, *final, "}", *rest]
        n, m = self.nm.n, self.nm.m
        head = f"{results} = scf.for %g{tag} = %glo to %ghi step %c1 iter_args({iter_args}) -> ({result_types}) {{"
        body = [f"%gn{tag} = arith.muli %g{tag}, %c{n}n : index", f"%gp{tag} = arith.addi %base, %gn{tag} : index",
                f"%gm{tag} = arith.muli %g{tag}, %c{m}m : index"]
        for e in range(n):  # the group's n entries, unrolled: no position loads, no branches
            body += [f"%p{tag}e{e} = arith.addi %gp{tag}, %c{e} : index",
                     f"%or{tag}e{e} = memref.load %crd[%p{tag}e{e}] : memref<?x{self.crd_t}>",
                     f"%o{tag}e{e} = arith.index_castui %or{tag}e{e} : {self.crd_t} to index",
                     f"%k{tag}e{e} = arith.addi %gm{tag}, %o{tag}e{e} : index",
                     f"%v{tag}e{e} = {elt_load.format(p=f'%p{tag}e{e}', elt='{elt}')}"]
            body += update(f"%k{tag}e{e}", f"%v{tag}e{e}", e)
        return [head, *body, *final, "}"]

    def constants(self) -> set[str]:
        if not self.nm:
            return set()
        return {f"%c{self.nm.n}n = arith.constant {self.nm.n} : index",
                f"%c{self.nm.m}m = arith.constant {self.nm.m} : index",
                *(f"%c{e} = arith.constant {e} : index" for e in range(self.nm.n))}

    def sizes(self, b: str) -> list[str]:
        """``%groups`` per row and ``%row_len`` (entries per row), after ``constants``: compiled in, or from
        the rows of B (``b``: A's columns; the C entry point has checked that they are a multiple of ``m``)."""
        if not self.nm:
            return []
        if self.groups is not None:
            return [f"%groups = arith.constant {self.groups} : index",
                    f"%row_len = arith.constant {self.groups * self.nm.n} : index"]
        return [f"%b_rows = memref.dim {b}, %c0 : memref<?x?x{{elt}}>",
                f"%groups = arith.divui %b_rows, %c{self.nm.m}m : index",
                f"%row_len = arith.muli %groups, %c{self.nm.n}n : index"]


def _rest_yield(tag: str, u: int, s: int, sets: int, steps: int) -> str:
    """What register ``u`` of accumulator set ``s`` holds after a remainder step of ``steps`` nonzeros: the
    last of them that went to set ``s``, or the value it came in with when none did."""
    went = [e for e in range(steps) if e % sets == s]
    return f"%{tag}n{u}e{max(went)}" if went else f"%{tag}a{u}s{s}"


def multiply_add(is_float: bool, acc: str, b: str, v: str, out: str, shape: str) -> list[str]:
    """``out = v * b + acc`` of type ``shape`` (a scalar or vector type): one FMA for floats."""
    if is_float:
        return [f"{out} = vector.fma {v}, {b}, {acc} : {shape}" if shape.startswith("vector") else
                f"{out} = math.fma {v}, {b}, {acc} : {shape}"]
    return [f"{out}_m = arith.muli {v}, {b} : {shape}", f"{out} = arith.addi {acc}, {out}_m : {shape}"]


def column_tiers(tiers: list[int], lanes: int, tile_loop: Callable[[str, int, str, str], list[str]]
                 ) -> tuple[list[str], list[str], str]:
    """Column tiles of ``tiers[0]`` vectors, then of each smaller count, each tier starting where the last ended.

    ``tile_loop(tag, count, start, stop)`` emits one tier's loop.  Returns
    the bound computations (before the row loop), the tier loops (inside it)
    and the first column left for scalars.
    """
    bounds, loops, start = [], [], "%c0"
    for t, count in enumerate(tiers):
        bounds += [f"%left{t} = arith.subi %N, {start} : index",
                   f"%over{t} = arith.remui %left{t}, %c{count * lanes} : index",
                   f"%fit{t} = arith.subi %left{t}, %over{t} : index",
                   f"%end{t} = arith.addi {start}, %fit{t} : index"]
        loops += tile_loop(f"t{t}", count, start, f"%end{t}")
        start = f"%end{t}"
    return bounds, loops, start


def last_columns(start: str) -> tuple[list[str], str]:
    """After the column tiers (``start``: the first column they left), the bounds of the masked vector tile:
    it takes the last columns when there are two or more (each walks the row once, where a scalar loop per
    column walked it per column); a single last column stays scalar, from the returned end to ``%N`` (as a
    masked vector it was slower: CSR, N=1, 0.054 ms against 0.039)."""
    return ([f"%m_left = arith.subi %N, {start} : index", "%m_many = arith.cmpi ugt, %m_left, %c1 : index",
             f"%m_end = arith.select %m_many, %N, {start} : index"], "%m_end")


def _rows_loop(stream: _Stream, row_body: list[str], itemsize: int, panel_bytes: int, finish_row: list[str] = (),
               copy_b: str | None = None) -> list[str]:
    """The threaded loop running ``row_body`` for every row ``%i`` (``_work_queue`` hands out the rows).

    CSR: rows one by one.  N:M: blocks of ``ROW_BLOCK`` rows, each walked
    panel by panel (``%glo`` to ``%ghi`` of a row's groups, the ones whose
    rows of B fit in ``panel_bytes``, ``CpuTarget.panel_bytes``), so a panel of B is read from L2 once
    per block instead of once per row; ``%first`` tells the row body
    whether to start from scratch or from the sums stored in C.  Positions
    are implicit, so a panel's bounds need no search.  ``finish_row`` runs
    on each row ``%i`` once its sums are complete (the epilogue): after the
    row (CSR), after the block's last panel (N:M).  ``copy_b``: the element
    type when each thread may copy B to a line boundary (``b_copy``).
    """
    if stream.nm is None:
        return _work_queue(["scf.for %i = %ra to %rb step %c1 {", *row_body, *finish_row, "}"], "%c1", itemsize,
                           copy_b)
    group_bytes = itemsize * stream.nm.m
    setup = [f"%row_block = arith.constant {ROW_BLOCK} : index",
             f"%panel_budget = arith.constant {panel_bytes} : index",
             f"%group_bytes = arith.constant {group_bytes} : index",
             "%b_group = arith.muli %N, %group_bytes : index",  # bytes of B one group of columns reads
             "%b_group1 = arith.maxui %b_group, %c1 : index",
             "%panel_fit = arith.divui %panel_budget, %b_group1 : index",
             "%panel = arith.maxui %panel_fit, %c1 : index",
             # at least one panel, so that rows without groups still store their zeros (or bias)
             (f"%panels_end = arith.constant {max(stream.groups, 1)} : index" if stream.groups is not None
              else "%panels_end = arith.maxui %groups, %c1 : index")]
    blocks = ["scf.for %ib = %ra to %rb step %row_block {",
              "%ib_end = arith.addi %ib, %row_block : index", "%ie = arith.minui %ib_end, %rb : index",
              "scf.for %glo = %c0 to %panels_end step %panel {",
              "%glo_end = arith.addi %glo, %panel : index", "%ghi = arith.minui %glo_end, %groups : index",
              "%first = arith.cmpi eq, %glo, %c0 : index",
              "scf.for %i = %ib to %ie step %c1 {", *row_body, "}",
              "}",
              *(["scf.for %i = %ib to %ie step %c1 {", *finish_row, "}"] if finish_row else []),
              "}"]
    return setup + _work_queue(blocks, "%row_block", itemsize, copy_b)


def _work_queue(rows_lines: list[str], grain: str, itemsize: int, copy_b: str | None) -> list[str]:
    """One parallel iteration per thread, each taking ranges of rows ``[%ra, %rb)`` (multiples of ``grain``
    rows) from a shared counter until none are left, and running ``rows_lines`` on each.

    Why not a parallel loop over the rows: B copied to a line boundary
    (``b_copy``) before such a loop is written by one core and then read
    by the others from that core's cache.  Here each thread copies B for
    itself, so the lines it reads are in its own L2, and skips the copy
    when the other threads have taken every range already.  The ranges are
    handed out as threads come for them (about ``RANGES_PER_THREAD`` per
    thread), so a thread that starts late or runs slowly (a core shared
    with another library's pool) does less, as with a guided schedule.
    """
    copy, free = b_copy(copy_b) if copy_b else ([], [])
    return [f"%threads = func.call @{THREAD_COUNT}() : () -> index",
            *(b_copy_decision(copy_b, itemsize, "%threads") if copy_b else []),
            f"%wq_per = arith.constant {RANGES_PER_THREAD} : index",
            "%wq_ranges_wanted = arith.muli %threads, %wq_per : index",
            "%wq_rows_each = arith.ceildivui %rows, %wq_ranges_wanted : index",
            f"%wq_grains = arith.ceildivui %wq_rows_each, {grain} : index",
            "%wq_grains1 = arith.maxui %wq_grains, %c1 : index",
            f"%wq_size = arith.muli %wq_grains1, {grain} : index",
            "%wq_ranges = arith.ceildivui %rows, %wq_size : index",
            f"%wq_next = memref.alloc() {{alignment = {LINE_BYTES} : i64}} : memref<1xi64>",
            "%wq_zero = arith.constant 0 : i64", "%wq_one = arith.constant 1 : i64",
            "memref.store %wq_zero, %wq_next[%c0] : memref<1xi64>",
            "scf.parallel (%wq_t) = (%c0) to (%threads) step (%c1) {",
            "%wq_first_raw = memref.atomic_rmw addi %wq_one, %wq_next[%c0] : (i64, memref<1xi64>) -> i64",
            "%wq_first = arith.index_castui %wq_first_raw : i64 to index",
            "%wq_any = arith.cmpi ult, %wq_first, %wq_ranges : index",
            "scf.if %wq_any {",
            *copy,
            "%wq_end = scf.while (%wq_u0 = %wq_first) : (index) -> index {",
            "%wq_more = arith.cmpi ult, %wq_u0, %wq_ranges : index",
            "scf.condition(%wq_more) %wq_u0 : index",
            "} do {",
            "^bb0(%wq_u: index):",
            "%ra = arith.muli %wq_u, %wq_size : index",
            "%ra_end = arith.addi %ra, %wq_size : index",
            "%rb = arith.minui %ra_end, %rows : index",
            *rows_lines,
            "%wq_taken_raw = memref.atomic_rmw addi %wq_one, %wq_next[%c0] : (i64, memref<1xi64>) -> i64",
            "%wq_taken = arith.index_castui %wq_taken_raw : i64 to index",
            "scf.yield %wq_taken : index",
            "}",
            *free,
            "}",
            "scf.reduce", "}",
            "memref.dealloc %wq_next : memref<1xi64>"]


def b_copy_decision(elt: str, itemsize: int, copies: str = "%c1") -> list[str]:
    """Lines setting ``%bc_copied``: whether ``%B_in`` is worth copying to a ``B_ALIGNMENT`` boundary, made
    ``copies`` times (once per thread, ``_work_queue``).

    Every nonzero loads whole vectors of a row of B.  When B's rows start
    off a cache-line boundary, each 64-byte load spans two lines and the
    kernel runs at half speed: a DLMC 512^2 pattern at 90%, N=128, float32,
    1 thread, took 0.19 ms with B at 16 or 48 bytes past a line and
    0.093 ms at a line (numpy allocates at 16-byte boundaries).  So B is
    copied (a ``memcpy``, about 7 us for 256 KiB) when it is off the
    boundary, its rows are a whole number of boundaries long (else no copy
    aligns every row) and A has at least ``COPY_REUSE`` nonzeros per row of
    B for each copy (each row of a copy is then read that many times on average).
    """
    return [f"%bc_align = arith.constant {B_ALIGNMENT} : index",
            f"%bc_item = arith.constant {itemsize} : index",
            f"%bc_reuse = arith.constant {COPY_REUSE} : index",
            f"%bc_ptr = memref.extract_aligned_pointer_as_index %B_in : memref<?x?x{elt}> -> index",
            f"%bc_rows = memref.dim %B_in, %c0 : memref<?x?x{elt}>",
            f"%bc_cols = memref.dim %B_in, %c1 : memref<?x?x{elt}>",
            f"%bc_nnz = memref.dim %val, %c0 : memref<?x{elt}>",
            "%bc_off = arith.remui %bc_ptr, %bc_align : index",
            "%bc_row_bytes = arith.muli %bc_cols, %bc_item : index",
            "%bc_row_off = arith.remui %bc_row_bytes, %bc_align : index",
            "%bc_one_copy = arith.muli %bc_rows, %bc_reuse : index",
            f"%bc_reads = arith.muli %bc_one_copy, {copies} : index",
            "%bc_off_line = arith.cmpi ne, %bc_off, %c0 : index",
            "%bc_rows_whole = arith.cmpi eq, %bc_row_off, %c0 : index",
            "%bc_reused = arith.cmpi uge, %bc_nnz, %bc_reads : index",
            "%bc_copy_rows = arith.andi %bc_off_line, %bc_rows_whole : i1",
            "%bc_copied = arith.andi %bc_copy_rows, %bc_reused : i1"]


def b_copy(elt: str) -> tuple[list[str], list[str]]:
    """Lines defining ``%B`` (``%B_in``, or when ``%bc_copied`` a copy of it on a ``B_ALIGNMENT`` boundary), and
    the lines freeing that copy."""
    return [f"%B = scf.if %bc_copied -> (memref<?x?x{elt}>) {{",
            f"%bc_new = memref.alloc(%bc_rows, %bc_cols) {{alignment = {B_ALIGNMENT} : i64}} : memref<?x?x{elt}>",
            f"memref.copy %B_in, %bc_new : memref<?x?x{elt}> to memref<?x?x{elt}>",
            f"scf.yield %bc_new : memref<?x?x{elt}>",
            "} else {",
            f"scf.yield %B_in : memref<?x?x{elt}>",
            "}"], ["scf.if %bc_copied {", f"memref.dealloc %B : memref<?x?x{elt}>", "}"]


def aligned_b(elt: str, itemsize: int) -> tuple[list[str], list[str]]:
    """Lines defining ``%B`` from ``%B_in``, copied once to a line boundary when that pays (``b_copy_decision``),
    and the lines freeing the copy, for the end of the function.  (The BSR SpMM's; the tiled SpMM copies per
    thread.)"""
    prologue, epilogue = b_copy(elt)
    return b_copy_decision(elt, itemsize) + prologue, epilogue


def _epilogue_pass(types: dict[str, str], reads: list[str], vec: str, lanes: int) -> list[str]:
    """Row ``%i`` of C through the epilogue functions, in place: whole vectors, then the scalar tail.

    ``reads`` are the kernel parameters the expression reads, ``types`` every parameter's type.
    """
    extra = "".join(f", {r}" for r in reads)
    extra_types = "".join(f", {types[r]}" for r in reads)
    elt = vec.split("x")[-1].rstrip(">")
    return [f"scf.for %ej = %c0 to %ep_end step %c{lanes} {{",
            f"%ecv = vector.load %C[%i, %ej] : memref<?x?x{elt}>, {vec}",
            f"%eev = func.call @{VECTOR_EPILOGUE}(%ecv, %i, %ej{extra}) : ({vec}, index, index{extra_types}) -> {vec}",
            f"vector.store %eev, %C[%i, %ej] : memref<?x?x{elt}>, {vec}", "}",
            "scf.for %ej = %ep_end to %N step %c1 {",
            f"%ecs = memref.load %C[%i, %ej] : memref<?x?x{elt}>",
            f"%ees = func.call @{SCALAR_EPILOGUE}(%ecs, %i, %ej{extra}) : ({elt}, index, index{extra_types}) -> {elt}",
            f"memref.store %ees, %C[%i, %ej] : memref<?x?x{elt}>", "}"]


@dataclass(frozen=True)
class SpmmProblem:
    """``C[i,j] = A[i,k] * B[k,j]`` (+ a bias, or through an epilogue): what the tiled SpMM needs, no ``KernelSpec``.

    ``inputs`` are the function's inputs in order, each a name and a rank:
    ``a`` becomes A's three level buffers, ``b`` the dense ``B``, ``bias``
    a vector over C's rows (``bias_dim`` 0) or columns (1), and any other
    name a dense operand of ``epilogue`` (which may also read ``b``).
    """

    dtype: np.dtype
    fmt: Format  # A's: CSR or N:M, any index widths
    shape: tuple[int | None, int | None]  # A's rows and columns (None: read at run time from C and B)
    inputs: tuple[tuple[str, int], ...]
    a: str
    b: str
    bias: str | None = None
    bias_dim: int = -1
    epilogue: Epilogue | None = None


def native_spmm(spec: KernelSpec, formats: dict[str, Format], shapes: dict[str, tuple[int | None, ...]],
                target: CpuTarget = CpuTarget(), accumulators: int = ACCUMULATORS) -> ir.Module | None:
    """The tiled SpMM module for ``spec`` in the current context, or ``None`` when it does not apply.

    ``target`` gives the vector register width and the L1 size (``toolchain.cpu_target``).
    """
    found = spmm_operands(spec, formats)
    matched = spmm_epilogue(spec, formats) if found is None else None
    epilogue = None
    if matched is not None:  # an elementwise expression of the sums, applied to each finished row
        found = (matched.a, matched.b, None, -1)
        epilogue = Epilogue(matched.expr, matched.temp, matched.i, matched.j, matched.operands)
    if found is None or not (is_csr(formats[found[0]]) or formats[found[0]].is_nm):
        return None  # BSR has its own emitter (native_bsr)
    a_name, b_name, bias, bias_dim = found
    rows, cols = shapes[a_name]
    problem = SpmmProblem(spec.dtype, formats[a_name], (rows, cols), tuple((n, spec.ranks[n]) for n in spec.inputs),
                          a_name, b_name, bias, bias_dim, epilogue)
    return spmm_module(problem, target, accumulators)


def spmm_module(problem: SpmmProblem, target: CpuTarget = CpuTarget(), accumulators: int = ACCUMULATORS,
                function_name: str = KERNEL_NAME, b_aligned: bool = False) -> ir.Module:
    """The tiled SpMM module of ``problem`` in the current context.

    The function is the kernel (``KERNEL_NAME``: C interface, ``FILLS_OUTPUT``);
    another ``function_name`` makes it a private helper of a larger kernel
    (``native_linear``).  ``b_aligned``: the caller guarantees B starts at a
    ``B_ALIGNMENT`` boundary (its own scratch), so no copy is considered.
    """
    a_name, b_name, bias, bias_dim, epilogue = problem.a, problem.b, problem.bias, problem.bias_dim, problem.epilogue
    ranks = dict(problem.inputs)
    fmt = problem.fmt.codegen_format if problem.fmt.is_nm else problem.fmt
    rows, cols = problem.shape
    stream = _Stream(problem.fmt, cols)
    dtype = np.dtype(problem.dtype)
    elt = TYPE_NAMES[dtype.name]
    lanes = target.vector_bits // 8 // dtype.itemsize  # one vector register
    vec = f"vector<{lanes}x{elt}>"
    is_float = elt.startswith("f")
    zero = "0.0" if is_float else "0"
    level = len(fmt.levels) - 1
    params, types = [], []
    for name, rank in problem.inputs:
        if name == a_name:
            params += ["%pos", "%crd", "%val"]
            types += [f"memref<?x{stream.pos_t}>", f"memref<?x{stream.crd_t}>", f"memref<?x{elt}>"]
        elif name == b_name:
            params.append("%B" if b_aligned else "%B_in")
            types.append(f"memref<?x?x{elt}>")
        elif name == bias:
            params.append("%bias")
            types.append(f"memref<?x{elt}>")
        else:
            assert epilogue is not None and name in epilogue.operands, f"{name} is no operand of the SpMM"
            params.append(f"%e_{name}")
            types.append(f"memref<{'?x' * rank}{elt}>")
    # accumulators start from the bias (or zero)
    if bias is None:
        row_init, scalar_init = [], ([], "%zero")
    elif bias_dim == 0:
        row_init = ["%bias_i = memref.load %bias[%i] : memref<?x{elt}>",
                    f"%bias_v = vector.broadcast %bias_i : {elt} to {vec}"]
        scalar_init = ([], "%bias_i")
    else:
        row_init = []
        scalar_init = (["%bias_j = memref.load %bias[%j] : memref<?x{elt}>"], "%bias_j")
    assert fmt.buffer_names == (f"pos{level}", f"crd{level}", "values"), "one compressed level expected"
    params.append("%C")
    types.append(f"memref<?x?x{elt}>")
    signature = ", ".join(f"{p}: {t}" for p, t in zip(params, types))

    def madd(acc: str, b: str, v: str, out: str, shape: str) -> list[str]:
        return multiply_add(is_float, acc, b, v, out, shape)

    entries = stream.nm.n if stream.nm else 1  # nonzeros per loop iteration
    panels = stream.nm is not None  # N:M rows are walked in panels of groups (``_rows_loop``)

    def tile_block(tag: str, count: int, start: str, stop: str, masked: bool = False) -> list[str]:
        """Column tiles of ``count`` vectors from ``start`` to ``stop``: accumulate in registers, store once.

        The unrolled entries of an N:M group go to ``sets`` separate
        accumulator sets while registers allow, so their FMAs do not wait on
        each other; the sets are added up after the row.  ``masked``: one
        vector over the last columns (fewer than a vector's lanes), every
        load and the store masked to them.
        """
        step = count * lanes
        # CSR rows take several nonzeros a step when the tile is narrow, so that its FMAs go to enough
        # accumulator sets not to wait on each other (N:M groups already unroll their n entries)
        unroll = 1 if panels else max(1, min(CSR_UNROLL, accumulators // count))
        steps = entries * unroll
        sets = max(1, min(steps, accumulators // count))
        mask_type = f"vector<{lanes}xi1>"

        def load(buffer: str, at: str, memref_type: str) -> str:
            if masked:
                return (f"vector.maskedload {buffer}[{at}], %{tag}mask, %zv : {memref_type}, {mask_type}, {vec} "
                        f"into {vec}")
            return f"vector.load {buffer}[{at}] : {memref_type}, {vec}"

        def update(k: str, v: str, e: int) -> list[str]:
            s = e % sets
            prev = (lambda u: f"%{tag}a{u}s{s}") if e < sets else (lambda u: f"%{tag}n{u}e{e - sets}")
            lines = [f"%{tag}vb{e} = vector.broadcast {v} : {elt} to {vec}"]
            for u in range(count):
                lines.append(f"%{tag}b{u}e{e} = " + load("%B", f"{k}, %{tag}j{u}", f"memref<?x?x{elt}>"))
                lines += madd(prev(u), f"%{tag}b{u}e{e}", f"%{tag}vb{e}", f"%{tag}n{u}e{e}", vec)
            return lines

        init = [f"%{tag}bias{u} = " + load("%bias", f"%{tag}j{u}", f"memref<?x{elt}>") for u in range(count)] \
            if bias is not None and bias_dim == 1 else []
        first = {None: lambda u: "%zv", 0: lambda u: "%bias_v"}.get(bias if bias is None else bias_dim,
                                                                     lambda u: f"%{tag}bias{u}")
        start_from = [first(u) for u in range(count)]
        if panels:  # later panels continue from the partial sums stored in C
            tile = ", ".join([vec] * count)
            init = [f"%{tag}st:{count} = scf.if %first -> ({tile}) {{", *init,
                    f"scf.yield {', '.join(start_from)} : {tile}", "} else {",
                    *(f"%{tag}c{u} = " + load("%C", f"%i, %{tag}j{u}", f"memref<?x?x{elt}>") for u in range(count)),
                    f"scf.yield {', '.join(f'%{tag}c{u}' for u in range(count))} : {tile}", "}"]
            start_from = [f"%{tag}st#{u}" for u in range(count)]
        slots = [(u, s) for u in range(count) for s in range(sets)]
        last = {s: max(e for e in range(steps) if e % sets == s) for s in range(sets)}
        vecs = ", ".join([vec] * len(slots))
        loop = stream.loop(tag, ", ".join(f"%{tag}a{u}s{s} = {start_from[u] if s == 0 else '%zv'}" for u, s in slots),
                           vecs, f"%{tag}r:{len(slots)}", update,
                           [f"scf.yield {', '.join(f'%{tag}n{u}e{last[s]}' for u, s in slots)} : {vecs}"], unroll,
                           [f"scf.yield {', '.join(_rest_yield(tag, u, s, sets, entries) for u, s in slots)} : {vecs}"])
        totals = []
        for u in range(count):
            total = f"%{tag}r#{u * sets}"
            for s in range(1, sets):
                totals.append(f"%{tag}sum{u}s{s} = {'arith.addf' if is_float else 'arith.addi'} {total}, "
                              f"%{tag}r#{u * sets + s} : {vec}")
                total = f"%{tag}sum{u}s{s}"
            totals.append(f"vector.maskedstore %C[%i, %{tag}j{u}], %{tag}mask, {total} : memref<?x?x{elt}>, "
                          f"{mask_type}, {vec}" if masked else
                          f"vector.store {total}, %C[%i, %{tag}j{u}] : memref<?x?x{elt}>, {vec}")
        mask = [f"%{tag}left = arith.subi %N, %{tag}jj : index",
                f"%{tag}mask = vector.create_mask %{tag}left : {mask_type}"] if masked else []
        return [f"scf.for %{tag}jj = {start} to {stop} step %c{step} {{",
                *(f"%{tag}j{u} = arith.addi %{tag}jj, %c{u * lanes} : index" for u in range(count)),
                *mask, *init, *loop, *totals, "}"]

    def scalar_update(k: str, v: str, e: int) -> list[str]:
        prev = "%acc" if e == 0 else f"%t{e - 1}"
        return [f"%sb{e} = memref.load %B[{k}, %j] : memref<?x?x{elt}>"] + madd(prev, f"%sb{e}", v, f"%t{e}", elt)

    last = (stream.nm.n - 1) if stream.nm else 0
    scalar_lines, scalar_start = scalar_init
    if panels:
        scalar_lines = ["%sst = scf.if %first -> ({elt}) {", *scalar_lines, f"scf.yield {scalar_start} : {elt}",
                        "} else {", "%sc = memref.load %C[%i, %j] : memref<?x?x{elt}>", "scf.yield %sc : {elt}", "}"]
        scalar_start = "%sst"
    scalar_loop = stream.loop("s", f"%acc = {scalar_start}", elt, "%s", scalar_update,
                              [f"scf.yield %t{last} : {elt}"])
    # column tiers: tiles of `accumulators` vectors, then of 2, then of 1 (a short N still gets independent
    # FMA chains); each tier starts where the previous one ended
    tiers = sorted({accumulators, 2, 1}, reverse=True)
    tier_lines, tier_loops, start = column_tiers(tiers, lanes, tile_block)
    # the last columns (fewer than a vector's lanes) as one masked vector; column by column, each walked the
    # row's nonzeros again (CSR 1536 x 384 at 10%, N=8: 0.25 ms, 2x scipy's time; N=16: 0.045)
    bounds, masked_end = last_columns(start)
    tier_lines += bounds
    tier_loops += tile_block("tm", 1, start, masked_end, masked=True)
    tier_loops += [f"scf.for %j = {masked_end} to %N step %c1 {{", *scalar_lines, *scalar_loop,
                   f"memref.store %s, %C[%i, %j] : memref<?x?x{elt}>", "}"]
    finish_row, helpers = [], ""
    if epilogue is not None:
        reads = {name: ranks[name] for name in epilogue.operands}
        helpers = epilogue_functions(epilogue.expr, epilogue.temp, epilogue.i, epilogue.j, reads, elt, lanes)
        finish_row = _epilogue_pass({**dict(zip(params, types)), "%B": f"memref<?x?x{elt}>"}, ["%B" if r == b_name else f"%e_{r}" for r in reads],
                                    vec, lanes)
    offsets = sorted({0, 1, *(u * lanes for u in range(accumulators + 1)), *(c * lanes for c in tiers)})
    consts = sorted({f"%c{c} = arith.constant {c} : index" for c in offsets} | stream.constants())
    lines = ["module {",
             f"func.func {'' if function_name == KERNEL_NAME else 'private '}@{function_name}({signature}) "
             f"-> memref<?x?x{elt}> "
             + (f"attributes {{llvm.emit_c_interface, {FILLS_OUTPUT}}} {{" if function_name == KERNEL_NAME else "{"),
             *consts,
             (f"%rows = arith.constant {rows} : index" if rows is not None
              else f"%rows = memref.dim %C, %c0 : memref<?x?x{elt}>"),
             *stream.sizes("%B" if b_aligned else "%B_in"),
             f"%N = memref.dim %C, %c1 : memref<?x?x{elt}>",
             *tier_lines,
             f"%zero = arith.constant {zero} : {elt}",
             f"%zv = arith.constant dense<{zero}> : {vec}",
             f"%ep_over = arith.remui %N, %c{lanes} : index", "%ep_end = arith.subi %N, %ep_over : index",
             *_rows_loop(stream, [*stream.setup(), *row_init, *tier_loops],
                         dtype.itemsize, target.panel_bytes, finish_row, None if b_aligned else elt),
             f"return %C : memref<?x?x{elt}>",
             "}", f"func.func private @{THREAD_COUNT}() -> index", helpers, "}"]
    text = "\n".join(lines).replace("{elt}", elt)
    module = ir.Module.parse(text)
    module.operation.verify()
    return module
