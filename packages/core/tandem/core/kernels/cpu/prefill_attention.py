"""The CPU prefill-attention kernel (``csrc/prefill_attention.cpp``): causal attention of
prefill chunks over the paged cache, cached context and the chunk's own tokens in one pass,
read in place. Built on first use (see ``native_build``), loaded with ctypes; None where no
compiler exists or the build fails (logged once per process), and the layer keeps the torch
reference path.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from tandem.core.kernels.cpu.attention_library import DTYPE_CODES, AttentionLibrary
from tandem.core.kernels.cpu.native_build import (
    CSRC,
    IsaLevel,
    KernelBuildError,
    log_unbuilt,
)
from tandem.core.kernels.cpu.native_build import build_library as build_native
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "prefill_attention.cpp"


def build_library(
    build_dir: Path | None = None,
    flags: tuple[str, ...] | None = None,
    isa: IsaLevel | None = None,
) -> Path:
    """The kernel's shared library, built if needed (safe under concurrent first uses);
    ``flags`` replace the default compiler flags (tests build other CPUs' paths with them)."""
    if flags is None:
        return build_native(SOURCE, "tandem_prefill_attention", build_dir=build_dir, isa=isa)
    return build_native(SOURCE, "tandem_prefill_attention", flags, build_dir=build_dir, isa=isa)


class NativePrefillAttention(AttentionLibrary):
    """The loaded kernel. Callers pass contiguous int64 index tensors and q/out rows whose
    [H, D] part is contiguous; the kernel reads the caches where they are."""

    # The library's entry point and its head-size and dtype query; another kernel with the
    # same arguments (``amx_prefill``) names its own.
    entry = "tandem_prefill_attention"
    supports_symbol = "tandem_prefill_supports"

    def __init__(self, path: Path) -> None:
        super().__init__(path, self.supports_symbol)
        self._run = getattr(self.lib, self.entry)
        self._run.argtypes = [
            *([ctypes.c_void_p] * 8),  # out, q, k_cache, v_cache, tables, starts, lens, kv lens
            *([ctypes.c_int64] * 10),
            ctypes.c_float,
            ctypes.c_int32,
            ctypes.c_int32,
        ]
        self._run.restype = ctypes.c_int

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
    ) -> None:
        """Sequence ``b``'s chunk is rows ``q_starts[b] .. + q_lens[b]`` of ``q``/``out``
        [N, H, D]; it attends causally the first ``kv_lens[b]`` tokens of the sequence in
        row ``b`` of ``block_tables`` (the chunk's own K/V already in the cache, last).
        Caches [num_blocks, block_size, Hkv, D]."""
        _, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        self.check((q, out), k_cache, v_cache, (block_tables, q_starts, q_lens, kv_lens))
        code = self._run(
            out.data_ptr(),
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            q_starts.data_ptr(),
            q_lens.data_ptr(),
            kv_lens.data_ptr(),
            q_lens.shape[0],
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
            DTYPE_CODES[q.dtype],
            torch.get_num_threads(),
        )
        if code != 0:
            raise ValueError(
                f"the prefill-attention kernel refused its arguments (code {code}): "
                f"heads {num_heads}/{num_kv_heads}, head_dim {head_dim}, dtype {q.dtype}"
            )


def load_native_prefill_attention(
    build_dir: Path | None = None, isa: IsaLevel | None = None
) -> NativePrefillAttention | None:
    """Build (if needed) and load the kernel; None, with the reason logged, where it cannot
    be had. ``TANDEM_PAGED_ATTENTION=torch`` forces the reference path (for both attention
    kernels)."""
    if os.environ.get("TANDEM_PAGED_ATTENTION", "").lower() == "torch":
        return None
    try:
        return NativePrefillAttention(build_library(build_dir, isa=isa))
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(
            logger,
            exc,
            "no native CPU prefill-attention kernel (%s); prefill chunks attend through "
            "torch's SDPA",
            exc,
        )
        return None


# The process's kernel, built and loaded on first use.
native_prefill_attention = ProcessOnce(load_native_prefill_attention)
