"""What the CPU attention kernels' ctypes bindings share: loading a library, asking it which
head sizes and dtypes it handles, and the checks every entry point makes of its arguments
(the kernels read raw pointers with the strides they are given, so a layout they do not
expect must be refused here, not misread there)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.core.kernels.cpu.native_build import compiled_path

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class AttentionLibrary:
    def __init__(self, path: Path, supports_symbol: str) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        # avx512, avx2 or portable: the code path this build runs.
        self.compiled_path = compiled_path(self.lib)
        self._supports = getattr(self.lib, supports_symbol)
        self._supports.argtypes = [ctypes.c_int64, ctypes.c_int32]
        self._supports.restype = ctypes.c_int

    def supports(self, head_dim: int, dtype: torch.dtype) -> bool:
        code = DTYPE_CODES.get(dtype)
        return code is not None and bool(self._supports(head_dim, code))

    @staticmethod
    def check(
        rows: tuple[torch.Tensor, ...],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        indices: tuple[torch.Tensor, ...],
    ) -> None:
        """``rows`` ([N, H, D] queries and outputs) need contiguous [H, D] rows, ``indices``
        int64 with a contiguous last dimension, the caches to be contiguous and alike, and all
        of them one dtype the kernels read (each entry point takes a single dtype code; which
        of those its build handles, ``supports`` says and the entry point checks)."""
        dtypes = {t.dtype for t in (*rows, k_cache, v_cache)}
        if len(dtypes) != 1 or not dtypes <= DTYPE_CODES.keys():
            raise ValueError("q, out and the K/V caches must share one dtype, float32 or bfloat16")
        for t in rows:
            if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                raise ValueError("q and out need contiguous [H, D] rows")
        for t in indices:
            if t.dtype is not torch.int64 or t.stride(-1) != 1:
                raise ValueError("index tensors must be int64 with a contiguous last dim")
        if k_cache.stride() != v_cache.stride() or not k_cache.is_contiguous():
            raise ValueError("the K and V caches must be contiguous and alike")
