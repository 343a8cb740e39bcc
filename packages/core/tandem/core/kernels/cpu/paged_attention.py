"""The CPU decode-attention kernel (``csrc/paged_attention.cpp``): built on first use (see
``native_build``), loaded with ctypes, called on tensors in place. Where no compiler exists or
the build fails, callers get None and use the torch reference path; that is logged once per
process.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.cpu.attention_library import DTYPE_CODES, AttentionLibrary
from tandem.core.kernels.cpu.native_build import (
    AMX_EMULATION_DEFINE,
    BASE_FLAGS,
    CSRC,
    IsaLevel,
    KernelBuildError,
    amx_tiles_granted,
    log_unbuilt,
)
from tandem.core.kernels.cpu.native_build import build_library as build_native
from tandem.core.kernels.process_once import ProcessOnce
from tandem.core.kernels.reference.paged_attention import (
    write_kv_cache as reference_write_kv_cache,
)

logger = logging.getLogger(__name__)

SOURCE = CSRC / "paged_attention.cpp"

_i64p = ctypes.POINTER(ctypes.c_int64)


def build_library(
    build_dir: Path | None = None, isa: IsaLevel | None = None, emulated: bool = False
) -> Path:
    """The kernel's shared library, built if needed (safe under concurrent first uses).
    ``emulated``: the test build whose AMX tile instructions are software (any AVX-512 CPU
    runs its tile path)."""
    defines = (f"-D{AMX_EMULATION_DEFINE}",) if emulated else ()
    return build_native(
        SOURCE,
        "tandem_paged_attention",
        flags=(*BASE_FLAGS, *defines),
        build_dir=build_dir,
        isa=isa,
    )


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
            ctypes.c_int32,  # use_tiles
        ]
        self._run.restype = ctypes.c_int
        # Whether decode batches of bfloat16 score on AMX tiles (csrc: run_rows_tiles). The
        # library answers 0 (no tile path in this build: no AMX, or an ISA level below it),
        # 1 (the CPU's tiles, usable once Linux grants this process their state) or 2 (the
        # test build's emulated tiles).
        built = int(self.lib.tandem_pa_tiles())
        self.tiles_available = built == 2 or (built == 1 and amx_tiles_granted())
        self._tiles = self.tiles_available
        self.emulated = built == 2
        self._on_tiles = self.lib.tandem_pa_scores_on_tiles
        self._on_tiles.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_int32] * 3
        self._on_tiles.restype = ctypes.c_int
        if self.emulated:
            self._dot_products = self.lib.tandem_amx_emulated_dot_products
            self._dot_products.argtypes = []
            self._dot_products.restype = ctypes.c_int64
        self._write = self.lib.tandem_write_kv_cache
        self._write.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_int32]
        self._write.restype = ctypes.c_int

    @property
    def tiles(self) -> bool:
        """Whether decode batches it can take score on AMX tiles (see ``use_tiles``)."""
        return self._tiles

    def use_tiles(self, enabled: bool) -> None:
        """Scores on tiles or on vectors from now on (a benchmark's A/B); tiles only where
        this build has them and Linux granted the tile state, which a tile instruction
        without would end the process for."""
        if enabled and not self.tiles_available:
            raise ValueError("this build or process has no AMX tiles for decode attention")
        self._tiles = enabled

    def emulated_dot_products(self) -> int:
        """How many tile dot products the emulated builds have run in this process (what
        the tests read to know a call took the tile path); 0 for any other build."""
        return int(self._dot_products()) if self.emulated else 0

    def scores_on_tiles(
        self,
        num_queries: int,
        heads: tuple[int, int],
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> bool:
        """Whether a call with these shapes (``heads``: query and KV heads) scores on AMX
        tiles, at this process's thread count."""
        code = DTYPE_CODES.get(dtype)
        if code is None:
            return False
        return bool(
            self._on_tiles(
                num_queries, heads[0], heads[1], head_dim, block_size, code,
                torch.get_num_threads(), int(self._tiles),
            )
        )  # fmt: skip

    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """The reference's ``write_kv_cache``: each token's ``k``/``v`` [T, Hkv, D] row
        into slot ``meta.slot_mapping[t]`` of the caches [blocks, block_size, Hkv, D], read
        in place from their rows (a section of the layer's projection: only each row's heads
        need to lie back to back). Layouts it cannot copy as whole rows go to the reference."""
        slots = meta.slot_mapping
        rows_whole = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        if (
            not rows_whole
            or k.shape[1:] != k_cache.shape[2:]
            or v.shape != k.shape
            or k.dtype != k_cache.dtype
            or v.dtype != v_cache.dtype
            or k_cache.stride() != v_cache.stride()
            or not k_cache.is_contiguous()
            or slots.dtype is not torch.int64
            or slots.stride(0) != 1
        ):
            reference_write_kv_cache(k, v, k_cache, v_cache, meta)
            return
        num_tokens, heads, head_dim = k.shape
        size = k.element_size()
        code = self._write(
            k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
            slots.data_ptr(), num_tokens, heads * head_dim * size, k.stride(0) * size,
            v.stride(0) * size, k_cache.stride(1) * size, k_cache.shape[0] * k_cache.shape[1],
            torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(
                f"the KV cache write refused its arguments (code {code}): a slot outside the "
                f"cache's {k_cache.shape[0] * k_cache.shape[1]}"
            )

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
            int(self._tiles),
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


def native_kv_cache_write(dtype: torch.dtype) -> Callable[..., None] | None:
    """The kernel library's KV cache write (any dtype: it copies rows), where it is built."""
    library = native_paged_attention()
    return None if library is None else library.write_kv_cache
