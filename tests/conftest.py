"""Shared fixtures: a seeded rng and a private kernel cache for the test session."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

# one cache for the whole run, isolated from the user's (set before any kernel is compiled)
os.environ.setdefault("SPARSE_MLIR_CACHE_DIR", tempfile.mkdtemp(prefix="sparse_mlir_test_cache_"))

@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def mlir_context():
    """A fresh MLIR context for tests that build IR in this process (``tests/ir``)."""
    from mlir import ir  # only the IR tests load MLIR into the test process

    with ir.Context() as context:
        yield context


@pytest.fixture(autouse=True)
def leaves_the_working_directory_alone():
    """A test that writes into the folder pytest runs from (an export to the CLI's default ``-o .``, say) fails:
    such files land in the user's checkout and, being git-ignored (``*.so``, ``*.o``), go unnoticed."""
    before = set(os.listdir(os.getcwd()))
    yield
    left = sorted(set(os.listdir(os.getcwd())) - before - {".pytest_cache", ".hypothesis"})
    if left:
        pytest.fail(f"the test left files in the working directory {os.getcwd()}: {', '.join(left)}")
