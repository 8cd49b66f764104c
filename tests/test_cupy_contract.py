"""The package against real CuPy's API: every CuPy name and call it makes must exist and bind in real CuPy.

The GPU runtime once called ``launchKernel(function.ptr, ...)`` on a
``cupy.RawKernel`` (the handle is ``RawKernel.kernel.ptr``) and crashed on
every GPU call, while the hand-written stand-in accepted it.  Real CuPy
(``cupy-cuda13x``) imports without a GPU, so these checks read the package's
source and resolve what it uses against the real modules and classes:

- every attribute chain rooted at ``cupy``/``cp``/``cupyx`` (or a ``csp``-style
  import alias, or the ``cupy()`` loader), followed through local variables,
  tuples, comprehensions, ``for`` targets and same-class method results, so
  ``module.get_function(...)`` is known to be a ``RawKernel`` (CuPy's docstring
  says what a function returns) and ``.ptr`` on it is flagged;
- every call of a real CuPy callable binds against its real signature (for
  Cython built-ins, the one embedded in its docstring), including the
  starred arguments of ``cupy.cuda.driver.launchKernel``.
"""

from __future__ import annotations

import ast
import importlib
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import cupy
import cupyx.scipy.sparse

import support.fake_cupy as fake_cupy
from support.fake_cupy import documented_attributes, real_signature

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("sparse_mlir", "dialects", "lowering", "tools")  # sparse_mlir's package-dir mapping


def _sources() -> list[Path]:
    files = [p for d in PACKAGE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    files += sorted((ROOT / "benchmarks" / "gpu").glob("*.py"))
    return [p for p in files if re.search(r"\bcupy\b|\bcp\.|\bcupyx\b", p.read_text())]


# -- abstract values ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Real:
    """A real CuPy object: module, class, function or constant."""
    obj: Any
    path: str


@dataclass(frozen=True)
class Inst:
    """An instance of a real CuPy class."""
    cls: type


@dataclass(frozen=True)
class Method:
    """A method of a real CuPy class, reached through an instance."""
    cls: type
    name: str


@dataclass(frozen=True)
class Tup:
    items: tuple


@dataclass(frozen=True)
class Seq:
    element: Any


LOADER = object()  # the package's ``cupy()``: returns the module


def _returned(obj: Any) -> Any:
    """What a CuPy callable returns, from the ``Returns:`` section of its docstring (``RawKernel: ...``)."""
    found = re.search(r"Returns:\s*\n\s*([\w.]+)\s*:", obj.__doc__ or "")
    if found is None:
        return None
    name = found.group(1).removeprefix("cupy.")
    for base in (cupy, cupy.cuda):
        target: Any = base
        for part in name.split("."):
            target = getattr(target, part, None)
        if isinstance(target, type):
            return Inst(target)
    return None


def _has(cls: type, name: str) -> bool:
    return hasattr(cls, name) or name in documented_attributes(cls) or any(
        name in documented_attributes(base) for base in cls.__mro__)


class Checker:
    """Walks one file, evaluating expressions to abstract values; ``problems`` are (line, message)."""

    def __init__(self, tree: ast.Module, starred: dict[str, int] | None = None):
        self.tree = tree
        self.problems: list[tuple[int, str]] = []
        self.starred = starred or {}  # lengths of starred ``x.name`` / ``x.name(...)`` arguments, by name
        self.calls: list[tuple[int, str, int]] = []  # (line, real callable, bound positional count)
        self.methods: dict[str, ast.FunctionDef] = {}
        self.returns: dict[str, Any] = {}
        self.globals: dict[str, Any] = {"cp": Real(cupy, "cupy")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ("cupy", "cupyx"):
                        if alias.asname:
                            self.globals[alias.asname] = Real(importlib.import_module(alias.name), alias.name)
                        else:
                            top = alias.name.split(".")[0]
                            self.globals[top] = Real(importlib.import_module(top), top)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if node.module and node.module.split(".")[0] in ("cupy", "cupyx"):
                        module = importlib.import_module(node.module)
                        if not hasattr(module, alias.name):
                            self.problems.append((node.lineno, f"{node.module} has no {alias.name}"))
                        else:
                            self.globals[alias.asname or alias.name] = Real(getattr(module, alias.name),
                                                                            f"{node.module}.{alias.name}")
                    elif alias.name == "cupy" and (node.module or "").endswith("tensor.device"):
                        self.globals[alias.asname or "cupy"] = LOADER
            elif isinstance(node, ast.FunctionDef) and node.name == "cupy" and node in tree.body:
                self.globals["cupy"] = LOADER

    def run(self) -> list[tuple[int, str]]:
        self._body(self.tree.body, dict(self.globals))
        self.problems = sorted(set(self.problems))  # a method read again for its returns reports again
        return self.problems

    # statements
    def _body(self, body: list[ast.stmt], env: dict[str, Any]) -> None:
        for stmt in body:
            self._stmt(stmt, env)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, env: dict[str, Any]) -> Any:
        inner = dict(env)
        for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
            inner[arg.arg] = Real(cupy, "cupy") if arg.arg == "cp" else None
        if isinstance(node, ast.Lambda):
            return self._expr(node.body, inner)
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self._expr(default, env)
        returned: list[Any] = []
        inner["<returns>"] = returned
        self._body(node.body, inner)
        return next((r for r in reversed(returned) if r is not None), None)

    def _stmt(self, stmt: ast.stmt, env: dict[str, Any]) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._function(stmt, env)
            env[stmt.name] = None
        elif isinstance(stmt, ast.ClassDef):
            methods = {s.name: s for s in stmt.body if isinstance(s, ast.FunctionDef)}
            saved, self.methods = self.methods, methods
            for base in stmt.bases:
                self._expr(base, env)
            self._body(stmt.body, dict(env))
            self.methods = saved
        elif isinstance(stmt, ast.Assign):
            value = self._expr(stmt.value, env)
            for target in stmt.targets:
                self._bind(target, value, env)
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            value = self._expr(stmt.value, env) if stmt.value is not None else None
            self._bind(stmt.target, value if isinstance(stmt, ast.AnnAssign) else None, env)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            self._bind(stmt.target, self._element(self._expr(stmt.iter, env)), env)
            self._body(stmt.body + stmt.orelse, env)
        elif isinstance(stmt, ast.Return):
            value = self._expr(stmt.value, env) if stmt.value is not None else None
            if "<returns>" in env:
                env["<returns>"].append(value)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                value = self._expr(item.context_expr, env)
                if item.optional_vars is not None:
                    self._bind(item.optional_vars, value, env)
            self._body(stmt.body, env)
        elif isinstance(stmt, ast.Try):
            self._body(stmt.body, env)
            for handler in stmt.handlers:
                if handler.type is not None:
                    self._expr(handler.type, env)
                if handler.name:
                    env[handler.name] = None
                self._body(handler.body, env)
            self._body(stmt.orelse + stmt.finalbody, env)
        else:
            for field in ast.iter_child_nodes(stmt):
                if isinstance(field, ast.expr):
                    self._expr(field, env)
                elif isinstance(field, ast.stmt):
                    self._stmt(field, env)
            for name in ("body", "orelse"):
                if isinstance(getattr(stmt, name, None), list):
                    self._body(getattr(stmt, name), env)

    def _bind(self, target: ast.expr, value: Any, env: dict[str, Any]) -> None:
        if isinstance(target, ast.Name):
            if value is not None or target.id not in env:  # a known value is kept over a later unknown one
                env[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            items = value.items if isinstance(value, Tup) and len(value.items) == len(target.elts) else \
                (None,) * len(target.elts)
            for elt, item in zip(target.elts, items):
                self._bind(elt.value if isinstance(elt, ast.Starred) else elt, item, env)
        else:
            self._expr(target, env)

    @staticmethod
    def _element(value: Any) -> Any:
        return value.element if isinstance(value, Seq) else None

    # expressions
    def _expr(self, node: ast.expr | None, env: dict[str, Any]) -> Any:
        if node is None:
            return None
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute):
            return self._attribute(node, self._expr(node.value, env))
        if isinstance(node, ast.Call):
            return self._call(node, env)
        if isinstance(node, ast.Tuple):
            return Tup(tuple(self._expr(e, env) for e in node.elts))
        if isinstance(node, ast.List):
            items = [self._expr(e, env) for e in node.elts]
            return Seq(next((i for i in items if i is not None), None))
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            inner = dict(env)
            for generator in node.generators:
                self._bind(generator.target, self._element(self._expr(generator.iter, inner)), inner)
                for condition in generator.ifs:
                    self._expr(condition, inner)
            return Seq(self._expr(node.elt, inner))
        if isinstance(node, ast.DictComp):
            inner = dict(env)
            for generator in node.generators:
                self._bind(generator.target, self._element(self._expr(generator.iter, inner)), inner)
            self._expr(node.key, inner)
            self._expr(node.value, inner)
            return None
        if isinstance(node, ast.Subscript):
            value = self._expr(node.value, env)
            self._expr(node.slice, env)
            if isinstance(value, Tup) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
                return value.items[node.slice.value] if -len(value.items) <= node.slice.value < len(value.items) \
                    else None
            return value.element if isinstance(value, Seq) else None
        if isinstance(node, ast.Lambda):
            self._function(node, env)
            return None
        if isinstance(node, ast.NamedExpr):
            value = self._expr(node.value, env)
            self._bind(node.target, value, env)
            return value
        if isinstance(node, ast.IfExp):
            self._expr(node.test, env)
            body, orelse = self._expr(node.body, env), self._expr(node.orelse, env)
            return body if body is not None else orelse
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self._expr(child, env)
            elif isinstance(child, ast.comprehension):
                self._expr(child.iter, env)
        return None

    def _attribute(self, node: ast.Attribute, base: Any) -> Any:
        name = node.attr
        if isinstance(base, Real):
            if not hasattr(base.obj, name):
                self.problems.append((node.lineno, f"real {base.path} has no attribute {name!r}"))
                return None
            return Real(getattr(base.obj, name), f"{base.path}.{name}")
        if isinstance(base, Inst):
            if not _has(base.cls, name):
                self.problems.append((node.lineno, f"a real {base.cls.__module__}.{base.cls.__name__} has no "
                                                   f"attribute {name!r}"))
                return None
            member = getattr(base.cls, name, None)
            if callable(member) and not isinstance(member, type):
                return Method(base.cls, name)
            return None
        return None

    def _call(self, node: ast.Call, env: dict[str, Any]) -> Any:
        func = node.func
        callee = self._expr(func, env)
        args = [self._expr(a.value if isinstance(a, ast.Starred) else a, env) for a in node.args]
        for keyword in node.keywords:
            self._expr(keyword.value, env)
        if callee is LOADER:
            return Real(cupy, "cupy")
        if isinstance(func, ast.Name) and func.id == "zip":
            return Seq(Tup(tuple(self._element(a) for a in args)))
        if isinstance(func, ast.Name) and func.id == "enumerate" and args:
            return Seq(Tup((None, self._element(args[0]))))
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" \
                and func.attr in self.methods:  # a method of the class being read: what its returns give
            if func.attr not in self.returns:
                self.returns[func.attr] = None  # recursion guard
                self.returns[func.attr] = self._function(self.methods[func.attr], dict(self.globals))
            return self.returns[func.attr]
        if isinstance(callee, Real) and callable(callee.obj):
            self._bind_call(node, callee.obj, callee.path, method=False)
            return Inst(callee.obj) if isinstance(callee.obj, type) else _returned(callee.obj)
        if isinstance(callee, Method):
            real = getattr(callee.cls, callee.name)
            self._bind_call(node, real, f"{callee.cls.__name__}.{callee.name}", method=True)
            return _returned(real)
        return None

    def _bind_call(self, node: ast.Call, real: Any, path: str, method: bool) -> None:
        """The call must bind to the real signature (placeholders for values; starred lengths must be known)."""
        found = real_signature(real, method=method)
        if found is None:
            return
        positional: list[Any] = []
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                inner = arg.value.func if isinstance(arg.value, ast.Call) else arg.value
                name = inner.attr if isinstance(inner, ast.Attribute) else None
                if isinstance(arg.value, (ast.Tuple, ast.List)):
                    positional += [0] * len(arg.value.elts)
                elif name in self.starred:
                    positional += [0] * self.starred[name]
                else:
                    return  # an unknown number of arguments: nothing to check
            else:
                positional.append(0)
        if any(k.arg is None for k in node.keywords):
            return
        try:
            found[0].bind(*positional, **{k.arg: 0 for k in node.keywords})
        except TypeError as err:
            self.problems.append((node.lineno, f"{path}{found[0]} cannot be called this way: {err}"))
            return
        if (node.lineno, path, len(positional)) not in self.calls:  # a method is read again for its returns
            self.calls.append((node.lineno, path, len(positional)))


def _tuple_length(annotation: Any) -> int | None:
    args = typing.get_args(annotation)
    return len(args) if typing.get_origin(annotation) is tuple and args and Ellipsis not in args else None


def _launch_starred() -> dict[str, int]:
    """Lengths of ``*launch.grid_for(...)`` and ``*launch.block``, from ``gpu_program.Launch``'s annotations."""
    from sparse_mlir.abi import gpu_program

    hints = typing.get_type_hints(gpu_program.Launch)
    lengths = {"grid_for": _tuple_length(typing.get_type_hints(gpu_program.Launch.grid_for).get("return")),
               "block": _tuple_length(hints.get("block"))}
    assert all(lengths.values()), f"Launch.grid_for / Launch.block are no longer annotated as fixed tuples: {lengths}"
    return lengths  # type: ignore[return-value]


def check_source(text: str) -> Checker:
    checker = Checker(ast.parse(text), starred=_launch_starred())
    checker.run()
    return checker


# -- the package ----------------------------------------------------------------------------------------------

def _marks(path: Path) -> list[Any]:
    """Marks for one module's contract check (none: every module must bind in real CuPy)."""
    return []


SOURCES = _sources()


def test_the_package_uses_cupy_somewhere():
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"sparse_mlir/runtime/launch.py", "sparse_mlir/tensor/device.py", "sparse_mlir/runtime/tensor_maps.py",
            "benchmarks/gpu/device_check.py", "benchmarks/gpu/tensor_core_check.py"} <= names


@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p), id=p.relative_to(ROOT).as_posix())
                                  for p in SOURCES])
def test_every_cupy_name_and_call_exists_in_real_cupy(path: Path):
    problems = check_source(path.read_text()).problems
    assert not problems, "\n".join(f"{path.relative_to(ROOT)}:{line}: {message}" for line, message in problems)


def test_driver_calls_bind_to_the_real_launch_kernel_and_func_set_attribute():
    """The runtime's two driver calls, with ``*launch.grid_for(...)`` and ``*launch.block`` expanded, bind."""
    checker = check_source((ROOT / "sparse_mlir" / "runtime" / "launch.py").read_text())
    bound = {path.rsplit(".", 1)[-1]: count for _, path, count in checker.calls if ".driver." in path}
    assert bound == {"launchKernel": 11, "funcSetAttribute": 3}, checker.calls
    launch, _ = real_signature(cupy.cuda.driver.launchKernel)
    assert list(launch.parameters) == ["f", "grid_dim_x", "grid_dim_y", "grid_dim_z", "block_dim_x", "block_dim_y",
                                       "block_dim_z", "shared_mem_bytes", "stream", "kernel_params", "extra"]
    attribute, c_types = real_signature(cupy.cuda.driver.funcSetAttribute)
    assert list(attribute.parameters) == ["f", "attribute", "value"] and c_types["f"] == "intptr_t"


# -- the checker finds what it is for (so a clean run above means something) ----------------------------------

SNIPPET = """
import cupy as cp

def load(path, launch):
    module = cp.RawModule(path=path)
    launches = [(launch, module.get_function(name)) for name in ("a", "b")]
    for launch, function in launches:
        cp.cuda.driver.funcSetAttribute({handle}, 8, 65536)
    return launches

class K:
    def _functions(self, cp):
        module = cp.RawModule(path="k.cubin")
        loaded = (module, [(None, module.get_function("k"))])
        return loaded[1]

    def __call__(self, launch):
        cp.cuda.driver.launchKernel({handle2}, *launch.grid_for([]), *launch.block, 0, 0, 0, 0)
        for (launch, function), block in zip(self._functions(cp), []):
            cp.cuda.driver.launchKernel({handle}, *launch.grid_for([]), *launch.block, 0, 0, 0, 0)
"""


def test_the_checker_flags_ptr_on_a_raw_kernel_through_variables_loops_and_methods():
    bad = check_source(SNIPPET.format(handle="function.ptr", handle2="1")).problems
    assert [line for line, message in bad if "RawKernel has no attribute 'ptr'" in message] == [8, 20]
    good = check_source(SNIPPET.format(handle="function.kernel.ptr", handle2="1"))
    assert good.problems == [] and len(good.calls) == 7  # RawModule x2, get_function x2, driver calls x3


@pytest.mark.parametrize(("code", "expected"), [
    ("import cupy as cp\ncp.cuda.driver.cuLaunchKernel(0)", "has no attribute 'cuLaunchKernel'"),
    ("import cupy as cp\ncp.cuda.driver.launchKernel(1, 1, 1, 1, 1, 1, 1, 0, 0, 0)", "missing a required argument"),
    ("import cupy as cp\ncp.cuda.driver.funcSetAttribute(1, 8)", "missing a required argument"),
    ("import cupy as cp\ncp.RawModule('k.cubin', 'x')", "too many positional arguments"),
    ("import cupy as cp\ncp.argsort(x, stable=True)", "unexpected keyword argument 'stable'"),
    ("import cupy as cp\ncp.zeros(3).ctypes", "ndarray has no attribute 'ctypes'"),
    ("import cupyx.scipy.sparse as csp\ncsp.csr_tensor", "has no attribute 'csr_tensor'"),
    ("from sparse_mlir.tensor.device import cupy\ncupy().cuda.get_current_stream().handle", "has no attribute 'handle'"),
])
def test_the_checker_flags_names_and_calls_real_cupy_does_not_have(code, expected):
    problems = check_source(code).problems
    assert any(expected in message for _, message in problems), problems


# -- the stand-in keeps to the real API -----------------------------------------------------------------------

def test_the_stand_in_refuses_what_real_cupy_does_not_have(tmp_path):
    cp, cupyx_modules, record = fake_cupy.build()
    (tmp_path / "k.ptx").write_text(".visible .entry k(\n .param .u64 a\n)\n{}\n")
    kernel = cp.RawModule(path=str(tmp_path / "k.ptx")).get_function("k")
    assert isinstance(kernel, cupy.RawKernel)  # an autospec of the real class
    with pytest.raises(AttributeError):
        kernel.ptr  # the issue-14 crash, now on CPU too
    handle = kernel.kernel.ptr
    with pytest.raises(TypeError, match="not an integer"):
        cp.cuda.driver.launchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, 0, 1, 0)
    with pytest.raises(TypeError):
        cp.cuda.driver.launchKernel(handle, 1, 1, 1, 32, 1, 1, 0, 0, 1)  # 10 of 11 arguments
    with pytest.raises(OverflowError):
        cp.cuda.driver.funcSetAttribute(handle, 8, 2 ** 31)  # int value
    with pytest.raises(TypeError, match="path must be str"):
        cp.RawModule(path=tmp_path / "k.ptx")
    for module, name in [(cp, "RawKernelPointer"), (cp.cuda, "launch"), (cp.cuda.driver, "cuLaunchKernel"),
                         (cp.cuda.runtime, "cudaFree"), (cupyx_modules["cupyx.scipy.sparse"], "csr_tensor")]:
        with pytest.raises(AttributeError, match="real CuPy has none"):
            getattr(module, name)
    with pytest.raises(AttributeError, match="may not offer"):
        cp.cuda.driver.cuLaunchKernel = lambda *a: None
    with pytest.raises(AttributeError):
        cp.cuda.get_current_stream().handle
    with pytest.raises(AttributeError, match="numpy has it, CuPy does not"):
        cp.zeros(3).ctypes
    with pytest.raises(TypeError):
        cp.argsort(cp.zeros(3), stable=True)
    assert cp.cuda.get_current_stream().ptr == 0 and cp.cuda.Device().compute_capability == "90"
    assert record.modules == [str(tmp_path / "k.ptx")]
