"""Storage formats as small frozen values.

A :class:`Format` is what MLIR calls a ``#sparse_tensor.encoding``: one
:class:`Level` per storage level, a dimension-to-level map and the bit widths
of position and coordinate buffers.  Equality and hashing cover every field
that changes generated code (TACO's ``Format ==`` forgot the widths; we do
not).  ``str(fmt)`` prints the encoding text.  Presets (``CSR``, ``BSR(2, 2)``,
``NM(2, 4)``) and one string parser (``"csr"``, ``"bsr2x2"``, ``"2:4"``,
``"ds:1,0"``) are shared by the Python API, the command line and CMake.

This module is pure Python: MLIR attributes are built from it in
``sparse_mlir.dialects.encoding``.
"""

from __future__ import annotations

import enum
import functools
import numbers
import re
from dataclasses import dataclass, field, replace
from typing import Any

from sparse_mlir.errors import FormatError

__all__ = [
    "LevelKind", "Level", "LevelExpr", "Format", "CSR", "CSC", "COO", "DCSR", "CSF",
    "Dense", "BSR", "NM", "coo", "csf", "sparse_vector", "parse_format", "as_format", "format_to_json",
    "format_from_json",
]

_WIDTHS = (0, 8, 16, 32, 64)
# levels of a coo/csf/letter format: tensors have 1 to 3 dimensions (SparseTensor refuses more with a ShapeError),
# but a format for more may be built; the bound only stops coo(10**9) from building a billion levels
MAX_ORDER = 8
_MAX_FACTOR = 2**62  # block and N:M sizes: MLIR's affine constants are int64, and sizes are multiplied by them


def _is_int(value: object) -> bool:
    """A real integer (not a bool, not 2.0): format fields computed with must stay exact."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class LevelKind(str, enum.Enum):
    """MLIR level formats (``structured`` is N:M)."""

    DENSE = "dense"
    COMPRESSED = "compressed"
    LOOSE_COMPRESSED = "loose_compressed"
    SINGLETON = "singleton"
    STRUCTURED = "structured"


@dataclass(frozen=True)
class Level:
    """One storage level: its kind and properties (MLIR spelling)."""

    kind: LevelKind
    unique: bool = True
    ordered: bool = True
    n: int = 0
    m: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", LevelKind(self.kind))
        except ValueError:
            raise FormatError(f"unknown level kind {self.kind!r}; kinds: "
                              f"{', '.join(k.value for k in LevelKind)}") from None
        if not all(isinstance(flag, bool) for flag in (self.unique, self.ordered)):
            raise FormatError(f"level properties unique/ordered must be booleans, got {self.unique!r}, {self.ordered!r}")
        if not all(_is_int(v) for v in (self.n, self.m)):
            raise FormatError(f"structured level sizes must be integers, got {self.n!r}:{self.m!r}")
        if self.kind is LevelKind.STRUCTURED and not (0 < self.n <= self.m):
            raise FormatError(f"structured level needs 0 < n <= m, got {self.n}:{self.m}")
        if self.kind is not LevelKind.STRUCTURED and (self.n or self.m):
            raise FormatError(f"only structured levels take n and m, got {self.kind.value}")
        if self.kind is LevelKind.DENSE and not (self.unique and self.ordered):
            raise FormatError("dense levels are always unique and ordered")
        if self.kind is LevelKind.LOOSE_COMPRESSED:
            # MLIR reads a (lo, hi) pair of positions per parent; SparseTensor and the C entry point build and
            # check compressed positions (n + 1), so kernels read them misaligned: an SpMV over a dense,
            # loose_compressed matrix returned wrong rows.  Refused until buffers of that layout exist.
            raise FormatError("loose_compressed levels are not supported: sparse tensors store compressed "
                              "positions (one start per parent, not a (lo, hi) pair); use compressed")

    @property
    def has_positions(self) -> bool:
        return self.kind in (LevelKind.COMPRESSED, LevelKind.LOOSE_COMPRESSED)

    @property
    def has_coordinates(self) -> bool:
        return self.kind is not LevelKind.DENSE

    def mlir(self) -> str:
        """The level type as written in an encoding (``compressed(nonunique)``)."""
        if self.kind is LevelKind.STRUCTURED:
            return f"structured[{self.n}, {self.m}]"
        props = [p for p, off in (("nonunique", self.unique), ("nonordered", self.ordered)) if not off]
        if self.kind is LevelKind.SINGLETON:
            props.append("soa")  # one coordinate array per level, never array-of-structs
        return self.kind.value + (f"({', '.join(props)})" if props else "")


@dataclass(frozen=True)
class LevelExpr:
    """A level coordinate as a function of one dimension: ``d``, ``d floordiv c`` or ``d mod c``."""

    dim: int
    op: str = ""
    factor: int = 0

    def __post_init__(self) -> None:
        if not (_is_int(self.dim) and _is_int(self.factor)) or self.dim < 0:
            raise FormatError(f"a level expression needs a dimension >= 0 and an integer factor, "
                              f"got d{self.dim!r} {self.op} {self.factor!r}")
        if self.op not in ("", "floordiv", "mod"):
            raise FormatError(f"level expression op must be '', 'floordiv' or 'mod', got {self.op!r}")
        if self.op and self.factor < 1:
            raise FormatError(f"'{self.op}' needs a positive factor, got {self.factor}")

    def size(self, shape: tuple[int, ...]) -> int:
        extent = shape[self.dim]
        if self.op == "floordiv":
            return extent // self.factor
        if self.op == "mod":
            return self.factor
        return extent

    def mlir(self) -> str:
        return f"d{self.dim}" + (f" {self.op} {self.factor}" if self.op else "")


# ``Format.with_widths``' objects: by (format, name, widths) asked, and by (levels, level expressions, name,
# widths), so the same widths of one structure are one object whichever widths they are asked from.  The name is
# in the keys because formats compare without it.
_AT_WIDTHS: dict[tuple, Format] = {}
_BY_STRUCTURE: dict[tuple, Format] = {}
_AT_WIDTHS_KEPT = 4096


@dataclass(frozen=True, eq=False)
class Format:
    """A storage format: levels, dimension-to-level map and index widths.

    ``levels == ()`` is the rank-polymorphic dense format ``Dense`` used for
    operands that carry no encoding.  Widths of 0 mean MLIR's ``index``.
    """

    levels: tuple[Level, ...]
    dim_to_lvl: tuple[LevelExpr, ...]
    pos_width: int = 32
    crd_width: int = 32
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.dim_to_lvl):
            raise FormatError(f"{len(self.levels)} levels but {len(self.dim_to_lvl)} level expressions")
        for width, what in ((self.pos_width, "pos_width"), (self.crd_width, "crd_width")):
            if not _is_int(width) or width not in _WIDTHS:
                raise FormatError(f"{what} must be one of {_WIDTHS}, got {width}")
        dims = {e.dim for e in self.dim_to_lvl}
        if dims != set(range(len(dims))):
            raise FormatError(f"level expressions must cover dimensions 0..{len(dims) - 1}, got {sorted(dims)}")
        for d in dims:
            ops = sorted(e.op for e in self.dim_to_lvl if e.dim == d)
            factors = {e.factor for e in self.dim_to_lvl if e.dim == d}
            if ops not in ([""], ["floordiv", "mod"]) or len(factors) != 1:
                raise FormatError(f"dimension {d} must map to one level, or to a floordiv/mod pair with one factor")
        for i, lvl in enumerate(self.levels):
            if lvl.kind is LevelKind.SINGLETON and (i == 0 or self.levels[i - 1].unique):
                raise FormatError("a singleton level must follow a non-unique level (as in COO)")
            # the converse: MLIR's sparsifier asserts (the compiler process dies) on a non-unique level followed
            # by anything but a singleton (TACO letters "ud", "us", "uu", "sud", ...)
            if not lvl.unique and i + 1 < len(self.levels) and self.levels[i + 1].kind is not LevelKind.SINGLETON:
                raise FormatError(f"a non-unique level must be the last or be followed by a singleton level (as in "
                                  f"COO), but level {i} is followed by {self.levels[i + 1].mlir()}")
            if lvl.kind is LevelKind.STRUCTURED and (i != len(self.levels) - 1 or self.dim_to_lvl[i].op != "mod"
                                                     or self.dim_to_lvl[i].factor != lvl.m):
                raise FormatError("a structured[n, m] level must be last and map 'd mod m'")

    def __eq__(self, other: object) -> bool:
        """Formats compare by structure and widths; a string compares by structure, whatever the widths
        (``tensor.format == "csr"`` for a CSR tensor with 64-bit indices too), as numpy dtypes equal their names."""
        if isinstance(other, str):
            try:
                parsed = parse_format(other, self.ndim)
            except FormatError:
                return False
            return self.with_widths(parsed.pos_width, parsed.crd_width)._key() == parsed._key()
        if not isinstance(other, Format):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        # computed once per object: formats key many per-call lookups (``A @ x``, index widths) and hashing the
        # nested tuples took about 1 us.  Kept out of pickles (``__getstate__``): string hashes differ per process.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(self._key())
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def _key(self) -> tuple:
        return self.levels, self.dim_to_lvl, self.pos_width, self.crd_width

    # -- shape facts -------------------------------------------------------
    @property
    def ndim(self) -> int | None:
        """Number of dimensions, or ``None`` for the rank-polymorphic ``Dense``."""
        return len({e.dim for e in self.dim_to_lvl}) if self.levels else None

    @property
    def is_dense(self) -> bool:
        return not self.levels

    @property
    def is_nm(self) -> bool:
        return any(lvl.kind is LevelKind.STRUCTURED for lvl in self.levels)

    @property
    def block_factors(self) -> dict[int, int]:
        """Dimensions tiled by ``floordiv``/``mod`` and their tile sizes."""
        return {e.dim: e.factor for e in self.dim_to_lvl if e.op == "floordiv"}

    def level_sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(e.size(shape) for e in self.dim_to_lvl)

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Raise ``FormatError`` when ``shape`` cannot be stored in this format."""
        if self.is_dense:
            return
        if len(shape) != self.ndim:
            raise FormatError(f"format {self} stores {self.ndim}-d tensors, got shape {shape}")
        for dim, factor in self.block_factors.items():
            if shape[dim] % factor:
                raise FormatError(
                    f"format {self} tiles dimension {dim} by {factor}, but its size {shape[dim]} is not a multiple")

    # -- buffers -------------------------------------------------------------
    @functools.cached_property
    def buffer_names(self) -> tuple[str, ...]:
        """Level buffers in the order the sparse assembler passes them, then ``values`` (computed once)."""
        names: list[str] = []
        for i, lvl in enumerate(self.levels):
            if lvl.has_positions:
                names.append(f"pos{i}")
            if lvl.has_coordinates:
                names.append(f"crd{i}")
        return (*names, "values")

    @property
    def codegen_format(self) -> Format:
        """The format kernels are generated for.

        Upstream's direct codegen of ``structured[n, m]`` is miscompiled (see
        UPSTREAM-NOTES), so an N:M level is generated as a compressed level
        whose positions are implicit (``n`` per group) and supplied by the
        runtime.  Every other format is generated as itself.
        """
        if not self.is_nm:
            return self
        levels = tuple(Level(LevelKind.COMPRESSED) if lvl.kind is LevelKind.STRUCTURED else lvl
                       for lvl in self.levels)
        return replace(self, levels=levels, name=f"{self.name}-as-compressed")

    def with_widths(self, pos_width: int | None = None, crd_width: int | None = None) -> Format:
        """This format with other index widths (``None`` keeps one): ``self`` when they are its own, else the
        same object for the same format and widths every time.  Formats are immutable, and a kernel takes an
        operand whose format is the very object it was built for on its C-level call (``runtime.fast_call``):
        ``CSR.with_widths(32, 32)`` as a new object equal to ``CSR`` cost the kernels that met both that call.
        """
        pos = self.pos_width if pos_width is None else pos_width
        crd = self.crd_width if crd_width is None else crd_width
        if pos == self.pos_width and crd == self.crd_width:
            return self
        # the per-call look-up: a format hashes once (``__hash__``), so this key hashes in 0.12 us where the
        # structure's (levels and level expressions, hashed each time) took 0.33 (session 27)
        asked = (self, self.name, pos, crd)
        found = _AT_WIDTHS.get(asked)
        if found is None:
            if len(_AT_WIDTHS) >= _AT_WIDTHS_KEPT:  # a process making formats without end: start the tables again
                _AT_WIDTHS.clear()
                _BY_STRUCTURE.clear()
            structure = (self.levels, self.dim_to_lvl, self.name)
            _BY_STRUCTURE.setdefault((*structure, self.pos_width, self.crd_width), self)  # the way back gives self
            found = _BY_STRUCTURE.setdefault((*structure, pos, crd), replace(self, pos_width=pos, crd_width=crd))
            _AT_WIDTHS[asked] = found
        return found

    # -- printing --------------------------------------------------------------
    def encoding_text(self) -> str:
        """The ``#sparse_tensor.encoding<...>`` attribute text."""
        return self._encoding(tuple(zip(self.dim_to_lvl, self.levels)))

    def mlir_levels(self) -> tuple[tuple[LevelExpr, Level], ...]:
        """The (expression, level) pairs MLIR is given: ``dim_to_lvl`` with blocks of side 1 collapsed.

        MLIR simplifies ``d floordiv 1`` to ``d`` and ``d mod 1`` to the
        constant 0, which names no dimension, so an encoding that spells
        them fails to parse ("failed to infer lvlToDim").  A dense ``d mod 1``
        level has one entry and no buffers: leaving it out stores the very
        same buffers in the same order, and ``d floordiv 1`` is plain ``d``.
        A unit level that has buffers cannot be left out (``FormatError``).
        """
        pairs = []
        for expr, lvl in zip(self.dim_to_lvl, self.levels):
            if expr.factor != 1:
                pairs.append((expr, lvl))
            elif expr.op == "floordiv":
                pairs.append((LevelExpr(expr.dim), lvl))
            elif lvl.kind is not LevelKind.DENSE:
                raise FormatError(f"format {self}: level 'd{expr.dim} mod 1' is {lvl.mlir()}, but MLIR cannot "
                                  f"store a level of size 1 (it has no coordinate); make it dense")
        return tuple(pairs)

    def mlir_encoding_text(self) -> str:
        """The encoding text given to MLIR: ``encoding_text`` over ``mlir_levels`` (blocks of side 1 collapsed)."""
        return self._encoding(self.mlir_levels())

    def _encoding(self, pairs: tuple[tuple[LevelExpr, Level], ...]) -> str:
        """The attribute text of ``pairs`` with this format's dimensions and widths (``""`` for dense)."""
        if self.is_dense:
            return ""
        dims = ", ".join(f"d{d}" for d in range(self.ndim or 0))
        lvls = ", ".join(f"{e.mlir()} : {lvl.mlir()}" for e, lvl in pairs)
        return (f"#sparse_tensor.encoding<{{ map = ({dims}) -> ({lvls}), "
                f"posWidth = {self.pos_width}, crdWidth = {self.crd_width} }}>")

    def __str__(self) -> str:
        return self.name or self.encoding_text()

    def __repr__(self) -> str:
        return f"Format({self.name or self.encoding_text()!r})"


def _levels(*kinds: str | Level) -> tuple[Level, ...]:
    return tuple(k if isinstance(k, Level) else Level(LevelKind(k)) for k in kinds)


def _ordered(*dims: int) -> tuple[LevelExpr, ...]:
    return tuple(LevelExpr(d) for d in dims)


def _check_order(order: object, what: str) -> int:
    """``order`` as an int in 1..MAX_ORDER, or ``FormatError``.

    ``csf(0)`` used to be a format with no levels, which equals ``Dense``:
    ``"csf0"`` silently made an operand dense; ``coo(10**9)`` built a billion
    levels (a hang) and ``coo("2")`` raised a raw ``TypeError``.
    """
    if not _is_int(order) or not 1 <= order <= MAX_ORDER:  # type: ignore[operator]
        raise FormatError(f"{what} order must be an integer from 1 to {MAX_ORDER} (tensors have 1 to 3 dimensions), "
                          f"got {order!r}")
    return int(order)  # type: ignore[call-overload]


def _check_sizes(what: str, *sizes: object) -> None:
    """Block and group sizes are positive integers below ``_MAX_FACTOR`` (not ``"2"``, ``2.0`` or ``True``)."""
    if not all(_is_int(v) and 0 < v < _MAX_FACTOR for v in sizes):  # type: ignore[operator]
        raise FormatError(f"{what} sizes must be positive integers below 2**62, got "
                          f"{', '.join(repr(v) for v in sizes)}")


def coo(order: int = 2) -> Format:
    """COO of any order: a non-unique compressed level then singletons."""
    order = _check_order(order, "coo")
    levels = (Level(LevelKind.COMPRESSED, unique=order == 1),
              *(Level(LevelKind.SINGLETON, unique=i == order - 1) for i in range(1, order)))
    return Format(levels, _ordered(*range(order)), name="coo" if order == 2 else f"coo{order}")


def csf(order: int = 3) -> Format:
    """Compressed sparse fiber: every level compressed."""
    order = _check_order(order, "csf")
    return Format(_levels(*["compressed"] * order), _ordered(*range(order)),
                  name="csf" if order == 3 else f"csf{order}")


def sparse_vector() -> Format:
    return Format(_levels("compressed"), _ordered(0), name="sparse_vector")


def BSR(bm: int, bn: int) -> Format:  # noqa: N802 - a format constructor reads like a constant
    """Block sparse rows with dense ``bm x bn`` blocks."""
    _check_sizes("BSR block", bm, bn)
    exprs = (LevelExpr(0, "floordiv", bm), LevelExpr(1, "floordiv", bn), LevelExpr(0, "mod", bm),
             LevelExpr(1, "mod", bn))
    return Format(_levels("dense", "compressed", "dense", "dense"), exprs, name=f"bsr{bm}x{bn}")


def NM(n: int, m: int) -> Format:  # noqa: N802
    """N:M structured sparsity along rows: at most ``n`` nonzeros in each group of ``m`` columns."""
    _check_sizes("N:M group", n, m)
    if not n <= m or m < 2:  # m == 1: a group of one column has no offset for MLIR to store (1:1 is dense)
        raise FormatError(f"N:M needs 1 <= n <= m and m >= 2 (at most n nonzeros in each group of m columns), "
                          f"got {n}:{m}")
    exprs = (LevelExpr(0), LevelExpr(1, "floordiv", m), LevelExpr(1, "mod", m))
    crd_width = 8 if m <= 127 else 32 if m <= 2**31 - 1 else 64  # in-group offsets are below m
    return Format(_levels("dense", "dense", Level(LevelKind.STRUCTURED, n=n, m=m)), exprs,
                  crd_width=crd_width, name=f"{n}:{m}")


CSR = Format(_levels("dense", "compressed"), _ordered(0, 1), name="csr")
CSC = Format(_levels("dense", "compressed"), _ordered(1, 0), name="csc")
DCSR = Format(_levels("compressed", "compressed"), _ordered(0, 1), name="dcsr")
COO = coo(2)
CSF = csf(3)
Dense = Format((), (), name="dense")

_LETTERS = {"d": Level(LevelKind.DENSE), "s": Level(LevelKind.COMPRESSED),
            "u": Level(LevelKind.COMPRESSED, unique=False), "q": Level(LevelKind.SINGLETON),
            "c": Level(LevelKind.SINGLETON, unique=False)}


def parse_format(text: str, ndim: int | None = None) -> Format:
    """Parse the short string form of a format.

    Accepts ``dense``, ``csr``, ``csc``, ``coo``, ``dcsr``, ``csf``,
    ``sparse_vector``, ``bsrRxC``, ``N:M`` and TACO's level letters with an
    optional ordering (``ds:1,0`` is CSC; ``d`` dense, ``s`` compressed, ``u``
    non-unique compressed, ``q`` singleton, ``c`` non-unique singleton).
    ``ndim`` picks the order of ``coo``/``csf`` and is checked otherwise.
    """
    key = text.strip().lower()
    fmt = _parse(key, ndim)
    if fmt is None:
        raise FormatError(f"unknown format {text!r}: expected dense, csr, csc, coo, dcsr, csf, "
                          f"sparse_vector, bsrRxC (e.g. bsr2x2), N:M (e.g. 2:4) or level letters like 'ds:1,0'")
    if ndim is not None and fmt.ndim is not None and fmt.ndim != ndim:
        raise FormatError(f"format {text!r} stores {fmt.ndim}-d tensors, but the operand has {ndim} indices")
    return fmt


def _parse(key: str, ndim: int | None) -> Format | None:
    """Digits are ASCII ``[0-9]`` (``\\d`` took "bsr２x２" and "ds:١,0"; the DSL refuses such digits too)."""
    named = {"csr": CSR, "csc": CSC, "dcsr": DCSR, "dense": Dense, "sparse_vector": sparse_vector()}
    if key in named:
        return named[key]
    if match := re.fullmatch(r"(coo|csf)([0-9]*)", key):
        order = int(match.group(2) or ndim or (2 if match.group(1) == "coo" else 3))
        return coo(order) if match.group(1) == "coo" else csf(order)
    if match := re.fullmatch(r"bsr([0-9]+)x([0-9]+)", key):
        return BSR(int(match.group(1)), int(match.group(2)))
    if match := re.fullmatch(r"([0-9]+):([0-9]+)", key):
        return NM(int(match.group(1)), int(match.group(2)))
    if match := re.fullmatch(r"([dsuqc]+)(?::([0-9]+(?:,[0-9]+)*))?", key):
        letters = match.group(1)
        if len(letters) > MAX_ORDER:
            raise FormatError(f"format {key!r} has {len(letters)} levels, more than {MAX_ORDER}; tensors have 1 to 3 "
                              f"dimensions")
        order = [int(x) for x in match.group(2).split(",")] if match.group(2) else list(range(len(letters)))
        if sorted(order) != list(range(len(letters))):
            raise FormatError(f"ordering {order} in {key!r} is not a permutation of 0..{len(letters) - 1}")
        return Format(tuple(_LETTERS[c] for c in letters), _ordered(*order), name=key)
    return None


def as_format(value: Format | str, ndim: int | None = None) -> Format:
    """Accept a ``Format`` or its string form; check the rank when known."""
    if isinstance(value, Format):
        if ndim is not None and value.ndim is not None and value.ndim != ndim:
            raise FormatError(f"format {value} stores {value.ndim}-d tensors, but the operand has {ndim} indices")
        return value
    if isinstance(value, str):
        return parse_format(value, ndim)
    raise FormatError(f"a format must be a sparse_mlir Format or a string like 'csr', got {type(value).__name__}")


def format_to_json(fmt: Format) -> dict[str, Any]:
    """A format as plain JSON data, every field included (the name too): what signatures and tensor files store."""
    return {"name": fmt.name, "pos_width": fmt.pos_width, "crd_width": fmt.crd_width,
            "levels": [[lvl.kind.value, lvl.unique, lvl.ordered, lvl.n, lvl.m] for lvl in fmt.levels],
            "dim_to_lvl": [[e.dim, e.op, e.factor] for e in fmt.dim_to_lvl]}


def format_from_json(data: dict[str, Any]) -> Format:
    """The format ``format_to_json`` wrote."""
    levels = tuple(Level(LevelKind(k), unique=u, ordered=o, n=n, m=m) for k, u, o, n, m in data["levels"])
    exprs = tuple(LevelExpr(d, op, f) for d, op, f in data["dim_to_lvl"])
    return Format(levels, exprs, pos_width=data["pos_width"], crd_width=data["crd_width"], name=data["name"])
