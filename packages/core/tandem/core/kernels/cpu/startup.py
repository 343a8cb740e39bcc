"""Every CPU kernel library of the process, built (or loaded from the cache) at start-up, and
what serves which layer on this CPU, said once.

Why at start-up: each library is built by the system compiler on first use (seconds each,
``native_build``). Left to the first forward, the first request waits for all of them and a
host without a compiler is found out by its users. A worker on a CPU device starts
``prepare_cpu_kernels`` beside its weight loading (``preparing_cpu_kernels``), the libraries
build in parallel, and the worker reports loaded (so the server ready, ``/health`` 200) only
once they are in place. Without a compiler one warning says what runs slower and how to fix
it; ``tandem doctor`` prints the same report on demand.
"""

from __future__ import annotations

import logging
import platform
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tandem.core.kernels.cpu.amx_linear import amx_linear
from tandem.core.kernels.cpu.amx_prefill import TILE_MAX_KEYS, TILE_MIN_TOKENS, amx_prefill
from tandem.core.kernels.cpu.avx2_linear import avx2_linear
from tandem.core.kernels.cpu.avx512_linear import avx512_linear
from tandem.core.kernels.cpu.elementwise import native_elementwise
from tandem.core.kernels.cpu.flash_prefill import FLASH_MIN_TOKENS, flash_prefill_dtypes
from tandem.core.kernels.cpu.grouped_moe import grouped_expert_kernel
from tandem.core.kernels.cpu.int4_linear import native_int4_linear
from tandem.core.kernels.cpu.int8_gemm import native_int8
from tandem.core.kernels.cpu.linear_attention import native_linear_attention
from tandem.core.kernels.cpu.moe_routing import native_moe_routing
from tandem.core.kernels.cpu.native_build import (
    find_cxx,
    kernel_cache_dir,
    selected_isa,
)
from tandem.core.kernels.cpu.packed_linear import native_kernel, packing_enabled
from tandem.core.kernels.cpu.paged_attention import native_paged_attention
from tandem.core.kernels.cpu.prefill_attention import native_prefill_attention
from tandem.core.kernels.process_once import ProcessOnce
from tandem.device.cpu import cpuinfo_field

logger = logging.getLogger(__name__)

# The process's libraries, in the order a model load needs them (the linear kernels adopt
# weights as they are packed, at the end of a load; the others at the first forward).
_LIBRARIES: tuple[tuple[str, Callable[[], Any]], ...] = (
    ("AMX linear", amx_linear),
    ("AVX-512 linear", avx512_linear),
    ("AVX2 linear", avx2_linear),
    ("int8 linear", native_int8),
    ("elementwise", native_elementwise),
    ("MoE routing", native_moe_routing),
    ("decode attention", native_paged_attention),
    ("prefill attention", native_prefill_attention),
    ("AMX prefill attention", amx_prefill),
    ("int4 linear", native_int4_linear),
    ("linear attention", native_linear_attention),
)
_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni",
             "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip


@dataclass(frozen=True)
class KernelChoice:
    """What serves one kind of layer on this CPU, and why."""

    role: str
    kernel: str
    why: str


@dataclass(frozen=True)
class CpuKernelReport:
    cpu: str
    features: tuple[str, ...]
    isa: str
    compiler: str | None
    cache: str
    choices: tuple[KernelChoice, ...]

    def describe(self) -> str:
        head = (
            f"CPU kernels on {self.cpu} ({' '.join(self.features) or 'no AVX2'}; "
            f"TANDEM_CPU_ISA={self.isa}; compiler {self.compiler or 'none'}; cache {self.cache})"
        )
        width = max(len(c.role) for c in self.choices)
        rows = [f"  {c.role:<{width}}  {c.kernel}: {c.why}" for c in self.choices]
        return "\n".join([head, *rows])

    @property
    def slower(self) -> list[str]:
        """The roles left on a slower path for want of a built library."""
        return [c.role for c in self.choices if c.kernel.startswith(("torch", "oneDNN"))]


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def compiler_version(compiler: str | None) -> str | None:
    if compiler is None:
        return None
    try:
        result = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return compiler
    first = result.stdout.splitlines()[0] if result.stdout else ""
    return f"{compiler} ({first})" if first else compiler


_TARGETS = {"avx512": "AVX-512", "avx2": "AVX2", "portable": "no AVX (plain loops)"}


def _native_path(library: Any) -> str:
    path = getattr(library, "compiled_path", "unknown")
    return f"native, built for {_TARGETS.get(path, path)}"


def _linear_choice(dtype: torch.dtype) -> KernelChoice:
    role = f"linear {str(dtype).removeprefix('torch.')}"
    if not packing_enabled(dtype):
        why = (
            "TANDEM_GEMM=torch, or this CPU has neither AVX512-BF16 nor AMX for oneDNN to "
            "pack bfloat16"
        )
        return KernelChoice(role, "torch F.linear on plain weights", why)
    kernel = native_kernel(dtype)
    if kernel is None:
        return KernelChoice(
            role,
            "oneDNN on packed weights",
            "no kernel of ours for this dtype and CPU (or TANDEM_GEMM=onednn, or no compiler)",
        )
    detail = f"; {kernel.detail}" if kernel.detail else ""
    return KernelChoice(
        role,
        f"{kernel.name} kernel on oneDNN-packed weights",
        f"batches up to {kernel.max_rows} rows without bias; oneDNN for the rest and for "
        f"weights whose shape or layout it does not read{detail}",
    )


def _experts_choice(dtype: torch.dtype) -> KernelChoice:
    role = f"MoE experts {str(dtype).removeprefix('torch.')}"
    kernel = grouped_expert_kernel(dtype)
    if kernel is None:
        why = "no grouped kernel for this dtype and CPU"
        return KernelChoice(role, "torch, a GEMM per active expert", why)
    why = "every active expert in one call per projection, weights packed at load"
    return KernelChoice(role, f"grouped {kernel.name} kernel", why)


def _int8_choice() -> KernelChoice:
    role = "linear int8 (W8A8)"
    kernels = native_int8()
    if kernels is None:
        why = "no library (TANDEM_INT8=torch, no compiler, or a failed build; see the log)"
        return KernelChoice(role, "torch reference (torch._int_mm)", why)
    why = {
        "AMX-INT8": "this CPU has AMX-INT8 and Linux granted the tile state (tdpbssd)",
        "AVX512-VNNI": "this CPU has AVX512-VNNI (vpdpbusd)",
        "AVX-VNNI": "AVX-VNNI without AVX-512 at this ISA level (vpdpbusd on ymm)",
        "AVX2": "no AVX512-VNNI at this ISA level; exact int16 products (vpmaddwd)",
    }.get(kernels.compiled_path, "no AVX2 at this ISA level")
    return KernelChoice(
        role, f"native {kernels.compiled_path} on weights packed at load, fused", why
    )


def _library_choice(role: str, library: Any, fallback: str, why_fallback: str) -> KernelChoice:
    if library is None:
        return KernelChoice(role, fallback, why_fallback)
    return KernelChoice(role, _native_path(library), "built for this CPU")


def _decode_attention_choice(no_library: str) -> KernelChoice:
    role = "decode attention"
    fallback = "torch reference (copies each sequence's context per layer)"
    library = native_paged_attention()
    if library is None or not library.tiles:
        return _library_choice(role, library, fallback, no_library)
    why = (
        "built for this CPU; bfloat16 batches of at least 4 tokens a thread, 2, 4, 8 or 16 "
        "query heads a KV head and blocks of a multiple of 16 tokens score on AMX tiles, the "
        "rest on vectors"
    )
    return KernelChoice(role, f"{_native_path(library)}, scores on AMX tiles", why)


def _prefill_attention_choice(no_library: str) -> KernelChoice:
    role = "prefill attention"
    library = native_prefill_attention()
    tiles = amx_prefill()
    if library is not None and tiles is None and torch.float32 in flash_prefill_dtypes():
        why = (
            f"built for this CPU; float32 chunks of {FLASH_MIN_TOKENS} tokens or more through "
            "torch's flash attention (1.3-3x the native kernel's speed there on a Zen 3 AVX2 CPU), "
            "the rest native"
        )
        kernel = f"{_native_path(library)}, long float32 chunks through torch's flash attention"
        return KernelChoice(role, kernel, why)
    if library is None or tiles is None:
        return _library_choice(role, library, "torch SDPA", no_library)
    why = (
        f"built for this CPU; bfloat16 chunks of {TILE_MIN_TOKENS} tokens or more in "
        f"sequences of up to {TILE_MAX_KEYS} on AMX tiles, one call a layer for all, the rest "
        "on vectors"
    )
    return KernelChoice(role, f"{_native_path(library)}, long chunks on AMX tiles", why)


def _int4_choice(no_library: str) -> KernelChoice:
    role = "int4 linear (W4A16)"
    kernel = native_int4_linear()
    if kernel is None:
        return KernelChoice(role, "torch reference (dequantizes the weight every call)", no_library)
    why = (
        f"{kernel.describe()}; layers in activation order with their inputs sorted by group "
        "at load (the reference where a rank's groups are uneven)"
    )
    return KernelChoice(role, _native_path(kernel), why)


def build_report() -> CpuKernelReport:
    """The report of what the loaded libraries give (loading any not yet loaded)."""
    isa = selected_isa()
    flags = isa.cpu_flags()
    no_library = "no library (no compiler, a failed build, or switched off; see the log)"
    choices = [
        _linear_choice(torch.float32),
        _linear_choice(torch.bfloat16),
        _experts_choice(torch.float32),
        _experts_choice(torch.bfloat16),
        _int8_choice(),
        _decode_attention_choice(no_library),
        _prefill_attention_choice(no_library),
        _library_choice("norms, rotary, SiLU", native_elementwise(), "torch, op by op", no_library),
        _library_choice(
            "MoE routing (top-k, sort, gather, sum back)",
            native_moe_routing(),
            "torch, op by op",
            no_library,
        ),
        _library_choice(
            "linear attention (conv, delta rule)",
            native_linear_attention(),
            "torch reference (gathers and passes over the gathered states)",
            no_library,
        ),
        _int4_choice(no_library),
    ]
    return CpuKernelReport(
        cpu=cpu_model(),
        features=tuple(f for f in _FEATURES if f in flags),
        isa=isa.name,
        compiler=compiler_version(find_cxx()),
        cache=str(kernel_cache_dir()),
        choices=tuple(choices),
    )


def _prepare() -> CpuKernelReport:
    selected_isa()  # a bad TANDEM_CPU_ISA fails the load, not each library quietly
    # One thread a library: each build is a compiler process, so they overlap each other
    # (and the weight loading beside them).
    with ThreadPoolExecutor(len(_LIBRARIES), thread_name_prefix="tandem-kernel-build") as pool:
        for future in [pool.submit(load) for _, load in _LIBRARIES]:
            future.result()
    return build_report()


def _announce() -> CpuKernelReport:
    report = prepare_cpu_kernels()
    logger.info("%s", report.describe())
    if report.compiler is None:
        logger.warning(
            "no C++ compiler found (c++, g++ or clang++ on PATH, or CXX): %s run on the "
            "slower torch/oneDNN paths, several times slower per decode step. Install one "
            "(Debian/Ubuntu: apt install g++) and restart; `tandem doctor` checks the result.",
            ", ".join(report.slower),
        )
    return report


# Once per process, whatever number of workers reach it.
prepare_cpu_kernels = ProcessOnce(_prepare)
# The log lines, once per process.
announce_cpu_kernels = ProcessOnce(_announce)


@contextmanager
def preparing_cpu_kernels(device_type: str) -> Iterator[None]:
    """Builds the CPU kernels beside the block's work (a model load) on a CPU device, and
    leaves the block only once they are in place; a no-op on other devices."""
    if device_type != "cpu":
        yield
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            announce_cpu_kernels()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the worker's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="tandem-kernel-prepare", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if errors:
        raise errors[0]
