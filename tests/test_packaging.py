"""The wheel holds every package of the source tree: a folder missing from pyproject breaks `pip install .`."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {name: Path(path) for name, path in config["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *relative.parts]) if relative.parts else name)
    missing = sorted(found - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
    assert not sorted(listed - found), "pyproject lists packages that have no folder"


def test_every_non_python_source_file_is_package_data():
    """C sources the package compiles at run time must be declared package data, or an installed wheel lacks
    them while the checkout works."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / path for name, path in config["package-dir"].items()}
    declared = config.get("package-data", {})
    missing = []
    for package in config["packages"]:
        name = max((n for n in folders if package == n or package.startswith(n + ".")), key=len)
        folder = folders[name].joinpath(*package[len(name):].strip(".").split(".")) if package != name \
            else folders[name]
        for path in folder.iterdir():
            if path.suffix in (".c", ".h") and not any(
                    path.match(pattern) for pattern in declared.get(package, [])):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"declare in [tool.setuptools.package-data]: {missing}"
