"""``schedule="auto"``: time the candidate variants on the caller's data, keep the winner, inspectably.

Candidates are the generated sparse kernel with all threads, the same kernel
on one thread (small problems lose to fork/join), for a CSR SpMM whose
nonzeros come in blocks the BSR kernel on a BSR copy (dense register
blocks), dense BLAS on a dense copy of the sparse operands (for kernels
that are a sum of products) so that a user never pays for sparsity that does
not pay off, and, where a hand-scheduled emitter builds the kernel, the
sparsifier's kernel for the same expression (it wins on some SpGEMM
structures, where fewer, longer rows of ``B`` meet).  The sparsifier's
kernel compiles once per sparse shape (0.2-1 s), so it is only tried when
the hand-scheduled kernel takes at least ``SPARSIFIER_WORTH`` per call:
below that, a compile could never pay for itself within a few hundred calls.  Those copies are the conversions ``auto`` may make; they are
cached with the tensor and their cost is reported.  A dense copy is planned
only when it fits ``knobs.dense_budget()`` (``SPARSE_MLIR_DENSE_BUDGET``): a 1M x
1M SpMV must not ask for terabytes.  Decisions are cached per operand
structure (each sparse operand's format, shape, nnz and a fingerprint of a
sample of its index buffers, plus the dense sizes), not per tensor object:
a scipy operand becomes a new ``SparseTensor`` on every call, and timing
every variant again on each of them made calls 24x slower.
``kernel.schedule`` shows the last decision.
"""

from __future__ import annotations

import hashlib
import math
import string
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from sparse_mlir.compiler import driver
from sparse_mlir.compiler.driver import BuildOptions
from sparse_mlir.dsl.ast import Access, Binary, Expr, Literal
from sparse_mlir.dsl.patterns import is_csr, spmm_operands
from sparse_mlir.dsl.plan import KernelSpec
from sparse_mlir.errors import SparseMLIRError
from sparse_mlir.formats import BSR, Format
from sparse_mlir.knobs import knobs
from sparse_mlir.runtime import threads
from sparse_mlir.runtime.calls import kernel_call
from sparse_mlir.runtime.cpu import CpuKernel
from sparse_mlir.runtime.operands import check_extents, dense_output, prepare
from sparse_mlir.tensor.host import SparseTensor
from sparse_mlir.timing import median_seconds

__all__ = ["AutoKernel", "einsum_plan"]

_dense_copies: weakref.WeakKeyDictionary[SparseTensor, np.ndarray] = weakref.WeakKeyDictionary()
_block_copies: weakref.WeakKeyDictionary[SparseTensor, dict[Format, SparseTensor]] = weakref.WeakKeyDictionary()
BLOCKS = ((4, 4), (2, 2))  # BSR blocks tried for a CSR SpMM operand, the largest that fits first
MAX_FILL = 1.25  # ... when storing whole blocks adds at most this many entries per nonzero
MAX_BLOCK_DENSITY = 0.5  # ... and the blocks cover at most half the matrix (denser is dense BLAS's ground)
MAX_DECISIONS = 256  # operand structures remembered per kernel (least recently used dropped)
SPARSIFIER_WORTH = 0.02  # seconds per call of the hand-scheduled kernel from which the sparsifier's is tried too
# a sparse variant replaces dense BLAS only when it takes at most this share of its time: timed back to back,
# the sparse kernels look better than they run between other work (random 768^2 at 50%, N=128: 0.64 ms against
# dense 0.68 in the decision, 0.75 against 0.64 in the interleaved benchmark; at 60%, 0.51 against 0.66, then
# 0.56 against 0.64), and dense BLAS is the choice that never pays for sparsity that does not pay off
SPARSE_MARGIN = 0.9
FINGERPRINT_SAMPLES = 256  # index entries hashed per buffer: O(1) per call, whatever the tensor's size
_structures: weakref.WeakKeyDictionary[SparseTensor, tuple] = weakref.WeakKeyDictionary()


def einsum_plan(spec: KernelSpec) -> tuple[str, tuple[str, ...], float] | None:
    """``(subscripts, operand names, scale)`` when the kernel is one product summed, else ``None``."""
    if spec.sparse_output or len(spec.stages) != 1:
        return None
    factors: list[Access] = []
    scale = 1.0

    def walk(node: Expr) -> bool:
        nonlocal scale
        if isinstance(node, Access):
            factors.append(node)
            return True
        if isinstance(node, Literal):
            scale *= float(node.value)
            return True
        return isinstance(node, Binary) and node.op == "*" and walk(node.lhs) and walk(node.rhs)

    if not walk(spec.stages[0].body) or not factors:
        return None
    letters = {idx: string.ascii_letters[i] for i, idx in enumerate(spec.stages[0].loops)}
    terms = ",".join("".join(letters[i] for i in a.index) for a in factors)
    return f"{terms}->{''.join(letters[i] for i in spec.output_indices)}", tuple(a.tensor for a in factors), scale


def matmul_form(subscripts: str) -> tuple[bool, bool, bool] | None:
    """``(transpose x, transpose y, swap)`` when ``subscripts`` is a product of two matrices (or a matrix and a
    vector), so the result is ``x @ y`` (``swap``: ``(x @ y).T``, computed as ``y.T @ x.T``); else ``None``.

    ``np.matmul`` reaches BLAS directly (transposes are views) and writes
    ``out``; ``einsum``'s reshapes measured 20% slower on 4096^2 x 128.
    """
    inputs, output = subscripts.split("->")
    terms = inputs.split(",")
    if len(terms) != 2 or len(terms[0]) != 2 or len(terms[1]) not in (1, 2):
        return None
    x, y = terms
    shared = set(x) & set(y)
    if len(shared) != 1 or shared & set(output) or len(set(x + y)) != len(x + y) - 1:
        return None
    (k,) = shared
    x_free, y_free = x.replace(k, ""), y.replace(k, "")
    if sorted(output) != sorted(x_free + y_free):
        return None
    return x[0] == k, len(y) == 2 and y[1] == k, output != x_free + y_free


class AutoKernel(CpuKernel):
    """A ``CpuKernel`` that picks, per sparse operand, the fastest of its variants on first use."""

    direct_calls = False  # every call looks up its decision: the C-level call of one variant must not bypass it

    def __init__(self, spec: KernelSpec, options: BuildOptions):
        super().__init__(spec, options)
        self._einsum = einsum_plan(spec)
        self._matmul = matmul_form(self._einsum[0]) if self._einsum is not None else None
        self._blocked: dict[Format, CpuKernel] = {}  # the same expression over a BSR copy, per block format
        self._sparsified: CpuKernel | None = None  # the sparsifier's kernel, where an emitter builds this one
        self._decisions: OrderedDict[tuple, dict[str, Any]] = OrderedDict()  # by operand structure, LRU
        self.schedule: dict[str, Any] | None = None

    @kernel_call
    def __call__(self, out: np.ndarray | None = None, **operands: Any) -> Any:
        spec = self.spec
        args = prepare(spec.expression, self._inputs, operands, spec.dtype, self.target)
        key = tuple((n, structure(v) if isinstance(v, SparseTensor) else v.shape) for n, v in args.items())
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decisions[key] = self._decide(args)
            while len(self._decisions) > MAX_DECISIONS:
                self._decisions.popitem(last=False)
        else:
            self._decisions.move_to_end(key)
        self.schedule = decision
        result = self._run(decision["choice"], args, out)
        self._native_fast = self._route(decision["choice"], operands)
        return result

    def _route(self, choice: str, operands: dict[str, Any]) -> Callable[[dict[str, Any], Any], Any] | None:
        """The call that sends the next calls with these very ``SparseTensor`` objects straight to the chosen
        variant (``kernel_call`` tries it first): a sparse variant's C-level call, or dense BLAS on the cached
        dense copies (``_dense_route``); else ``None``.

        A decision is made per tensor object (``structure`` is computed once
        per object), so the same objects mean the same decision.  Looking it
        up again through ``prepare``, the structure key and the kernel's own
        Python path cost 15 us a call on one thread, and 46 us on two (random
        768^2 at 90%, N=128: 0.13 ms a call), where the plain kernel's
        C-level call costs 2.  The tensors are held weakly: a route must not
        keep a user's matrix alive.  The C-level call checks every operand
        itself and returns ``NotImplemented`` for anything else, and so does
        the route for other sparse objects: the Python path then decides.
        """
        tensors = [operands.get(name) for name in self._sparse_inputs]
        if not all(type(t) is SparseTensor for t in tensors):  # scipy operands become new tensors every call
            return None
        call = self._dense_route(operands) if choice == "dense" else self._variant_call(choice)
        if call is None:
            return None
        held = tuple(zip(self._sparse_inputs, [weakref.ref(t) for t in tensors]))

        def route(given: dict[str, Any], out: Any) -> Any:
            for name, ref in held:
                if given.get(name) is not ref():
                    return NotImplemented
            return call(given, out)

        return route

    def _variant_call(self, choice: str) -> Callable[[dict[str, Any], Any], Any] | None:
        """``call(operands, out)`` running the sparse variant ``choice`` on the caller's operands (its C-level call,
        or for a BSR copy that kernel's own call, which tries its C-level call first: ``_run`` calls it too);
        ``None`` for dense BLAS (its route is ``_dense_route``) and the sparsifier's kernel, whose calls keep the
        Python path."""
        if choice in ("sparse", "sparse, 1 thread"):
            call = None if self._fast is None else self._fast[2].fast_call()
            if call is None or choice == "sparse":
                return call

            def serial(given: dict[str, Any], out: Any) -> Any:
                with threads.fixed(1):  # a new one each time: a ``fixed`` block's saved state is per object
                    return call(given, out)

            return serial
        if choice.startswith("sparse, bsr"):
            (name,) = self._sparse_inputs
            fmt = next(f for f in self._blocked if f"sparse, {f}" == choice)
            blocked = self._blocked[fmt]

            def on_blocks(given: dict[str, Any], out: Any) -> Any:
                return blocked(out=out, **{**given, name: _block_copy(given[name], fmt)})

            return on_blocks
        return None

    def _run(self, choice: str, args: dict[str, Any], out: np.ndarray | None) -> Any:
        if choice == "dense":
            return self._dense(args, out)
        if choice.startswith("sparse, bsr"):
            return self._variant_call(choice)(args, out)
        if choice == "sparse, 1 thread":
            return self._on_threads(1, args, out)
        if choice == "sparsifier":
            assert self._sparsified is not None
            return self._sparsified(out=out, **args)
        return super().__call__(out=out, **args)

    def _on_threads(self, count: int, args: dict[str, Any], out: np.ndarray | None) -> Any:
        """The kernel on ``count`` threads, whatever its ``ThreadChoice`` would pick."""
        with threads.fixed(count):
            return super().__call__(out=out, **args)

    def _dense(self, args: dict[str, Any], out: np.ndarray | None) -> np.ndarray:
        assert self._einsum is not None
        check_extents(self._sources, args)  # the one variant that does not check them: numpy would, in its words
        subscripts, names, scale = self._einsum
        operands = [_dense_copy(args[n]) if isinstance(args[n], SparseTensor) else args[n] for n in names]
        out = dense_output(self.spec.output, out, self._product_shape(operands), self.spec.dtype, args)
        if self._matmul is not None:
            self._matmul_into(*operands, out)
        else:
            np.einsum(subscripts, *operands, optimize=True, out=out)
        if scale != 1.0:
            out *= self.spec.dtype.type(scale)
        return out

    def _product_shape(self, operands: list[Any]) -> tuple[int, ...]:
        """The shape of the product of ``operands`` (anything with ``.shape``, in ``einsum_plan``'s order)."""
        inputs, output = self._einsum[0].split("->")
        sizes = {c: s for term, op in zip(inputs.split(","), operands) for c, s in zip(term, op.shape)}
        return tuple(sizes[c] for c in output)

    def _matmul_into(self, x: np.ndarray, y: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """``x @ y`` in the layout ``matmul_form`` found (transposes are views), into ``out`` (or a new array)."""
        tx, ty, swap = self._matmul
        x, y = (x.T if tx else x), (y.T if ty else y)
        return np.matmul(y.T, x.T, out=out) if swap else np.matmul(x, y, out=out)

    def _dense_route(self, operands: dict[str, Any]) -> Callable[[dict[str, Any], Any], Any] | None:
        """For a dense choice of a matrix product: ``call(operands, out)`` that multiplies the cached dense copies
        straight away when every dense operand is an array of the decided dtype and shape and ``out=`` is absent
        or an array ``dense_output`` takes without question (else ``NotImplemented``: the Python path checks and
        raises); ``None`` for other products.  ``_route`` has checked that the sparse operands are the decided
        objects.

        Why: a decided dense call went through ``prepare``, the structure key
        and the decision look-up, 9.4 us a call where the product itself takes
        0.9 (32^2 at 50%, N=4); the plain sparse kernel took 3.1.  The dense
        copies are held weakly, as the tensors they copy hold them.
        """
        if self._matmul is None or set(operands) != set(self.spec.inputs):
            return None
        _, names, scale = self._einsum
        dtype, expected = self.spec.dtype, frozenset(operands)
        factors: list[tuple[str, Any]] = []  # (name, the decided shape) for an array, (name, a weak copy) else
        for name in names:
            value = operands[name]
            if isinstance(value, SparseTensor):
                copy = _dense_copies.get(value)
                if copy is None:
                    return None
                factors.append((name, weakref.ref(copy)))
            elif type(value) is np.ndarray:
                factors.append((name, value.shape))
            else:
                return None
        factor, shape = dtype.type(scale), self._product_shape([operands[name] for name in names])

        def dense(given: dict[str, Any], out: Any) -> Any:
            if given.keys() != expected:
                return NotImplemented
            if out is not None and not (type(out) is np.ndarray and out.dtype == dtype and out.shape == shape
                                        and out.flags.c_contiguous and out.flags.aligned and out.flags.writeable):
                return NotImplemented
            arrays = []
            for name, held in factors:
                value = given[name]
                if type(held) is tuple:
                    if type(value) is not np.ndarray or value.dtype != dtype or value.shape != held:
                        return NotImplemented
                    buffers: tuple[np.ndarray, ...] = (value,)
                else:
                    buffers, value = value.buffers, held()
                    if value is None:
                        return NotImplemented
                if out is not None and any(np.may_share_memory(out, b) for b in buffers):
                    return NotImplemented  # refused by the Python path, which names the operand
                arrays.append(value)
            result = self._matmul_into(*arrays, out)
            if scale != 1.0:
                result *= factor
            return result

        return dense

    def _decide(self, args: dict[str, Any]) -> dict[str, Any]:
        # The sparse candidates are timed first and dense BLAS last, after our pool's workers have stopped
        # spinning: each pool's idle threads slow the other's calls on a small machine.  Ours spin for the
        # blocktime (5 ms) after a call; BLAS threads timed inside it ran up to 10x slower here.  OpenBLAS's
        # spin for about 0.1 s after a call (``OPENBLAS_THREAD_TIMEOUT``), so sparse candidates timed after
        # dense BLAS measured two threads as slow as one (random 768^2 at 90%, N=128: 0.23 ms for both, where
        # two threads take 0.13) and "sparse, 1 thread" won two decisions in three.
        candidates: dict[str, Callable[[], object]] = {}
        skipped: dict[str, str] = {}
        conversion = 0.0
        sparse = [v for v in args.values() if isinstance(v, SparseTensor)]
        if self.options.openmp is not None and (count := knobs.num_threads()) > 1:
            # timed on all threads: left to its ``ThreadChoice``, the five timed calls would mix its trials of
            # one thread and of all (random 768^2 at 90%, N=128: "sparse" timed slower than "1 thread" and lost,
            # 1.89x dense where the kernel on its own choice ran 2.58x)
            candidates["sparse"] = lambda: self._on_threads(count, args, None)
            candidates["sparse, 1 thread"] = lambda: self._on_threads(1, args, None)
        else:
            candidates["sparse"] = lambda: super(AutoKernel, self).__call__(**args)
        start = time.perf_counter()
        if (blocked := self._block_candidate(args)) is not None:
            candidates[f"sparse, {blocked}"] = lambda: self._run(f"sparse, {blocked}", args, None)
            conversion += time.perf_counter() - start
        times = {name: median_seconds(fn, 5) for name, fn in candidates.items()}
        if (reason := self._sparsifier_candidate(args, times["sparse"])) is None:
            times["sparsifier"] = median_seconds(lambda: self._run("sparsifier", args, None), 5)
        elif reason:
            skipped["sparsifier"] = reason
        if self._einsum is not None:
            need, budget = sum(math.prod(t.shape) for t in sparse) * self.spec.dtype.itemsize, knobs.dense_budget()
            if need > budget:
                skipped["dense"] = (f"dense copies of the sparse operands need {need:,} bytes, over the dense "
                                    f"budget of {budget:,} (SPARSE_MLIR_DENSE_BUDGET)")
            else:
                start = time.perf_counter()
                for value in sparse:
                    _dense_copy(value)
                conversion += time.perf_counter() - start
                threads.wait_until_idle()
                times["dense"] = median_seconds(lambda: self._dense(args, None), 5)
        choice = min(times, key=times.__getitem__)
        if "dense" in times and times[choice] > SPARSE_MARGIN * times["dense"]:
            choice = "dense"
        if choice != "dense":  # the copies made to time the dense candidate would only hold memory
            for value in sparse:
                _dense_copies.pop(value, None)
        return {"choice": choice, "seconds": times, "conversion_seconds": conversion, "skipped": skipped}

    def _sparsifier_candidate(self, args: dict[str, Any], hand_scheduled: float) -> str | None:
        """``None`` when the sparsifier's kernel is to be timed too (built here, first); else why not (``""``:
        not a choice at all, as the kernel already is the sparsifier's)."""
        formats = {n: args[n].format for n in self._sparse_inputs}
        if self.options.emitter != "auto" or not driver.shape_generic(self.spec, formats, self.options):
            return ""
        if hand_scheduled < SPARSIFIER_WORTH:
            return (f"the hand-scheduled kernel takes {hand_scheduled * 1e3:.2f} ms per call, under the "
                    f"{SPARSIFIER_WORTH * 1e3:.0f} ms a per-shape sparsifier build would need to pay off")
        if self._sparsified is None:
            self._sparsified = CpuKernel(self.spec, replace(self.options, emitter="sparsifier"))
        try:
            self._run("sparsifier", args, None)  # compiles it: not part of the timing
        except SparseMLIRError as exc:
            return f"the sparsifier cannot build it: {exc}"
        return None

    def _block_candidate(self, args: dict[str, Any]) -> Format | None:
        """For a CSR SpMM operand whose nonzeros fill whole blocks: a cached BSR copy and its kernel's format."""
        found = spmm_operands(self.spec, self.spec.formats)
        if found is None or len(self._sparse_inputs) != 1 or not is_csr(self.spec.formats[found[0]]):
            return None
        tensor = args[found[0]]
        pos, crd, _ = tensor.buffers
        for bm, bn in BLOCKS:
            if tensor.shape[0] % bm or tensor.shape[1] % bn or not tensor.nnz:
                continue
            # a prefix of whole block rows first (counting blocks sorts the keys): most matrices fail it cheaply
            prefix = min(max(bm, int(np.searchsorted(pos, 1 << 16)) // bm * bm), tensor.shape[0])
            if not all(_fits_blocks(pos, crd, rows, bm, bn, tensor.shape) for rows in (prefix, tensor.shape[0])):
                continue
            fmt = BSR(bm, bn)
            _block_copy(tensor, fmt)
            if fmt not in self._blocked:
                self._blocked[fmt] = CpuKernel(replace(self.spec, formats={**self.spec.formats, found[0]: fmt}),
                                            self.options)
            return fmt
        return None


def _fits_blocks(pos: np.ndarray, crd: np.ndarray, rows: int, bm: int, bn: int, shape: tuple[int, ...]) -> bool:
    """Whether the first ``rows`` rows of a CSR matrix stored as ``bm x bn`` blocks stay within ``MAX_FILL``
    entries per nonzero and ``MAX_BLOCK_DENSITY`` of the matrix."""
    nnz = int(pos[rows])
    if not nnz:
        return True
    row_of = np.repeat(np.arange(rows), np.diff(pos[:rows + 1]))
    stored = np.unique((row_of // bm) * (shape[1] // bn) + crd[:nnz] // bn).size * bm * bn
    return stored <= MAX_FILL * nnz and stored <= MAX_BLOCK_DENSITY * shape[0] * shape[1]


def structure(tensor: SparseTensor) -> tuple:
    """What a schedule decision depends on: format, shape, nnz and a hash of a strided sample of the index
    buffers (where the nonzeros are, not their values), computed once per tensor object."""
    found = _structures.get(tensor)
    if found is None:
        digest = hashlib.blake2b(digest_size=16)
        for buf in tensor.buffers[:-1]:
            step = max(1, buf.size // FINGERPRINT_SAMPLES)
            digest.update(np.ascontiguousarray(buf[::step]).tobytes())
            digest.update(np.ascontiguousarray(buf[-1:]).tobytes())
        found = _structures[tensor] = (repr(tensor.format), tensor.format.pos_width, tensor.format.crd_width,
                                       tensor.shape, tensor.nnz, digest.hexdigest())
    return found


def _block_copy(tensor: SparseTensor, fmt: Format) -> SparseTensor:
    """``tensor`` converted to the block format ``fmt``, made once per tensor; every call for a scipy operand
    used in place (``borrowed``), whose values may change between calls (a kept copy answered with the old
    ones)."""
    if tensor.borrowed:
        return SparseTensor.from_scipy(tensor.to_scipy(), fmt)
    copies = _block_copies.setdefault(tensor, {})
    if fmt not in copies:
        copies[fmt] = SparseTensor.from_scipy(tensor.to_scipy(), fmt)
    return copies[fmt]


def _dense_copy(tensor: SparseTensor) -> np.ndarray:
    """``tensor`` as a dense array, kept with it (made every call when ``borrowed``, as ``_block_copy``)."""
    if tensor.borrowed:
        return tensor.to_dense()
    dense = _dense_copies.get(tensor)
    if dense is None:
        dense = _dense_copies[tensor] = tensor.to_dense()
    return dense
