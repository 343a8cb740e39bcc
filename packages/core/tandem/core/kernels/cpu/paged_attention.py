"""The CPU decode-attention kernel (``csrc/paged_attention.cpp``): built on first use (see
``native_build``), loaded with ctypes, called on tensors in place. Where no compiler exists or
the build fails, callers get None and use the torch reference path; that is logged once per
process.
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

SOURCE = CSRC / "paged_attention.cpp"

_i64p = ctypes.POINTER(ctypes.c_int64)


def build_library(build_dir: Path | None = None, isa: IsaLevel | None = None) -> Path:
    """The kernel's shared library, built if needed (safe under concurrent first uses)."""
    return build_native(SOURCE, "tandem_paged_attention", build_dir=build_dir, isa=isa)


class NativePagedAttention(AttentionLibrary):
    """The loaded kernel. Callers pass contiguous int64 index tensors and rows whose last
    dimension is contiguous; the kernel reads the caches where they are."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "tandem_pa_supports")
        self._run = self.lib.tandem_paged_attention
        self._run.argtypes = [
            ctypes.c_void_p,  # out
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
    ) -> None:
        """Query token i attends the first ``kv_lens[i]`` cached tokens of the sequence in
        row ``table_row[i]`` of ``block_tables`` (none: a zero output). ``q``/``out``
        [N, H, D]; caches [num_blocks, block_size, Hkv, D]."""
        num_queries, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        self.check((q, out), k_cache, v_cache, (block_tables, table_row, kv_lens))
        code = self._run(
            out.data_ptr(),
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
            DTYPE_CODES[q.dtype],
            torch.get_num_threads(),
        )
        if code != 0:
            raise ValueError(
                f"the paged-attention kernel refused its arguments (code {code}): "
                f"heads {num_heads}/{num_kv_heads}, head_dim {head_dim}, dtype {q.dtype}"
            )


def load_native_paged_attention(
    build_dir: Path | None = None, isa: IsaLevel | None = None
) -> NativePagedAttention | None:
    """Build (if needed) and load the kernel; None, with the reason logged, where it cannot
    be had. ``TANDEM_PAGED_ATTENTION=torch`` forces the reference path."""
    if os.environ.get("TANDEM_PAGED_ATTENTION", "").lower() == "torch":
        logger.info("TANDEM_PAGED_ATTENTION=torch: CPU attention uses the torch reference path")
        return None
    try:
        return NativePagedAttention(build_library(build_dir, isa))
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(
            logger,
            exc,
            "no native CPU paged-attention kernel (%s); attention copies each sequence's "
            "context out of the cache per layer (torch reference path)",
            exc,
        )
        return None


# The process's kernel, built and loaded on first use.
native_paged_attention = ProcessOnce(load_native_paged_attention)
