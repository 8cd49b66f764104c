"""Which hand-scheduled kernels apply: pattern matching on planned kernels.

The CPU and GPU emitters (``dialects.native.*``, chosen by ``dialects.select``)
take over from the sparsifier only for these shapes of ``KernelSpec``; each
matcher returns the operand names the emitter needs, or ``None``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from sparse_mlir.dsl.ast import Access, Binary, Call, Expr, Literal, Unary
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.formats import BSR, COO, CSC, CSF, CSR, DCSR, Format, LevelKind

__all__ = ["is_csr", "bsr_blocks", "spmv_operands", "spmm_operands", "linear_operands", "dense_matmul_operands",
           "spmm_epilogue", "linear_epilogue", "Mlp", "mlp_operands", "Sddmm", "sddmm_operands", "gpu_sddmm_operands",
           "spgemm_operands", "sparse_sum_operands",
           "SparseSum", "sparse_product_operands", "threads_sparse_output", "format_kind", "product_operands", "scatters",
           "total_reduction_operands", "fiber_operands", "unscaled"]


def is_csr(fmt: Format | None) -> bool:
    """CSR with any index widths."""
    return fmt is not None and fmt.with_widths(32, 32) == CSR


def bsr_blocks(fmt: Format | None) -> tuple[int, int] | None:
    """``(rows, cols)`` of a block when ``fmt`` is BSR (any index widths), else ``None``."""
    factors = fmt.block_factors if fmt is not None else {}
    if set(factors) != {0, 1}:
        return None
    blocks = (factors[0], factors[1])
    return blocks if fmt.with_widths(32, 32) == BSR(*blocks).with_widths(32, 32) else None


def unscaled(spec: KernelSpec) -> tuple[KernelSpec, float | int]:
    """A one-stage kernel whose body is a product of one or two accesses and numeric literals (``2 * A[i,k] *
    B[k,j]``, ``-(A[i,j] * x[j])``, ``0.5 * A[i,j]``) as the same kernel without the literals, and their
    product; any other kernel as it is, and 1.

    The CPU's hand-scheduled SpMV and SpMM match the product and scale each
    finished sum (one multiply a row or a vector of the result, not one a
    nonzero).  (The planner refuses float literals in integer kernels; an
    integer product outside the dtype's range stays with the sparsifier.)
    """
    if len(spec.stages) != 1:
        return spec, 1
    stage = spec.stages[0]
    accesses: list[Access] = []
    factor: float | int = 1
    literals = 0

    def walk(node: Expr) -> bool:
        nonlocal factor, literals
        if isinstance(node, Access):
            accesses.append(node)
            return True
        if isinstance(node, Literal):
            factor, literals = factor * node.value, literals + 1
            return True
        if isinstance(node, Unary) and node.op == "-":
            factor, literals = -factor, literals + 1
            return walk(node.operand)
        return isinstance(node, Binary) and node.op == "*" and walk(node.lhs) and walk(node.rhs)

    if not walk(stage.body) or not literals or len(accesses) not in (1, 2) or \
            (spec.dtype.kind != "f" and not np.iinfo(spec.dtype).min <= factor <= np.iinfo(spec.dtype).max):
        return spec, 1
    body = accesses[0] if len(accesses) == 1 else Binary("*", accesses[0], accesses[1])
    return replace(spec, stages=(replace(stage, body=body),)), factor


def spmv_operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str] | None:
    """``(sparse A, dense x)`` when the kernel is ``y[i] = A[i,j] * x[j]`` with CSR ``A``."""
    if spec.sparse_output or len(spec.stages) != 1:
        return None
    stage = spec.stages[0]
    body = stage.body
    if len(stage.reduce) != 1 or len(stage.indices) != 1 or not isinstance(body, Binary) or body.op != "*":
        return None
    (j,), (i,) = stage.reduce, stage.indices
    for a, x in ((body.lhs, body.rhs), (body.rhs, body.lhs)):
        if isinstance(a, Access) and isinstance(x, Access) and is_csr(formats.get(a.tensor)) \
                and x.tensor not in formats and a.index == (i, j) and x.index == (j,):
            return a.tensor, x.tensor
    return None


def spmm_operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str, str | None, int] | None:
    """``(sparse A, dense B, bias, bias dim)`` when the kernel is a CSR, N:M or BSR SpMM with a dense result.

    Also matched: the SpMM plus a bias over the rows or the columns
    (``C[i,j] = A[i,k] * B[k,j] + bias[i]``), which the planner splits into a
    sum stage and an add stage; the bias then seeds the accumulators.
    """
    if spec.sparse_output or len(spec.stages) not in (1, 2):
        return None
    stage = spec.stages[0]
    body = stage.body
    if len(stage.reduce) != 1 or len(stage.indices) != 2 or not isinstance(body, Binary) or body.op != "*":
        return None
    if not (isinstance(body.lhs, Access) and isinstance(body.rhs, Access)) or body.lhs.tensor == body.rhs.tensor:
        return None
    (k,), (i, j) = stage.reduce, stage.indices
    bias, bias_dim = None, -1
    if len(spec.stages) == 2:
        add = spec.stages[1].body
        if spec.stages[1].reduce or spec.stages[1].indices != (i, j) or not isinstance(add, Binary) or add.op != "+":
            return None
        terms = {(t.tensor, t.index) for t in (add.lhs, add.rhs) if isinstance(t, Access)}
        if len(terms) != 2 or (stage.result, (i, j)) not in terms:
            return None
        ((bias, index),) = terms - {(stage.result, (i, j))}
        if bias in formats or index not in ((i,), (j,)):
            return None
        bias_dim = (i, j).index(index[0])
    for a, b in ((body.lhs, body.rhs), (body.rhs, body.lhs)):
        fmt = formats.get(a.tensor)
        if fmt is not None and (is_csr(fmt) or fmt.is_nm or bsr_blocks(fmt)) and b.tensor not in formats \
                and a.index == (i, k) and b.index == (k, j) and spec.output_indices == (i, j):
            return a.tensor, b.tensor, bias, bias_dim
    return None


def _elementwise_operands(node: Expr, temp: Access, indices: tuple[tuple[str, ...], ...],
                          formats: dict[str, Format]) -> tuple[str, ...] | None:
    """The dense tensors ``node`` reads besides ``temp`` (in order of appearance), when ``node`` is an
    elementwise expression of ``temp`` (read at ``temp.index`` only, at least once) and of dense tensors indexed
    by one of ``indices``; else ``None``.  What an epilogue may compute from a product's sums."""
    operands: dict[str, None] = {}

    def allowed(part: Expr) -> bool:
        if isinstance(part, Access):
            if part.tensor == temp.tensor:
                return part.index == temp.index
            if part.tensor in formats or part.index not in indices:
                return False
            operands[part.tensor] = None
            return True
        return isinstance(part, (Literal, Unary, Binary, Call)) and all(allowed(c) for c in part.children())

    if not allowed(node) or temp.tensor not in _tensors(node):
        return None
    return tuple(operands)


def _plus_bias(term: Expr, temp: Access, indices: tuple[tuple[str, ...], ...], formats: dict[str, Format]
               ) -> tuple[str | None, str | None] | None:
    """``(bias, its index)`` when ``term`` is ``temp`` plus one dense vector indexed by one of ``indices``,
    ``(None, None)`` when it is ``temp`` alone, else ``None``."""
    def is_temp(node: Expr) -> bool:  # by name and index (an access also records where it was written)
        return isinstance(node, Access) and (node.tensor, node.index) == (temp.tensor, temp.index)

    if isinstance(term, Binary) and term.op == "+":
        sides = [side for side in (term.lhs, term.rhs) if isinstance(side, Access)]
        others = [side for side in sides if side.tensor != temp.tensor]
        if len(sides) != 2 or len(others) != 1 or others[0].tensor in formats or others[0].index not in indices:
            return None
        return (others[0].tensor, others[0].index[0]) if any(is_temp(side) for side in sides) else None
    return (None, None) if is_temp(term) else None


def _peel_residual(body: Expr, temp: str, rows: tuple[str, str], formats: dict[str, Format]
                   ) -> tuple[Expr, str | None]:
    """``body`` without one ``+ R[b,o]`` term of its top-level sum (a dense operand indexed like the output,
    ``rows``: a residual connection), and ``R``'s name; ``body`` and ``None`` when it has none.  The Linear
    kernels add ``R`` while they write ``Y``, after the rest of the sum (floating-point sums in another order)."""
    terms = _sum_terms(body)
    found = [t for t in terms if isinstance(t, Access) and t.index == rows and t.tensor not in formats
             and t.tensor != temp]
    if len(found) != 1 or len(terms) < 2:
        return body, None
    rest = [t for t in terms if t is not found[0]]
    if temp not in set().union(*(_tensors(t) for t in rest)):
        return body, None
    total = rest[0]
    for term in rest[1:]:
        total = Binary("+", total, term)
    return total, found[0].tensor


def _sum_terms(node: Expr) -> list[Expr]:
    """The terms of ``node``'s top-level chain of ``+``, in order (``node`` alone when it is no sum)."""
    if isinstance(node, Binary) and node.op == "+":
        return _sum_terms(node.lhs) + _sum_terms(node.rhs)
    return [node]


def linear_operands(spec: KernelSpec, formats: dict[str, Format], residual: bool = False
                    ) -> dict[str, str | None] | None:
    """The roles of a Linear layer ``Y[b,o] = X[b,i] * W[o,i] (+ bias[o] or bias[b])`` with CSR or N:M ``W``.

    The planner lays it out as three stages (``plan._contiguous_layouts``):
    ``XT[i,b] = X[b,i]``, the SpMM ``T[o,b] = XT[i,b] * W[o,i]`` and
    ``Y[b,o] = T[o,b] (+ bias)``.  Returns the names of ``x``, ``xt``, ``w``,
    ``t``, ``bias`` (or ``None``), the indices ``b``, ``o``, ``i`` and the
    bias index ``bias_index``.  ``residual``: also take a last ``+ R[b,o]``
    (the CPU kernel adds it while writing ``Y``; its name under
    ``"residual"``, else ``None``).
    """
    found = _linear_core(spec, formats)
    if found is None:
        return None
    roles, back = found
    o, b = roles["o"], roles["b"]
    term, added = _peel_residual(back.body, roles["t"], (b, o), formats) if residual else (back.body, None)
    found_bias = _plus_bias(term, Access(roles["t"], (o, b)), ((o,), (b,)), formats)
    if found_bias is None:
        return None
    bias, bias_index = found_bias
    return {**roles, "bias": bias, "bias_index": bias_index, "residual": added}


def linear_epilogue(spec: KernelSpec, formats: dict[str, Format], residual: bool = False
                    ) -> tuple[dict[str, str | None], Expr, tuple[str, ...]] | None:
    """A Linear layer whose result goes through an elementwise expression: ``Y[b,o] = relu(X@W^T + bias[o])``.

    Returns the roles (as ``linear_operands``, without a bias), the third
    stage's expression (reading ``t[o,b]``) and the dense tensors it reads,
    each indexed ``(o,)`` or ``(b,)``; ``None`` when the layer has no such
    epilogue (``linear_operands`` takes plain layers and a bias).  ``residual``
    as for ``linear_operands``: a last ``+ R[b,o]`` is added after the
    expression.
    """
    if linear_operands(spec, formats, residual) is not None:
        return None
    found = _linear_core(spec, formats)
    if found is None:
        return None
    roles, back = found
    body, added = (_peel_residual(back.body, roles["t"], (roles["b"], roles["o"]), formats) if residual
                   else (back.body, None))
    operands = _elementwise_operands(body, Access(roles["t"], (roles["o"], roles["b"])),
                                     ((roles["o"],), (roles["b"],)), formats)
    if operands is None:
        return None
    return {**roles, "residual": added}, body, operands


class Mlp(NamedTuple):
    """Two Linear layers in a chain: ``Y[b,p] = W2[p,o] * f(X[b,i] * W1[o,i], ...) (+ bias[p])``.

    The planner lays it out in four stages: ``xt[i,b] = X[b,i]``, the first
    SpMM ``t0[o,b] = W1[o,i] * xt[i,b]``, the second ``t1[p,b] = W2[p,o] *
    middle`` (``middle``: an elementwise expression of ``t0[o,b]`` and of
    dense vectors over ``o``, ``operands``) and ``Y[b,p] = t1[p,b]`` (+
    ``bias[p]``).  ``W1`` and ``W2`` are CSR or N:M.
    """

    x: str
    w1: str
    w2: str
    t0: str
    middle: Expr
    operands: tuple[str, ...]
    bias: str | None
    b: str
    i: str
    o: str
    p: str
    residual: str | None = None  # a dense ``R[b,p]`` added to ``Y`` (a residual connection)


def mlp_operands(spec: KernelSpec, formats: dict[str, Format]) -> Mlp | None:
    """The roles of a two-layer MLP (``Mlp``) with CSR or N:M weights, or ``None``."""
    if spec.sparse_output or len(spec.stages) != 4:
        return None
    transpose, first, second, back = spec.stages
    roles = _first_layer(transpose, first, formats)
    if roles is None:
        return None
    b, o, i, t0 = roles["b"], roles["o"], roles["i"], roles["t"]
    if len(second.indices) != 2 or second.indices[1] != b or second.reduce != (o,) or second.indices[0] in (b, o, i):
        return None
    p = second.indices[0]
    body = second.body
    if not isinstance(body, Binary) or body.op != "*":
        return None
    weights = [side for side in (body.lhs, body.rhs) if isinstance(side, Access) and side.index == (p, o)
               and side.tensor in formats and (is_csr(formats[side.tensor]) or formats[side.tensor].is_nm)]
    if len(weights) != 1 or weights[0].tensor == roles["w"]:
        return None
    w2 = weights[0].tensor
    middle = body.rhs if body.lhs is weights[0] else body.lhs
    operands = _elementwise_operands(middle, Access(t0, (o, b)), ((o,),), formats)
    if operands is None:
        return None
    if back.result != spec.output or back.indices != (b, p) or back.reduce:
        return None
    term, residual = _peel_residual(back.body, second.result, (b, p), formats)
    found_bias = _plus_bias(term, Access(second.result, (p, b)), ((p,),), formats)
    if found_bias is None:
        return None
    bias = found_bias[0]
    return Mlp(roles["x"], roles["w"], w2, t0, middle, operands, bias, b, i, o, p, residual)


def _linear_core(spec: KernelSpec, formats: dict[str, Format]) -> tuple[dict[str, str], Any] | None:
    """The transpose and SpMM stages of a Linear layer: roles ``x``, ``xt``, ``w``, ``t``, ``b``, ``o``, ``i`` and the
    third stage (``Y[b,o] = ...`` of ``t[o,b]``), not yet checked."""
    if spec.sparse_output or len(spec.stages) != 3:
        return None
    transpose, product, back = spec.stages
    roles = _first_layer(transpose, product, formats)
    if roles is None or back.result != spec.output or back.indices != (roles["b"], roles["o"]) or back.reduce:
        return None
    return roles, back


def _first_layer(transpose: Any, product: Any, formats: dict[str, Format]) -> dict[str, str] | None:
    """``xt[i,b] = X[b,i]`` then ``t[o,b] = W[o,i] * xt[i,b]`` with CSR or N:M ``W``: the roles ``x``, ``xt``,
    ``w``, ``t``, ``b``, ``o``, ``i``, or ``None``."""
    if transpose.reduce or not isinstance(transpose.body, Access) or transpose.body.tensor in formats:
        return None
    (i, b), x = transpose.indices, transpose.body
    if x.index != (b, i) or len(product.reduce) != 1 or product.reduce != (i,) or len(product.indices) != 2:
        return None
    o = product.indices[0]
    body = product.body
    if product.indices != (o, b) or not isinstance(body, Binary) or body.op != "*":
        return None
    factors = {(f.tensor, f.index) for f in (body.lhs, body.rhs) if isinstance(f, Access)}
    w = next((t for t, index in factors if index == (o, i) and t in formats
              and (is_csr(formats[t]) or formats[t].is_nm)), None)
    if w is None or factors != {(transpose.result, (i, b)), (w, (o, i))}:
        return None
    return {"x": x.tensor, "xt": transpose.result, "w": w, "t": product.result, "b": b, "o": o, "i": i}


def dense_matmul_operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str] | None:
    """``(A, B)`` when the kernel is ``C[i,j] = A[i,k] * B[k,j]`` with every operand dense."""
    if formats or len(spec.stages) != 1:
        return None
    stage = spec.stages[0]
    body = stage.body
    if len(stage.reduce) != 1 or len(stage.indices) != 2 or not isinstance(body, Binary) or body.op != "*":
        return None
    (k,), (i, j) = stage.reduce, stage.indices
    a, b = body.lhs, body.rhs
    if isinstance(a, Access) and isinstance(b, Access) and a.index == (i, k) and b.index == (k, j) \
            and a.tensor != b.tensor and spec.output_indices == (i, j):
        return a.tensor, b.tensor
    return None


class SpmmEpilogue(NamedTuple):
    """A SpMM followed by an elementwise expression of its result: ``C[i,j] = f(sum_k A[i,k] B[k,j], ...)``.

    ``expr`` reads the product as ``temp[i,j]``; ``operands`` are the other
    dense tensors it reads, each indexed ``(i,)``, ``(j,)`` or ``(i,j)``.
    """

    a: str
    b: str
    expr: Expr
    temp: str
    i: str
    j: str
    operands: tuple[str, ...]


def spmm_epilogue(spec: KernelSpec, formats: dict[str, Format]) -> SpmmEpilogue | None:
    """The CSR/N:M SpMM of a two-stage kernel whose second stage is elementwise over its result, or ``None``.

    ``relu(A[i,k]*B[k,j] + bias[j])``, ``exp(A@B) * 2.0``, ``max(A@B, D[i,j])``:
    the register-tiled SpMM applies the expression to the finished sums
    instead of writing a temporary for a second loop nest.  Also a one-stage
    ``2 * A[i,k] * B[k,j]`` (``unscaled``): the sums times 2.
    """
    if spec.sparse_output or spmm_operands(spec, formats) is not None:
        return None
    core, factor = unscaled(spec)
    if core is not spec:  # ``2 * A[i,k] * B[k,j]``: the product's sums times the literals
        found = spmm_operands(core, formats)
        if found is None or found[2] is not None or not (is_csr(formats[found[0]]) or formats[found[0]].is_nm):
            return None
        i, j = core.stages[0].indices
        scale = Binary("*", Access(spec.output, (i, j)), Literal(factor, repr(factor)))
        return SpmmEpilogue(found[0], found[1], scale, spec.output, i, j, ())
    if len(spec.stages) != 2:
        return None
    product, after = spec.stages
    single = replace(spec, stages=(replace(product, result=spec.output),))
    found = spmm_operands(single, formats)
    if found is None or not (is_csr(formats[found[0]]) or formats[found[0]].is_nm) or after.reduce:
        return None
    i, j = product.indices
    if after.indices != (i, j) or after.result != spec.output:
        return None
    operands = _elementwise_operands(after.body, Access(product.result, (i, j)), ((i,), (j,), (i, j)), formats)
    if operands is None:
        return None
    return SpmmEpilogue(found[0], found[1], after.body, product.result, i, j, operands)


def _tensors(node: Expr) -> set[str]:
    if isinstance(node, Access):
        return {node.tensor}
    return set().union(*(_tensors(c) for c in node.children())) if node.children() else set()


class Sddmm(NamedTuple):
    """The operands of an SDDMM ``C[i,j] = S[i,j] * A[i,k] * B[k,j]``.  ``b_transposed``: ``B`` is indexed
    ``B[j,k]`` (attention's ``Q K^T`` with ``K`` as stored), so its rows already hold the columns each dot product
    reads and no transpose is needed."""

    s: str
    a: str
    b: str
    b_transposed: bool = False


def sddmm_operands(spec: KernelSpec, formats: dict[str, Format]) -> Sddmm | None:
    """The SDDMM's operands when the kernel is ``C[i,j] = S[i,j] * A[i,k] * B[k,j]`` or ``... * B[j,k]`` (factors
    in any order) with CSR ``S`` and a CSR ``C`` of the same index widths; ``None`` otherwise."""
    found = _sparse_contraction(spec)
    if found is None or len(found[3]) != 3:
        return None
    i, j, k, factors = found
    roles: dict[str, str] = {}
    transposed = False
    for f in factors:
        if f.index == (i, j) and f.tensor in formats:
            roles["s"] = f.tensor
        elif f.index == (i, k) and f.tensor not in formats:
            roles["a"] = f.tensor
        elif f.index in ((k, j), (j, k)) and f.tensor not in formats:
            roles["b"], transposed = f.tensor, f.index == (j, k)
    if len(roles) != 3 or len({roles["s"], roles["a"], roles["b"]}) != 3:
        return None
    s_fmt, c_fmt = formats[roles["s"]], formats[spec.output]
    if not (is_csr(s_fmt) and is_csr(c_fmt)) or (s_fmt.pos_width, s_fmt.crd_width) != (c_fmt.pos_width,
                                                                                      c_fmt.crd_width):
        return None
    return Sddmm(roles["s"], roles["a"], roles["b"], transposed)


def gpu_sddmm_operands(spec: KernelSpec, formats: dict[str, Format]) -> Sddmm | None:
    """``sddmm_operands`` for the GPU SDDMM: float kernels with ``B[k,j]`` (it transposes ``B`` itself)."""
    found = sddmm_operands(spec, formats)
    return found if found is not None and spec.dtype.kind == "f" and not found.b_transposed else None


def _sparse_contraction(spec: KernelSpec) -> tuple[str, str, str, list[Access]] | None:
    """``(i, j, k, factors)`` when the kernel is one product summed over ``k`` into a sparse ``C[i,j]``."""
    if not spec.sparse_output or len(spec.stages) != 1:
        return None
    stage = spec.stages[0]
    if len(stage.reduce) != 1 or len(stage.indices) != 2 or stage.indices != spec.output_indices:
        return None
    factors = _product_factors(stage.body)
    if factors is None:
        return None
    (k,), (i, j) = stage.reduce, stage.indices
    return i, j, k, factors


def _product_factors(node) -> list[Access] | None:
    if isinstance(node, Access):
        return [node]
    if isinstance(node, Binary) and node.op == "*":
        left, right = _product_factors(node.lhs), _product_factors(node.rhs)
        return None if left is None or right is None else left + right
    return None


def spgemm_operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str] | None:
    """``(A, B)`` when the kernel is ``C[i,j] = A[i,k] * B[k,j]`` (factors in either order) with CSR ``A``, ``B``
    and ``C``, each with any index widths; ``A`` and ``B`` may be one tensor (``A[i,k] * A[k,j]``)."""
    found = _sparse_contraction(spec)
    if found is None or len(found[3]) != 2 or spec.output_dtype != spec.dtype or not is_csr(formats.get(spec.output)):
        return None
    i, j, k, factors = found
    for a, b in (factors, factors[::-1]):
        if a.index == (i, k) and b.index == (k, j) and is_csr(formats.get(a.tensor)) and is_csr(formats.get(b.tensor)):
            return a.tensor, b.tensor
    return None


class SparseSum(NamedTuple):
    """``C[i,j] = alpha * A[i,j] + beta * B[i,j]``: the two operands and their coefficients (exact in the dtype)."""

    a: str
    b: str
    alpha: float | int
    beta: float | int


def sparse_sum_operands(spec: KernelSpec, formats: dict[str, Format]) -> SparseSum | None:
    """The sparse add ``C[i,j] = A[i,j] + B[i,j]`` with CSR ``A``, ``B`` and ``C`` (any index widths), or ``None``.

    Also matched: differences, unary minus and numeric factors on either
    operand (``2*A[i,j] - B[i,j]*0.5``, ``-(A[i,j] - 3*B[i,j])``), which
    fold into the two coefficients; for an integer dtype only integral
    factors.  ``A`` and ``B`` are two different tensors, each read at
    ``[i,j]`` in the output's index order.
    """
    if not spec.sparse_output or len(spec.stages) != 1 or spec.output_dtype != spec.dtype:
        return None
    stage = spec.stages[0]
    if stage.reduce or stage.indices != spec.output_indices or len(stage.indices) != 2:
        return None
    terms = _linear_terms(stage.body, 1)
    if terms is None or len(terms) != 2 or not is_csr(formats.get(spec.output)):
        return None
    (a, alpha), (b, beta) = terms
    if a.tensor == b.tensor or a.index != stage.indices or b.index != stage.indices:
        return None
    if not all(is_csr(formats.get(t.tensor)) for t in (a, b)):
        return None
    if spec.dtype.kind in "iu" and not all(float(c).is_integer() for c in (alpha, beta)):
        return None
    return SparseSum(a.tensor, b.tensor, alpha, beta)


def sparse_product_operands(spec: KernelSpec, formats: dict[str, Format]) -> SparseSum | None:
    """The elementwise product ``C[i,j] = A[i,j] * B[i,j]`` with CSR ``A``, ``B`` and ``C`` (any index widths), as
    ``SparseSum(a, b, 1, 1)`` (the merge's operands: an intersection, not a union), or ``None``.

    ``A`` and ``B`` are two different tensors, each read at ``[i,j]`` in the
    output's index order; ``C`` holds the columns both rows store.
    """
    if not spec.sparse_output or len(spec.stages) != 1 or spec.output_dtype != spec.dtype:
        return None
    stage = spec.stages[0]
    body = stage.body
    if stage.reduce or stage.indices != spec.output_indices or len(stage.indices) != 2 \
            or not isinstance(body, Binary) or body.op != "*" or not is_csr(formats.get(spec.output)):
        return None
    a, b = body.lhs, body.rhs
    if not (isinstance(a, Access) and isinstance(b, Access)) or a.tensor == b.tensor:
        return None
    if a.index != stage.indices or b.index != stage.indices or not all(is_csr(formats.get(t.tensor)) for t in (a, b)):
        return None
    return SparseSum(a.tensor, b.tensor, 1, 1)


def _linear_terms(node: Expr, factor: float) -> list[tuple[Access, float | int]] | None:
    """``node * factor`` as ``[(access, coefficient), ...]`` in reading order, or ``None`` when it is not a sum
    of accesses each times numeric literals."""
    if isinstance(node, Access):
        return [(node, factor)]
    if isinstance(node, Unary) and node.op == "-":
        return _linear_terms(node.operand, -factor)
    if isinstance(node, Binary) and node.op in "+-":
        left = _linear_terms(node.lhs, factor)
        right = _linear_terms(node.rhs, factor if node.op == "+" else -factor)
        return None if left is None or right is None else left + right
    if isinstance(node, Binary) and node.op == "*":
        for scale, term in ((node.lhs, node.rhs), (node.rhs, node.lhs)):
            if isinstance(scale, Literal):
                return _linear_terms(term, factor * scale.value)
    return None


def threads_sparse_output(spec: KernelSpec, formats: dict[str, Format]) -> bool:
    """Whether a hand-scheduled kernel writes this sparse result with rows in parallel (SDDMM, SpGEMM, the sparse
    add and elementwise product); the sparsifier never threads insertion into a sparse output."""
    return spec.sparse_output and (sddmm_operands(spec, formats) is not None
                                   or spgemm_operands(spec, formats) is not None
                                   or sparse_sum_operands(spec, formats) is not None
                                   or sparse_product_operands(spec, formats) is not None)


_KINDS = {"coo": COO, "csc": CSC, "dcsr": DCSR, "csr": CSR}


def format_kind(fmt: Format | None) -> str | None:
    """``coo``, ``csc``, ``dcsr`` or ``csr`` for those formats at any index widths, else ``None``."""
    if fmt is None:
        return None
    return next((name for name, preset in _KINDS.items() if fmt.with_widths(32, 32) == preset.with_widths(32, 32)),
                None)


def product_operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str | None] | None:
    """``(A, dense)`` when the kernel is ``y[i] = A[i,j] * x[j]`` or ``C[i,j] = A[i,k] * B[k,j]`` (factors in
    either order) with a dense result, a dense second factor and a COO, CSC or DCSR ``A``, or with ``A``
    transposed (``y[j] = A[i,j] * x[i]``) when it is CSR or CSC; ``(A, None)`` for the sums ``y[i] = A[i,j]``
    of the same operands; else ``None`` (CSR ``A[i,k]``: the GPU's CSR kernels).  The GPU's format kernels
    (``dialects.native.gpu_formats``) take these."""
    if spec.sparse_output or len(spec.stages) != 1:
        return None
    stage = spec.stages[0]
    body = stage.body
    if len(stage.reduce) != 1 or stage.indices != spec.output_indices or len(stage.indices) not in (1, 2):
        return None
    (k,) = stage.reduce
    i = stage.indices[0]
    dense_index = (k,) if len(stage.indices) == 1 else (k, stage.indices[1])
    allowed = {"coo": ((i, k),), "dcsr": ((i, k),), "csc": ((i, k), (k, i)), "csr": ((k, i),)}
    if isinstance(body, Access) and len(stage.indices) == 1:  # a row (or column) sum
        kind = format_kind(formats.get(body.tensor))
        return (body.tensor, None) if kind is not None and body.index in allowed[kind] else None
    if not isinstance(body, Binary) or body.op != "*":
        return None
    for a, b in ((body.lhs, body.rhs), (body.rhs, body.lhs)):
        kind = format_kind(formats.get(a.tensor)) if isinstance(a, Access) else None
        if kind is not None and isinstance(b, Access) and b.tensor not in formats and a.tensor != b.tensor \
                and a.index in allowed[kind] and b.index == dense_index:
            return a.tensor, b.tensor
    return None


def scatters(spec: KernelSpec, formats: dict[str, Format], a: str) -> bool:
    """Whether ``product_operands``' ``A`` (CSC, or CSR transposed) has the sum's index as its outer level, so
    each outer entry scatters into the result (atomic additions)."""
    fmt = formats[a]
    return format_kind(fmt) in ("csc", "csr") and \
        spec.operand_index(a)[fmt.dim_to_lvl[0].dim] == spec.stages[0].reduce[0]


def total_reduction_operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str | None] | None:
    """``(A, x or None)`` when the kernel sums every entry of a sparse ``A`` (times ``x`` at the coordinate of
    ``A``'s last level) into a scalar; else ``None``."""
    if spec.sparse_output or len(spec.stages) != 1 or spec.output_indices:
        return None
    stage = spec.stages[0]
    body = stage.body
    pairs = [(body, None)] if isinstance(body, Access) else \
        [(body.lhs, body.rhs), (body.rhs, body.lhs)] if isinstance(body, Binary) and body.op == "*" else []
    for a, x in pairs:
        if not isinstance(a, Access) or a.tensor not in formats or set(a.index) != set(stage.reduce) \
                or len(set(a.index)) != len(a.index):
            continue
        fmt = formats[a.tensor]
        if x is None:
            return a.tensor, None
        last = fmt.dim_to_lvl[-1]
        if isinstance(x, Access) and x.tensor not in formats and x.tensor != a.tensor and not last.op \
                and fmt.levels[-1].kind in (LevelKind.COMPRESSED, LevelKind.SINGLETON) \
                and x.index == (a.index[last.dim],):
            return a.tensor, x.tensor
    return None


def fiber_operands(spec: KernelSpec, formats: dict[str, Format]) -> tuple[str, str] | None:
    """``(A, D)`` when the kernel is ``Z[i,j] = A[i,j,k] * D[...]`` (either order) with CSF ``A``, a dense ``D``
    indexed by ``k`` and any of ``i``, ``j`` (each once), and a dense ``Z``; else ``None``."""
    if spec.sparse_output or len(spec.stages) != 1:
        return None
    stage = spec.stages[0]
    body = stage.body
    if len(stage.reduce) != 1 or len(stage.indices) != 2 or stage.indices != spec.output_indices \
            or not isinstance(body, Binary) or body.op != "*":
        return None
    (k,), (i, j) = stage.reduce, stage.indices
    for a, d in ((body.lhs, body.rhs), (body.rhs, body.lhs)):
        fmt = formats.get(a.tensor) if isinstance(a, Access) else None
        if fmt is None or fmt.with_widths(32, 32) != CSF.with_widths(32, 32) or a.index != (i, j, k):
            continue
        if isinstance(d, Access) and d.tensor not in formats and d.tensor != a.tensor and k in d.index \
                and set(d.index) <= {i, j, k} and len(set(d.index)) == len(d.index):
            return a.tensor, d.tensor
    return None
