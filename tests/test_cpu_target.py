"""The CPU the emitters build for: L1-sized N:M panels, and cache keys that name the host of native code."""

from __future__ import annotations

import pytest

from sparse_mlir.compiler.driver import BuildOptions
from sparse_mlir.dialects.native.target import DEFAULT_L1D_BYTES, CpuTarget
from sparse_mlir.lowering import toolchain


def test_a_portable_target_sizes_panels_for_the_smallest_l1():
    assert toolchain.cpu_target("x86-64-v2") == CpuTarget(256, DEFAULT_L1D_BYTES)
    assert toolchain.cpu_target("sapphirerapids").vector_bits == 512
    assert CpuTarget(512, 48 * 1024).panel_bytes == 24 * 1024 and CpuTarget(512, 1024).panel_bytes == 4096


def test_native_reads_this_hosts_l1_data_cache():
    l1 = toolchain.l1d_bytes("native")
    assert 8 * 1024 <= l1 <= 4 << 20


@pytest.mark.parametrize("text, size", [("48K\n", 48 * 1024), ("2048K", 2 << 20), ("1M", 1 << 20), ("512", 512)])
def test_sysfs_cache_sizes(text, size):
    assert toolchain._cache_size(text) == size


@pytest.mark.parametrize("text", ["", "K", "-4K", "0K", "12Q", "9999999M"])
def test_odd_sysfs_sizes_are_refused(text):
    with pytest.raises(ValueError):
        toolchain._cache_size(text)


def test_native_cache_keys_name_the_host_portable_ones_do_not(monkeypatch):
    """A cache shared by machines (a network home) must not give one host's native library to another."""
    native, portable = BuildOptions("cpu", cpu="native"), BuildOptions("cpu", cpu="x86-64-v2")
    assert toolchain.host_cpu_key() in native.key() and toolchain.host_cpu_key() not in portable.key()
    before = native.key()
    monkeypatch.setattr(toolchain, "host_cpu_key", lambda: "another-host")
    import sparse_mlir.compiler.driver as driver

    monkeypatch.setattr(driver, "host_cpu_key", lambda: "another-host")
    assert native.key() != before and portable.key() == BuildOptions("cpu", cpu="x86-64-v2").key()
