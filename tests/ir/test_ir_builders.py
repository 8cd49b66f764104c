"""Every kernel builder in ``dialects/`` builds its IR with the MLIR bindings' op builders: none assembles MLIR
text and parses it.  Text hides type errors until parse time, names values by string convention, and cannot
share the loop helpers (``native/loops.py``, ``native/gpu_build.py``); the SpMM, BSR SpMM and Tensor Core
emitters were moved off it with their lowered code checked identical."""

from __future__ import annotations

import re
from pathlib import Path

DIALECTS = Path(__file__).resolve().parents[2] / "dialects"
PARSING = re.compile(r"\b(?:Module|Operation)\.parse\s*\(")


def test_no_kernel_builder_parses_mlir_text():
    sources = sorted(DIALECTS.rglob("*.py"))
    assert len(sources) > 20  # the folder was found
    parsing = [f"{path.relative_to(DIALECTS)}:{number}" for path in sources
               for number, line in enumerate(path.read_text().splitlines(), 1) if PARSING.search(line)]
    assert parsing == []
