"""The fused elementwise CPU kernels (``csrc/elementwise.cpp``): residual add + RMSNorm, q/k
RMSNorm + rotary in place, gated SiLU, gated RMSNorm, Gated DeltaNet's gates. Built on first
use (see ``native_build``), loaded with ctypes; each has the signature of the torch reference
it replaces, so the kernel registry can hand either to a layer. None where the library cannot
be had (logged once per process)."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

import torch

from tandem.core.kernels.cpu.native_build import (
    BASE_FLAGS,
    CSRC,
    WIDE_VECTOR_FLAGS,
    IsaLevel,
    KernelBuildError,
    build_library,
    c_function,
    compiled_path,
    log_unbuilt,
)
from tandem.core.kernels.handle import NativeChoice, library_choice
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "elementwise.cpp"
# Without FMA contraction float products round where torch's separate ops round them.
FLAGS = (*BASE_FLAGS, "-ffp-contract=off", *WIDE_VECTOR_FLAGS)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_vp, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, last] with a contiguous last dimension (a view when possible)."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _head_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t`` as [tokens, heads, last], each token's heads back to back with a contiguous last
    dimension, tokens at any stride (a view when possible)."""
    rows = t.reshape(-1, heads, t.shape[-1])
    if rows.stride(2) == 1 and (heads == 1 or rows.stride(1) == rows.shape[2]):
        return rows
    return rows.contiguous()


class NativeElementwise:
    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        # avx512, avx2 or portable: the code path this build runs.
        self.compiled_path = compiled_path(lib)
        self._norm = c_function(
            lib.tandem_add_rms_norm, [_vp] * 4 + [_i64] * 5 + [_f32, _i32, _i32, _i32]
        )
        self._rotary = c_function(
            lib.tandem_qk_norm_rotary, [_vp] * 7 + [_i64] * 10 + [_f32, _i32, _i32, _i32]
        )
        self._silu = c_function(lib.tandem_silu_mul, [_vp] * 2 + [_i64] * 4 + [_i32, _i32])
        self._gated = c_function(
            lib.tandem_rms_norm_gated, [_vp] * 4 + [_i64] * 5 + [_f32, _i32, _i32]
        )
        self._gating = c_function(lib.tandem_gdn_gating, [_vp] * 6 + [_i64] * 4 + [_i32, _i32])

    @staticmethod
    def handles(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise ValueError(f"the native {what} kernel refused its arguments (code {code})")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x)
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._add_rms_norm(out, None, rows, weight, eps)
        return out.view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the sum is written into ``residual``, which
        the caller hands over (it is the layer stack's own running sum)."""
        return self._with_residual(x, residual, weight, eps, centered=False)

    def rms_norm_zero_centered(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Qwen3.5's RMSNorm scaled by ``1 + weight``, rounded once."""
        rows = _rows(x)
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._add_rms_norm(out, None, rows, weight, eps, centered=True)
        return out.view(x.shape)

    def add_rms_norm_zero_centered(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm`` with the zero-centred norm."""
        return self._with_residual(x, residual, weight, eps, centered=True)

    def rms_norm_gated(
        self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Qwen3.5's gated RMSNorm of ``x`` [..., D] times ``silu(gate)`` (gate shaped as x).
        A [T, H, D] view whose heads lie back to back in each token's row (the layer's
        ``z``, a section of a wider projection) is read in place."""
        if gate.shape != x.shape:
            raise ValueError(f"gate {tuple(gate.shape)} is not shaped as x {tuple(x.shape)}")
        heads = x.shape[-2] if x.dim() > 2 else 1
        xs, gates = _head_rows(x, heads), _head_rows(gate, heads)
        out = torch.empty(xs.shape, dtype=x.dtype)
        weight = weight.contiguous()
        code = self._gated(
            out.data_ptr(), xs.data_ptr(), gates.data_ptr(), weight.data_ptr(), xs.shape[0],
            heads, xs.shape[2], xs.stride(0), gates.stride(0), eps, _DTYPES[x.dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "gated RMSNorm")
        return out.view(x.shape)

    def gdn_gating(
        self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gated DeltaNet's (g, beta) from ``a`` and ``b`` [T, H] (columns of one projection,
        read in place), ``a_log`` and ``dt_bias`` [H] in their dtype: g float32, beta in
        the dtype of ``b``."""
        if not (a.dtype == b.dtype == a_log.dtype == dt_bias.dtype):
            raise ValueError("a, b, A_log and dt_bias must share a dtype")
        heads = a.shape[1:]
        if a.dim() != 2 or b.shape != a.shape or a_log.shape != heads or dt_bias.shape != heads:
            raise ValueError("a and b must be [T, H], A_log and dt_bias [H]")
        a = a if a.stride(1) == 1 else a.contiguous()
        b = b if b.stride(1) == 1 else b.contiguous()
        a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
        g = torch.empty(a.shape, dtype=torch.float32)
        beta = torch.empty(a.shape, dtype=b.dtype)
        code = self._gating(
            g.data_ptr(), beta.data_ptr(), a.data_ptr(), b.data_ptr(), a_log.data_ptr(),
            dt_bias.data_ptr(), a.shape[0], a.shape[1], a.stride(0), b.stride(0),
            _DTYPES[a.dtype], torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "Gated DeltaNet gating")
        return g, beta

    def _with_residual(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        centered: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = _rows(x)
        res = residual.view(rows.shape)
        out = torch.empty(rows.shape, dtype=x.dtype)
        self._add_rms_norm(out, res, rows, weight, eps, centered)
        return out.view(x.shape), residual

    def _add_rms_norm(
        self,
        out: torch.Tensor,
        residual: torch.Tensor | None,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        centered: bool = False,
    ) -> None:
        # Bound to a name: a temporary's memory is freed as soon as its pointer is read,
        # before the kernel reads through it (another worker thread may reuse it by then).
        weight = weight.contiguous()
        code = self._norm(
            out.data_ptr(), _ptr(residual), x.data_ptr(), weight.data_ptr(),
            x.shape[0], x.shape[1], x.stride(0), out.stride(0),
            residual.stride(0) if residual is not None else 0, eps, int(centered),
            _DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "RMSNorm")

    def qk_norm_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        zero_centered: bool = False,
        rotary_dim: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` [T, Hq, D], ``k`` [T, Hk, D] normalised per head (where weights are given;
        ``zero_centered``: scaled by ``1 + weight``, Qwen3.5's) and their first ``rotary_dim``
        (default D) rotated at ``positions`` through the [max_position, rotary_dim / 2]
        tables, in place. Heads may lie apart (each query beside its gate): any token and
        head strides, each head's D elements adjacent."""
        tokens, q_heads, dim = q.shape
        rotated = dim if rotary_dim is None else rotary_dim
        if k.shape[2] != dim or k.shape[0] != tokens:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
        for t in (q, k):
            if t.stride(2) != 1:
                raise ValueError("q and k need each head's elements adjacent")
        if cos.stride() != sin.stride() or cos.stride(1) != 1 or 2 * cos.shape[1] != rotated:
            raise ValueError(
                "the rotary tables must be alike, rows contiguous, rotary_dim / 2 wide"
            )
        index = positions if positions.dtype is torch.int64 else positions.long()
        index = index.contiguous()
        code = self._rotary(
            q.data_ptr(), k.data_ptr(), _ptr(q_weight), _ptr(k_weight), cos.data_ptr(),
            sin.data_ptr(), index.data_ptr(), tokens, q_heads, k.shape[1], dim, rotated,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps,
            int(zero_centered), _DTYPES[q.dtype], torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "q/k norm and rotary")
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows = _rows(gate_up)
        inter = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype)
        code = self._silu(
            out.data_ptr(), rows.data_ptr(), rows.shape[0], inter, rows.stride(0),
            out.stride(0), _DTYPES[gate_up.dtype], torch.get_num_threads(),
        )  # fmt: skip
        self._check(code, "gated SiLU")
        return out.view(*gate_up.shape[:-1], inter)


def load_native_elementwise(
    build_dir: Path | None = None, isa: IsaLevel | None = None
) -> NativeElementwise | None:
    """Build (if needed) and load the kernels (for the instruction sets ``isa`` allows,
    default ``TANDEM_CPU_ISA``'s); None, with the reason logged, where they cannot be had.
    ``TANDEM_ELEMENTWISE=torch`` forces the torch reference path."""
    if os.environ.get("TANDEM_ELEMENTWISE", "").lower() == "torch":
        logger.info("TANDEM_ELEMENTWISE=torch: norms, rotary and activations run op by op")
        return None
    try:
        return NativeElementwise(build_library(SOURCE, "tandem_elementwise", FLAGS, build_dir, isa))
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(
            logger,
            exc,
            "no fused CPU elementwise kernels (%s); norms, rotary and activations run op by "
            "op in torch",
            exc,
        )
        return None


# The process's kernel, built and loaded on first use.
native_elementwise = ProcessOnce(load_native_elementwise)


def native_elementwise_kernel(name: str) -> NativeChoice[Any]:
    """The fused CPU kernel ``name`` of this library for a dtype, where it is built."""
    return library_choice(native_elementwise, name)
