"""The CPU paged-attention kernel (``csrc/paged_attention.cpp``): built on first use with the
system C++ compiler, loaded with ctypes, called on tensors in place.

Why this shape: the kernel includes no torch headers and exports plain C functions, so a
build takes a few seconds instead of the minute a torch extension needs, and needs neither
ninja nor torch at ``pip install`` time (a build-time torch would be the multi-GB CUDA wheel
in pip's isolated build environment). It is compiled with ``-march=native`` for the CPU it
runs on; the library's name carries a digest of the source, the flags and the CPU's feature
flags, so a changed source or a different CPU never loads a stale build. Builds are cached
in ``$TANDEM_KERNEL_CACHE`` (default ``~/.cache/tandem/kernels``); concurrent first uses
(pytest-xdist workers, several engine processes) take a file lock, the first one builds and
the others load its result. Where no compiler exists or the build fails, callers get None
and use the torch reference path; that is logged once per process.
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
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_i64p = ctypes.POINTER(ctypes.c_int64)


class KernelBuildError(RuntimeError):
    """No C++ compiler here, or the build failed; the message says which."""


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
    """Link the kernel to the OpenMP runtime torch itself uses. Two runtimes in one process
    would each keep a pool of threads spinning after every parallel region, and the two
    pools would take the cores from each other. Wheels that ship their libgomp under the
    plain soname share it with a default ``-fopenmp`` link; renamed copies (auditwheel's
    ``libgomp-<hash>.so.1``) are linked by path."""
    torch_lib = torch_lib or Path(torch.__file__).parent / "lib"
    bundled = sorted(torch_lib.glob("libgomp*.so*"))
    if not bundled or bundled[0].name == "libgomp.so.1":
        return ["-fopenmp"]
    return [str(bundled[0]), f"-Wl,-rpath,{bundled[0].parent}"]


def library_path(build_dir: Path, compiler: str) -> Path:
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join((compiler, *FLAGS, *openmp_link_args())).encode())
    digest.update(_cpu_fingerprint().encode())
    return build_dir / f"libtandem_paged_attention-{digest.hexdigest()[:16]}.so"


def build_library(build_dir: Path | None = None) -> Path:
    """The kernel's shared library under ``build_dir``, built if this source, flag set and
    CPU have no build there yet. Safe when several processes or threads build at once."""
    compiler = find_cxx()
    if compiler is None:
        raise KernelBuildError("no C++ compiler (c++, g++ or clang++; or set CXX)")
    build_dir = build_dir or kernel_cache_dir()
    target = library_path(build_dir, compiler)
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
            [compiler, *FLAGS, "-c", str(SOURCE), "-o", objects],
            [compiler, "-shared", objects, "-o", scratch, *openmp_link_args()],
        ]
        started = time.perf_counter()
        try:
            for command in steps:
                result = subprocess.run(command, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    Path(scratch).unlink(missing_ok=True)
                    raise KernelBuildError(
                        f"building the paged-attention kernel failed: {' '.join(command)}\n"
                        f"{result.stderr}"
                    )
        finally:
            Path(objects).unlink(missing_ok=True)
        os.replace(scratch, target)
        logger.info(
            "built the CPU paged-attention kernel in %.1f s: %s",
            time.perf_counter() - started,
            target,
        )
    return target


class NativePagedAttention:
    """The loaded kernel. Callers pass contiguous int64 index tensors and rows whose last
    dimension is contiguous; the kernel reads the caches where they are."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._supports = lib.tandem_pa_supports
        self._supports.argtypes = [ctypes.c_int64, ctypes.c_int32]
        self._supports.restype = ctypes.c_int
        self._run = lib.tandem_paged_attention
        self._run.argtypes = [
            ctypes.c_void_p,  # out
            ctypes.c_void_p,  # lse
            ctypes.c_void_p,  # q
            ctypes.c_void_p,  # k_cache
            ctypes.c_void_p,  # v_cache
            ctypes.c_void_p,  # block_tables
            ctypes.c_void_p,  # table_row
            ctypes.c_void_p,  # kv_lens
            *([ctypes.c_int64] * 10),
            ctypes.c_float,
            ctypes.c_int32,
            ctypes.c_int32,
        ]
        self._run.restype = ctypes.c_int

    def supports(self, head_dim: int, dtype: torch.dtype) -> bool:
        code = _DTYPES.get(dtype)
        return code is not None and bool(self._supports(head_dim, code))

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        table_row: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Query token i attends the first ``kv_lens[i]`` cached tokens of the sequence in
        row ``table_row[i]`` of ``block_tables``. ``q``/``out`` [N, H, D]; caches
        [num_blocks, block_size, Hkv, D]; ``lse`` (float32 [N, H]) receives the log-sum-exp
        of each row's scaled scores, for merging with attention computed elsewhere."""
        num_queries, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        for t in (q, out):
            if t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError("q and out need contiguous [H, D] rows")
        for t in (block_tables, table_row, kv_lens):
            if t.dtype is not torch.int64 or t.stride(-1) != 1:
                raise ValueError("index tensors must be int64 with a contiguous last dim")
        if k_cache.stride() != v_cache.stride() or not k_cache.is_contiguous():
            raise ValueError("the K and V caches must be contiguous and alike")
        if lse is not None and (lse.dtype is not torch.float32 or not lse.is_contiguous()):
            raise ValueError("lse must be a contiguous float32 [N, H] tensor")
        code = self._run(
            out.data_ptr(),
            lse.data_ptr() if lse is not None else None,
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            table_row.data_ptr(),
            kv_lens.data_ptr(),
            num_queries,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            q.stride(0),
            out.stride(0),
            block_tables.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            scale,
            _DTYPES[q.dtype],
            torch.get_num_threads(),
        )
        if code != 0:
            raise ValueError(
                f"the paged-attention kernel refused its arguments (code {code}): "
                f"heads {num_heads}/{num_kv_heads}, head_dim {head_dim}, dtype {q.dtype}"
            )


def load_native_paged_attention(build_dir: Path | None = None) -> NativePagedAttention | None:
    """Build (if needed) and load the kernel; None, with the reason logged, where it cannot
    be had. ``TANDEM_PAGED_ATTENTION=torch`` forces the reference path."""
    if os.environ.get("TANDEM_PAGED_ATTENTION", "").lower() == "torch":
        logger.info("TANDEM_PAGED_ATTENTION=torch: CPU attention uses the torch reference path")
        return None
    try:
        return NativePagedAttention(build_library(build_dir))
    except (KernelBuildError, OSError) as exc:
        logger.warning(
            "no native CPU paged-attention kernel (%s); attention copies each sequence's "
            "context out of the cache per layer (torch reference path)",
            exc,
        )
        return None


_lock = threading.Lock()
_loaded: list[NativePagedAttention | None] = []


def native_paged_attention() -> NativePagedAttention | None:
    """The process's kernel, built and loaded on first use (so the outcome is logged once)."""
    with _lock:
        if not _loaded:
            _loaded.append(load_native_paged_attention())
        return _loaded[0]
