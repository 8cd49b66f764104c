"""One exception hierarchy for every user-facing failure.

Each class also derives from the builtin a caller would naturally catch
(``ValueError``, ``TypeError``, ``SyntaxError``), so generic handlers keep
working while ``SparseMLIRError`` catches everything this package raises.
"""

from __future__ import annotations


class SparseMLIRError(Exception):
    """Base class of all sparse_mlir errors."""


class DSLError(SparseMLIRError, ValueError):
    """An expression outside the grammar or with inconsistent indices.

    ``column`` is the 1-based column of the offending token (or ``None``),
    and the message repeats the expression with a caret under it.
    """

    def __init__(self, message: str, expression: str | None = None, column: int | None = None):
        self.expression = expression
        self.column = column
        self.message = message
        if expression is not None and column is not None:
            message = f"{message} (column {column})\n  {expression}\n  {' ' * (column - 1)}^"
        super().__init__(message)

    def __reduce__(self):  # keeps the column when pickled (errors cross the compiler process)
        return type(self), (self.message, self.expression, self.column)


class FormatError(SparseMLIRError, ValueError):
    """An unknown, malformed or unsupported storage format."""


class ShapeError(SparseMLIRError, ValueError):
    """Operand sizes that disagree; the message names both operands."""


class InvalidIndicesError(SparseMLIRError, ValueError):
    """Index buffers that are out of range, non-monotone or of the wrong length."""


class PatternError(SparseMLIRError, ValueError):
    """Values that do not satisfy the N:M pattern their format requires."""


class DTypeError(SparseMLIRError, TypeError):
    """An operand whose dtype differs from the kernel's (nothing is cast silently)."""


class OperandError(SparseMLIRError, TypeError):
    """A kernel call with missing, unknown or unusable operands (e.g. a list where an array is needed)."""


class OptionError(SparseMLIRError, ValueError):
    """An option of ``compile`` or ``export`` outside its choices (``schedule=``, ``emitter=``...)."""


class NotCompiledError(SparseMLIRError, RuntimeError):
    """Something that exists only once a kernel is specialized (its IR, its signature) asked for too early."""


class DeviceError(SparseMLIRError, RuntimeError):
    """A target or device that is unavailable, or arrays on the wrong device."""


class LoweringError(SparseMLIRError, RuntimeError):
    """The MLIR pipeline or the native toolchain failed; carries stage and target."""

    def __init__(self, message: str, *, stage: str, target: str, diagnostics: str = ""):
        self.message = message
        self.stage = stage
        self.target = target
        self.diagnostics = diagnostics
        text = f"lowering failed at stage '{stage}' for target '{target}': {message}"
        if diagnostics:
            text += f"\n{diagnostics}"
        super().__init__(text)

    def __reduce__(self):
        return _lowering_error, (self.message, self.stage, self.target, self.diagnostics)


def _lowering_error(message: str, stage: str, target: str, diagnostics: str) -> LoweringError:
    return LoweringError(message, stage=stage, target=target, diagnostics=diagnostics)
