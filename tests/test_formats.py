"""Formats: presets, the string parser, encodings (checked by MLIR itself), value semantics."""

from __future__ import annotations

import pytest

import sparse_mlir as sm
from sparse_mlir.errors import FormatError
from sparse_mlir.formats import Format, Level, LevelExpr, LevelKind, as_format, coo, parse_format


@pytest.mark.parametrize("text,expected", [
    ("csr", sm.CSR), ("CSR", sm.CSR), ("csc", sm.CSC), ("coo", sm.COO), ("dcsr", sm.DCSR), ("csf", sm.CSF),
    ("dense", sm.Dense), ("bsr2x2", sm.BSR(2, 2)), ("bsr4x8", sm.BSR(4, 8)), ("2:4", sm.NM(2, 4)),
    ("1:4", sm.NM(1, 4)), ("ds", sm.CSR), ("ds:1,0", sm.CSC), ("ss", sm.DCSR), ("uq", sm.COO),
])
def test_parse(text, expected):
    assert parse_format(text) == expected
    assert hash(parse_format(text)) == hash(expected)


def test_parse_rank_dependent_presets():
    assert parse_format("coo", ndim=3) == coo(3)
    assert parse_format("coo3") == coo(3)
    with pytest.raises(FormatError, match="stores 2-d tensors"):
        parse_format("csr", ndim=3)


@pytest.mark.parametrize("bad", ["csx", "bsr2", "2:", "ds:0,0", "ds:1,2", "", "d s"])
def test_parse_errors_name_the_input(bad):
    with pytest.raises(FormatError):
        parse_format(bad)


def test_widths_are_part_of_equality():
    wide = sm.CSR.with_widths(64, 64)
    assert wide != sm.CSR and hash(wide) != hash(sm.CSR)
    assert wide.with_widths(32, 32) == sm.CSR
    with pytest.raises(FormatError):
        sm.CSR.with_widths(12, 32)


def test_formats_are_frozen():
    with pytest.raises(AttributeError):
        sm.CSR.pos_width = 64  # type: ignore[misc]


def test_general_constructor_like_taco():
    csc = Format((Level(LevelKind.DENSE), Level(LevelKind.COMPRESSED)), (LevelExpr(1), LevelExpr(0)))
    assert csc == sm.CSC
    with pytest.raises(FormatError, match="singleton"):
        Format((Level(LevelKind.COMPRESSED), Level(LevelKind.SINGLETON)), (LevelExpr(0), LevelExpr(1)))
    with pytest.raises(FormatError, match="cover dimensions"):
        Format((Level(LevelKind.DENSE),), (LevelExpr(1),))


def test_buffer_names_follow_the_assembler_order():
    assert sm.CSR.buffer_names == ("pos1", "crd1", "values")
    assert sm.COO.buffer_names == ("pos0", "crd0", "crd1", "values")
    assert sm.DCSR.buffer_names == ("pos0", "crd0", "pos1", "crd1", "values")
    assert sm.BSR(2, 2).buffer_names == ("pos1", "crd1", "values")
    assert sm.NM(2, 4).buffer_names == ("crd2", "values")
    assert sm.NM(2, 4).codegen_format.buffer_names == ("pos2", "crd2", "values")


ALL = [sm.CSR, sm.CSC, sm.COO, sm.DCSR, sm.CSF, coo(3), sm.BSR(2, 3), sm.NM(2, 4), sm.NM(1, 8),
       parse_format("ds:1,0"), sm.CSR.with_widths(64, 16)]


@pytest.mark.parametrize("fmt", ALL, ids=str)
def test_encoding_round_trips_through_mlir(fmt):
    from mlir import ir
    from mlir.dialects import sparse_tensor as st

    from sparse_mlir.dialects.encoding import encoding_attr

    with ir.Context():
        attr = encoding_attr(fmt)
        assert isinstance(attr, st.EncodingAttr)
        assert len(attr.lvl_types) == len(fmt.levels)
        assert attr.pos_width == fmt.pos_width and attr.crd_width == fmt.crd_width
        assert ir.Attribute.parse(str(attr)) == attr
    assert str(fmt) == fmt.name and fmt.encoding_text().startswith("#sparse_tensor.encoding")


def test_nm_encoding_is_structured():
    assert "structured[2, 4]" in sm.NM(2, 4).encoding_text()
    assert "compressed" in sm.NM(2, 4).codegen_format.encoding_text()


def test_shape_checks():
    with pytest.raises(FormatError, match="multiple"):
        sm.BSR(2, 2).check_shape((3, 4))
    with pytest.raises(FormatError, match="multiple"):
        sm.NM(2, 4).check_shape((4, 6))
    with pytest.raises(FormatError):
        sm.NM(5, 4)


def test_the_same_widths_give_the_same_format_object():
    """Kernels take an operand on their C-level call when its format is the very object they were built for, so
    equal requests must not make new objects: the own widths give the format itself, others one object each."""
    from sparse_mlir.formats import CSR, parse_format

    assert CSR.with_widths(CSR.pos_width, CSR.crd_width) is CSR and CSR.with_widths() is CSR
    wide = CSR.with_widths(64, 64)
    assert wide is CSR.with_widths(64, 64) is CSR.with_widths(64).with_widths(None, 64)
    assert wide == CSR.with_widths(64, 64) and (wide.pos_width, wide.crd_width) == (64, 64)
    assert wide.with_widths(CSR.pos_width, CSR.crd_width) is CSR and wide.name == CSR.name
    named = parse_format("csr")  # an equal format under its own name keeps that name at other widths
    assert named.with_widths(64, 64).name == named.name


@pytest.mark.parametrize("text", ["bsr２x２", "ds:١,0", "２:４", "coo３"])
def test_format_strings_take_ascii_digits_only(text):
    """``\\d`` matched any Unicode digit, which the DSL refuses; a format string now does too."""
    with pytest.raises(FormatError, match="unknown format"):
        as_format(text, None)
