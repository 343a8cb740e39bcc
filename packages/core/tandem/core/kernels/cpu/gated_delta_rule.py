"""The fused one-step gated delta rule of Gated DeltaNet's decode on CPU
(``csrc/gated_delta_rule.cpp``): each decode sequence's recurrent state read and written once,
in place in its slot, instead of the torch reference's five passes over the gathered states.
Same signature as ``reference.gated_delta_rule.recurrent_gated_delta_rule``, so the kernel
registry hands either to the layer. Built on first use (``native_build``), loaded with ctypes;
None where the library cannot be had (logged once per process). ``TANDEM_LINEAR_ATTENTION=torch``
keeps the reference."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.core.kernels.cpu.native_build import (
    CSRC,
    IsaLevel,
    KernelBuildError,
    build_library,
    compiled_path,
    log_unbuilt,
)
from tandem.core.kernels.linear_attention_metadata import LinearAttentionMetadata
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "gated_delta_rule.cpp"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_vp, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class NativeGatedDeltaRule:
    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        # avx512, avx2 or portable: the code path this build runs.
        self.compiled_path = compiled_path(lib)
        self._recurrent = lib.tandem_recurrent_gated_delta_rule
        self._recurrent.argtypes = [_vp] * 9 + [_i64] * 8 + [_i32, _i32]
        self._recurrent.restype = ctypes.c_int

    @staticmethod
    def handles(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def recurrent(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        meta: LinearAttentionMetadata,
    ) -> torch.Tensor:
        """One token per decode sequence: ``q``/``k`` [B, Hk, Dk], ``v`` [B, Hv, Dv], ``g``
        (log decay, float32) and ``beta`` [B, Hv] -> [B, Hv, Dv] in ``v``'s dtype; the
        states of ``meta.decode_slots`` in ``states`` [slots, Hv, Dk, Dv] (float32) are
        updated in place."""
        batch, k_heads, k_dim = q.shape
        v_heads, v_dim = v.shape[1], v.shape[2]
        for t, dim in ((q, k_dim), (k, k_dim), (v, v_dim)):
            if t.stride(2) != 1 or t.stride(1) != dim or t.dtype is not v.dtype:
                raise ValueError("q, k and v need contiguous [H, D] rows of one dtype")
        if states.dtype is not torch.float32 or not states.is_contiguous():
            raise ValueError("the recurrent states must be one contiguous float32 pool")
        # Bound to names: a temporary's memory is freed as soon as its pointer is read,
        # before the kernel reads through it.
        gf = g.float().contiguous()
        betac = beta.to(v.dtype).contiguous()
        slots = meta.decode_slots.contiguous()
        initial = None
        if not meta.decodes_have_initial_state:
            initial = meta.decode_has_initial_state.to(torch.uint8).contiguous()
        out = torch.empty(batch, v_heads, v_dim, dtype=v.dtype)
        code = self._recurrent(
            out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), gf.data_ptr(),
            betac.data_ptr(), states.data_ptr(), slots.data_ptr(),
            None if initial is None else initial.data_ptr(), batch, k_heads, v_heads, k_dim,
            v_dim, q.stride(0), k.stride(0), v.stride(0), _DTYPES[v.dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"the native gated delta rule refused its arguments (code {code})")
        return out


def load_native_gated_delta_rule(
    build_dir: Path | None = None, isa: IsaLevel | None = None
) -> NativeGatedDeltaRule | None:
    """Build (if needed) and load the kernel; None, with the reason logged, where it cannot
    be had."""
    if os.environ.get("TANDEM_LINEAR_ATTENTION", "").lower() == "torch":
        logger.info("TANDEM_LINEAR_ATTENTION=torch: the gated delta rule's decode runs in torch")
        return None
    try:
        path = build_library(SOURCE, "tandem_gated_delta_rule", build_dir=build_dir, isa=isa)
        return NativeGatedDeltaRule(path)
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(
            logger,
            exc,
            "no native CPU gated delta rule (%s); linear-attention decodes run in torch",
            exc,
        )
        return None


# The process's kernel, built and loaded on first use.
native_gated_delta_rule = ProcessOnce(load_native_gated_delta_rule)


def native_recurrent_gated_delta_rule(dtype: torch.dtype) -> Callable[..., Any] | None:
    """The kernel registry's CPU choice for ``recurrent_gated_delta_rule``."""
    kernel = native_gated_delta_rule()
    if kernel is None or not kernel.handles(dtype):
        return None
    return kernel.recurrent
