"""The package's architecture (issue 15), checked on its sources.

* The import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``):
  the layers, "only the compiler imports MLIR, dialects and lowering", "the
  runtime gets artifacts from ``compiler.driver``", no cycles.  grimp walks
  only the root package's folder, and ``sparse_mlir.dialects``, ``.lowering``
  and ``.tools`` live outside it (``[tool.setuptools.package-dir]``), so the
  check runs ``lint-imports`` on the package laid out as installed: links to
  the source files in a temporary folder.
* An AST walk over every module of the package (the same mapping), which
  does not depend on import-linter: nothing imports the package face
  (``sparse_mlir/__init__.py``), no import cycles (function-level imports
  included), every import of the package's own modules resolves, and a
  function-level import of the package's own modules only where a comment on
  its line or in the comment lines just above says it keeps MLIR out (the one allowed reason:
  a process that only runs cached kernels must not load MLIR).
* ``import sparse_mlir`` loads neither MLIR nor the package's MLIR code.

``python tests/test_architecture.py`` runs ``lint-imports`` the same way and
prints its report.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sparse_mlir"
# a comment naming MLIR (not "sparse_mlir"): the reason a function-level import of the package's own modules may give
_MLIR_REASON = re.compile(r"(?<![\w.])mlir(?!\w)", re.IGNORECASE)


# -- the package as installed ------------------------------------------------------------------------------------

def package_dirs() -> dict[str, Path]:
    """Each package with a folder of its own, by dotted name: ``[tool.setuptools.package-dir]``, root included."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    dirs = {PACKAGE: ROOT / PACKAGE}
    dirs.update({name: ROOT / folder for name, folder in mapping.items() if name == PACKAGE or
                 name.startswith(PACKAGE + ".")})
    return dirs


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name, found where the package-dir mapping puts it."""
    modules: dict[str, Path] = {}
    # shallow mappings first, so a folder mapped to a subpackage wins over a same-named folder inside its parent
    for package, folder in sorted(package_dirs().items(), key=lambda item: item[0].count(".")):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if not all(part.isidentifier() for part in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def stage_package(into: Path) -> Path:
    """Lay the package's modules out under ``into`` as an install would (links, else copies); return ``into``."""
    for name, path in package_modules().items():
        relative = Path(*name.split("."))
        target = into / (relative / "__init__.py" if path.name == "__init__.py" else relative.with_suffix(".py"))
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.symlink(path, target)
        except OSError:
            shutil.copyfile(path, target)
    return into


def run_lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the checkout's ``pyproject.toml``, in ``cwd`` (it puts its working folder first on
    ``sys.path``, so a staged package there is the one grimp walks)."""
    main = "import sys; from importlinter.cli import lint_imports_command; sys.argv[0] = 'lint-imports'; " \
           "lint_imports_command()"
    command = [sys.executable, "-c", main, str(ROOT / "pyproject.toml"), "--no-cache"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)


# -- imports, read from the sources -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Import:
    """One import by a package module of one of the package's own modules."""

    importer: str
    imported: str  # the module it names ("sparse_mlir": the package face); "" when it names no module we have
    statement: str  # the import as written, for messages
    path: Path
    line: int
    end_line: int
    in_function: bool

    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join([*parts, module] if module else parts)


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, importer: str, path: Path, modules: dict[str, Path]):
        self.importer, self.path, self.modules = importer, path, modules
        self.is_package = path.name == "__init__.py"
        self.depth = 0
        self.found: list[Import] = []
        self.root_bound = False  # ``import sparse_mlir.x.y`` binds the name ``sparse_mlir``: attributes of it
        self.root_attributes: list[ast.Attribute] = []

    def _own(self, name: str) -> bool:
        return name == PACKAGE or name.startswith(PACKAGE + ".")

    def _add(self, node: ast.stmt | ast.expr, imported: str, statement: str) -> None:
        self.found.append(Import(self.importer, imported, statement, self.path, node.lineno,
                                 node.end_lineno or node.lineno, self.depth > 0))

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not self._own(alias.name):
                continue
            written = f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")
            if alias.name != PACKAGE and alias.asname is None:
                self.root_bound = True
            self._add(node, alias.name if alias.name in self.modules else "", written)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve_relative(self.importer, self.is_package, node.level, node.module)
        if not self._own(base):
            return
        for alias in node.names:
            written = f"from {'.' * node.level}{node.module or ''} import {alias.name}"
            submodule = f"{base}.{alias.name}"
            if alias.name != "*" and submodule in self.modules:
                self._add(node, submodule, written)  # a submodule: not the package's __init__
            else:
                self._add(node, base if base in self.modules else "", written)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and self._own(node.args[0].value):
            target = node.args[0].value
            self._add(node, target if target in self.modules else "", f"import_module({target!r})")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == PACKAGE:
            self.root_attributes.append(node)
        self.generic_visit(node)


@dataclass
class ModuleImports:
    imports: list[Import]
    face_attributes: list[tuple[int, str]]  # ``sparse_mlir.X`` where X is no submodule, after ``import sparse_mlir.y``


def read_imports(modules: dict[str, Path] | None = None) -> dict[str, ModuleImports]:
    modules = package_modules() if modules is None else modules
    out: dict[str, ModuleImports] = {}
    for name, path in modules.items():
        collector = _ImportCollector(name, path, modules)
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        face = [(a.lineno, f"{PACKAGE}.{a.attr}") for a in collector.root_attributes
                if collector.root_bound and f"{PACKAGE}.{a.attr}" not in modules]
        out[name] = ModuleImports(collector.found, face)
    return out


def comment_lines(path: Path) -> dict[int, str]:
    """The comments of a file, by line."""
    comments: dict[int, str] = {}
    with path.open("rb") as f:
        for token in tokenize.tokenize(f.readline):
            if token.type == tokenize.COMMENT:
                comments[token.start[0]] = token.string
    return comments


def comments_at(path: Path, line: int, end_line: int, comments: dict[int, str]) -> list[str]:
    """The comments on lines ``line..end_line`` of ``path`` and in the block of comment-only lines just above."""
    source = path.read_text(encoding="utf-8").splitlines()
    above = line - 1
    while above >= 1 and source[above - 1].strip().startswith("#"):
        above -= 1
    return [comments[n] for n in range(above + 1, end_line + 1) if n in comments]


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return sorted(components)


def _all_imports() -> Iterator[Import]:
    for found in read_imports().values():
        yield from found.imports


# -- the checks -------------------------------------------------------------------------------------------------------

def test_the_package_dir_mapping_is_walked():
    """The walk sees the folders outside ``sparse_mlir/`` under their installed names (else the rest proves little)."""
    modules = package_modules()
    for package in package_dirs():
        assert package in modules, f"{package}: no __init__.py where [tool.setuptools.package-dir] puts it"
    assert any(m.startswith(f"{PACKAGE}.dialects.") for m in modules)
    assert any(m.startswith(f"{PACKAGE}.lowering.") for m in modules)


def test_import_linter_contracts(tmp_path):
    """``lint-imports`` keeps every contract in pyproject.toml, on the package laid out as installed."""
    pytest.importorskip("importlinter", reason="import-linter is not installed (pip install -e '.[test]')")
    result = run_lint_imports(stage_package(tmp_path / "staged"))
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"lint-imports failed (exit {result.returncode}):\n{report}"
    # the staged graph must hold the packages that live outside sparse_mlir/ (a contract naming a missing module
    # is an error, so a kept contract also proves they were seen; this guards against a silently empty graph)
    assert "BROKEN" not in report and "KEPT" in report, report


def test_nothing_imports_the_package_face():
    """Only ``sparse_mlir/__init__.py`` may take names from ``sparse_mlir`` itself: everything else imports the
    module that defines them (the face imports everything, so importing it from inside makes cycles)."""
    problems = []
    for name, found in read_imports().items():
        if name == PACKAGE:
            continue
        problems += [f"{i.where()}: {i.statement}" for i in found.imports if i.imported == PACKAGE]
        path = package_modules()[name]
        problems += [f"{path.relative_to(ROOT)}:{line}: uses {attr} (the face)" for line, attr in found.face_attributes]
    assert not problems, "imports of the package face:\n" + "\n".join(sorted(problems))


def test_imports_of_the_package_resolve():
    """Every import of a ``sparse_mlir`` module names a module that exists (where the package-dir mapping puts it)."""
    problems = [f"{i.where()}: {i.statement}" for i in _all_imports() if not i.imported]
    assert not problems, "imports of package modules that do not exist:\n" + "\n".join(sorted(problems))


def test_no_import_cycles():
    """No cycle among the package's modules, function-level imports included (the face is left out: importing it
    from inside is its own failure above)."""
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], list[str]] = {}
    for i in _all_imports():
        if i.imported and i.imported != PACKAGE and i.importer != PACKAGE and i.imported != i.importer:
            edges.setdefault(i.importer, set()).add(i.imported)
            lines.setdefault((i.importer, i.imported), []).append(f"{i.where()}: {i.statement}")
    cycles = find_cycles(edges)
    report = []
    for members in cycles:
        report.append("cycle among " + ", ".join(members) + ":")
        report += [f"    {line}" for a in members for b in sorted(edges.get(a, ())) if b in members
                   for line in lines[a, b]]
    assert not cycles, "\n".join(report)


def test_function_level_imports_only_keep_mlir_out():
    """A function-level import of the package's own modules only where it keeps MLIR out of a process that only
    runs cached kernels, and a comment on its line, or in the comment lines just above it, says so."""
    problems = []
    comments: dict[Path, dict[int, str]] = {}
    for i in _all_imports():
        if not i.in_function:
            continue
        if i.path not in comments:
            comments[i.path] = comment_lines(i.path)
        if not any(_MLIR_REASON.search(text) for text in comments_at(i.path, i.line, i.end_line, comments[i.path])):
            problems.append(f"{i.where()}: {i.statement}")
    assert not problems, ("function-level imports of the package's own modules without a comment saying they keep "
                          "MLIR out (import at module level, or break the cycle they avoid):\n"
                          + "\n".join(sorted(problems)))


def test_importing_the_package_loads_no_mlir():
    """``import sparse_mlir`` (what a process that only runs cached kernels does) loads neither the MLIR bindings
    nor the package's code that builds MLIR (``dialects``, ``compiler.build``)."""
    probe = ("import sys, sparse_mlir, sparse_mlir.runtime.artifact\n"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'mlir' or m.startswith(("
             "'sparse_mlir.dialects', 'sparse_mlir.compiler.build')))\n"
             "print('\\n'.join(bad))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not result.stdout.strip(), "import sparse_mlir loaded:\n" + result.stdout


def test_the_checks_see_what_they_should(tmp_path):
    """The AST checks on a small made-up package: a face import, a cycle through a function-level import, an
    allowed lazy import."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from sparse_mlir.a import thing\n")
    (pkg / "a.py").write_text("import sparse_mlir.b\nthing = 1\n\n\ndef f():\n"
                              "    from sparse_mlir.sub import c  # keeps MLIR out of the runtime\n")
    (pkg / "b.py").write_text("import sparse_mlir.sub.c\nsparse_mlir.compile\n\n\ndef g():\n"
                              "    from sparse_mlir import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import thing\nfrom . import helper\nimport sparse_mlir.gone\n")
    modules = {PACKAGE: pkg / "__init__.py", f"{PACKAGE}.a": pkg / "a.py", f"{PACKAGE}.b": pkg / "b.py",
               f"{PACKAGE}.sub": pkg / "sub" / "__init__.py", f"{PACKAGE}.sub.c": pkg / "sub" / "c.py"}
    found = read_imports(modules)
    imports = [i for f in found.values() for i in f.imports]
    assert {(i.importer, i.imported) for i in imports} == {
        (PACKAGE, f"{PACKAGE}.a"), (f"{PACKAGE}.a", f"{PACKAGE}.b"), (f"{PACKAGE}.a", f"{PACKAGE}.sub.c"),
        (f"{PACKAGE}.b", f"{PACKAGE}.sub.c"), (f"{PACKAGE}.b", f"{PACKAGE}.a"), (f"{PACKAGE}.sub.c", PACKAGE),
        (f"{PACKAGE}.sub.c", f"{PACKAGE}.sub"), (f"{PACKAGE}.sub.c", "")}
    assert found[f"{PACKAGE}.b"].face_attributes == [(2, f"{PACKAGE}.compile")]
    lazy = {i.importer: i for i in imports if i.in_function}
    assert set(lazy) == {f"{PACKAGE}.a", f"{PACKAGE}.b"}
    comments = comment_lines(modules[f"{PACKAGE}.a"])
    assert _MLIR_REASON.search(comments[lazy[f"{PACKAGE}.a"].line])
    assert not _MLIR_REASON.search("# sparse_mlir.x is imported here")
    edges: dict[str, set[str]] = {}
    for i in imports:
        if i.imported and i.imported != PACKAGE and i.importer != PACKAGE:
            edges.setdefault(i.importer, set()).add(i.imported)
    assert find_cycles(edges) == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        done = run_lint_imports(stage_package(Path(folder) / "staged"))
    print(done.stdout + done.stderr, end="")
    sys.exit(done.returncode)
