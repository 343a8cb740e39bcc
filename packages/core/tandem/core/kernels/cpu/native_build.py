"""Building the CPU kernels under ``csrc/`` on first use with the system C++ compiler.

Why this shape: the kernels include no torch headers and export plain C functions loaded
with ctypes, so a build takes a second or two instead of the minute a torch extension needs,
and needs neither ninja nor torch at ``pip install`` time (a build-time torch would be the
multi-GB CUDA wheel in pip's isolated build environment). They are compiled with
``-march=native`` for the CPU they run on; a library's name carries a digest of its source,
flags and the CPU's feature flags, so a changed source or another CPU never loads a stale
build. Builds are cached in ``$TANDEM_KERNEL_CACHE`` (default ``~/.cache/tandem/kernels``);
concurrent first uses (pytest-xdist workers, several engine processes) take a file lock, the
first builds and the others load its result.

``TANDEM_CPU_ISA`` caps the instruction sets the kernels are built for and chosen by
(``native``, the default; ``avx2``: what a CPU without AVX-512 and AMX runs; ``portable``:
the plain C++ loops, no AVX at all), so a developer on an AVX-512 machine runs the code an
AVX2 user's machine runs, and the suite tests every variant a machine can execute.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.device.cpu import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC")


class KernelBuildError(RuntimeError):
    """No C++ compiler here, or the build failed; the message says which."""


class NoCompilerError(KernelBuildError):
    """No C++ compiler on this host: every library is missing for the same reason, which
    ``startup`` says once for all of them."""


def log_unbuilt(log: logging.Logger, exc: BaseException, message: str, *args: object) -> None:
    """A loader's note that its library cannot be had: a warning for a failed build, a debug
    line where only the compiler is missing (warned about once, at start-up)."""
    level = logging.DEBUG if isinstance(exc, NoCompilerError) else logging.WARNING
    log.log(level, message, *args)


_X86 = platform.machine() in ("x86_64", "AMD64", "i686")
# 512-bit vectors for the loops the compiler vectorises (SiLU, norms, rotary) where the CPU
# has them: GCC picks 256 for -march=native on server parts, and the bfloat16 SiLU runs
# ~1.4x faster with 512. No effect where the ISA level hides AVX-512.
WIDE_VECTOR_FLAGS: tuple[str, ...] = ("-mprefer-vector-width=512",) if _X86 else ()


@dataclass(frozen=True)
class IsaLevel:
    """How far up this CPU's instruction sets the kernels may reach: compiler switches
    appended to ``-march=native`` (so below the cap the code is what this CPU's own build
    is), and the /proc/cpuinfo flags the Python side must then not count on."""

    name: str
    switches: tuple[str, ...]
    hidden_prefixes: tuple[str, ...]

    def cpu_flags(self) -> frozenset[str]:
        """This CPU's flags as kernels built at this level may use them."""
        return frozenset(f for f in cpu_flags() if not f.startswith(self.hidden_prefixes))

    def flags(self, base: Sequence[str]) -> tuple[str, ...]:
        return (*base, *self.switches)


NATIVE_ISA = IsaLevel("native", (), ())
# GCC's -mno-avx512f turns off every AVX-512 extension and -mno-amx-tile every AMX one;
# -mno-avx turns off AVX, AVX2, FMA and what builds on them. AVX-VNNI (256-bit) stays with
# avx2, as it does on the AVX2-class CPUs that have it.
ISA_LEVELS: dict[str, IsaLevel] = {
    "native": NATIVE_ISA,
    "avx2": IsaLevel("avx2", ("-mno-avx512f", "-mno-amx-tile"), ("avx512", "amx")),
    "portable": IsaLevel("portable", ("-mno-avx", "-mno-amx-tile"), ("avx", "fma", "f16c", "amx")),
}


# What ``tandem_compiled_isa()`` of a library built with vec_math.h answers, by name.
_COMPILED_PATHS = {0: "portable", 1: "avx2", 2: "avx512"}


def c_function(function: ctypes._NamedFuncPointer, argtypes: list[Any]) -> ctypes._NamedFuncPointer:
    """``function`` of a kernel library with its C argument types, returning a C int (the
    status every kernel entry point here returns)."""
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def compiled_path(lib: ctypes.CDLL) -> str:
    """Which of its code paths a kernel library was built with: ``avx512``, ``avx2`` or
    ``portable`` (the plain loops)."""
    function = lib.tandem_compiled_isa
    function.argtypes = []
    function.restype = ctypes.c_int
    return _COMPILED_PATHS.get(int(function()), "unknown")


def expected_path(isa: IsaLevel) -> str:
    """The code path a library built at ``isa`` on this CPU should report."""
    flags = isa.cpu_flags()
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "portable"


def isa_levels() -> list[IsaLevel]:
    """The levels this machine can build and run, highest first (only ``native`` off x86,
    where no kernel has intrinsics of its own)."""
    return list(ISA_LEVELS.values()) if _X86 else [NATIVE_ISA]


def selected_isa() -> IsaLevel:
    """The level ``TANDEM_CPU_ISA`` names (default ``native``); an unknown name is an error
    that lists the known ones."""
    name = os.environ.get("TANDEM_CPU_ISA", "native").strip().lower() or "native"
    level = ISA_LEVELS.get(name)
    if level is None:
        raise KernelBuildError(
            f"TANDEM_CPU_ISA={name!r} is not a level; use one of {', '.join(ISA_LEVELS)}"
        )
    return level if _X86 else NATIVE_ISA


# The define of the AMX kernels' test builds, whose tile instructions are emulated in
# software as Intel documents them (csrc/amx_tiles.h), so any CPU runs their code.
AMX_EMULATION_DEFINE = "TANDEM_AMX_EMULATE"
# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): x86-64 Linux's syscall number, the
# request and the AMX tile data's state component (asm/prctl.h, asm/unistd_64.h).
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def amx_tiles_granted() -> bool:
    """Whether Linux grants this process the AMX tile state. Asking is what grants it (for
    every thread of the process); without it the first tile instruction kills the process."""
    if platform.machine() != "x86_64" or platform.system() != "Linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0


def find_cxx() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def kernel_cache_dir() -> Path:
    override = os.environ.get("TANDEM_KERNEL_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem" / "kernels"


def _cpu_fingerprint() -> str:
    """The CPU's model and feature flags: what ``-march=native`` compiles for."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            lines = [
                line.strip()
                for line in handle
                if line.startswith(("flags", "model name", "Features", "CPU part"))
            ]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def openmp_link_args(torch_lib: Path | None = None) -> list[str]:
    """Link a kernel to the OpenMP runtime torch itself uses. Two runtimes in one process
    would each keep a pool of threads spinning after every parallel region, and the two
    pools would take the cores from each other. Wheels that ship their libgomp under the
    plain soname share it with a default ``-fopenmp`` link; renamed copies (auditwheel's
    ``libgomp-<hash>.so.1``) are linked by path."""
    torch_lib = torch_lib or Path(torch.__file__).parent / "lib"
    bundled = sorted(torch_lib.glob("libgomp*.so*"))
    if not bundled or bundled[0].name == "libgomp.so.1":
        return ["-fopenmp"]
    return [str(bundled[0]), f"-Wl,-rpath,{bundled[0].parent}"]


def library_path(
    source: Path, stem: str, flags: Sequence[str], build_dir: Path, compiler: str
) -> Path:
    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    # The headers beside it (shared helpers) are part of what gets built.
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join((compiler, *flags, *openmp_link_args())).encode())
    digest.update(_cpu_fingerprint().encode())
    return build_dir / f"lib{stem}-{digest.hexdigest()[:16]}.so"


def build_library(
    source: Path,
    stem: str,
    flags: Sequence[str] = BASE_FLAGS,
    build_dir: Path | None = None,
    isa: IsaLevel | None = None,
) -> Path:
    """``source``'s shared library under ``build_dir``, built if this source, flag set and
    CPU have no build there yet, for the instruction sets ``isa`` allows (default: the
    ``TANDEM_CPU_ISA`` level). Safe when several processes or threads build at once."""
    flags = (isa or selected_isa()).flags(flags)
    compiler = find_cxx()
    if compiler is None:
        raise NoCompilerError("no C++ compiler (c++, g++ or clang++; or set CXX)")
    build_dir = build_dir or kernel_cache_dir()
    target = library_path(source, stem, flags, build_dir, compiler)
    if target.is_file():
        return target
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / f".{target.stem}.lock", "w") as lock:
        # The first process builds; the others wait here and find its result.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        fd, scratch = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=build_dir)
        os.close(fd)
        objects = scratch + ".o"
        steps = [
            [compiler, *flags, "-c", str(source), "-o", objects],
            [compiler, "-shared", objects, "-o", scratch, *openmp_link_args()],
        ]
        started = time.perf_counter()
        try:
            for command in steps:
                result = subprocess.run(command, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    Path(scratch).unlink(missing_ok=True)
                    raise KernelBuildError(
                        f"building {source.name} failed: {' '.join(command)}\n{result.stderr}"
                    )
        finally:
            Path(objects).unlink(missing_ok=True)
        os.replace(scratch, target)
        logger.info(
            "built the CPU kernels of %s in %.1f s: %s",
            source.name,
            time.perf_counter() - started,
            target,
        )
    return target
