"""Gated DeltaNet's stateful parts on CPU (``csrc/linear_attention.cpp``): the causal conv1d
and the gated delta rule for decodes, verifying drafts and prefills, each sequence's conv and
recurrent state read and written once, in place in its slot, instead of the torch references'
gathers, concatenations and passes over the gathered states. Same signatures as the
references in ``reference.causal_conv1d`` and ``reference.gated_delta_rule``, so the kernel
registry hands either to the layer.

A prefill runs the delta rule token by token, as a decode does, rather than in chunks as the
reference and flash-linear-attention do: chunks turn the recurrence into matrix products,
which pays on accelerators; on a CPU each head's 16 KiB state stays in L1 for the whole run,
with no padding, gathers or triangular solves. Built on first use (``native_build``), loaded
with ctypes; None where the library cannot be had (logged once per process).
``TANDEM_LINEAR_ATTENTION=torch`` keeps the references."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

import torch

from tandem.core.kernels.cpu.native_build import (
    CSRC,
    IsaLevel,
    KernelBuildError,
    build_library,
    c_function,
    compiled_path,
    log_unbuilt,
)
from tandem.core.kernels.handle import NativeChoice, library_choice
from tandem.core.kernels.linear_attention_metadata import (
    LinearAttentionMetadata,
    LinearPrefillIndices,
    LinearVerifyIndices,
)
from tandem.core.kernels.process_once import ProcessOnce
from tandem.core.kernels.reference.causal_conv1d import check_activation
from tandem.core.kernels.reference.linear_attention_verify import ConvStep, DeltaStep

logger = logging.getLogger(__name__)

SOURCE = CSRC / "linear_attention.cpp"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_vp, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class NativeLinearAttention:
    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        # avx512, avx2 or portable: the code path this build runs.
        self.compiled_path = compiled_path(lib)
        self._recurrent = c_function(
            lib.tandem_recurrent_gated_delta_rule, [_vp] * 11 + [_i64] * 8 + [_i32, _i32]
        )
        self._conv = c_function(
            lib.tandem_causal_conv1d_update, [_vp] * 8 + [_i64] * 4 + [_i32, _i32]
        )
        self._conv_prefill = c_function(
            lib.tandem_causal_conv1d_prefill, [_vp] * 7 + [_i64] * 4 + [_i32, _i32]
        )

    @staticmethod
    def handles(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def conv_update(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_states: torch.Tensor,
        meta: LinearAttentionMetadata,
        activation: str,
    ) -> torch.Tensor:
        """One new token per decode sequence: ``x`` [B, C] -> [B, C] (SiLU of the conv);
        the states of ``meta.decode_slots`` in ``conv_states`` [slots, C, K - 1] shift by
        one, in place."""
        slots = meta.decode_slots.contiguous()
        return self._conv_runs(x, weight, conv_states, slots, _initial(meta), None, activation)

    def conv_verify(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_states: torch.Tensor,
        verify: LinearVerifyIndices,
        activation: str,
        step: ConvStep,
    ) -> torch.Tensor:
        """The conv over verifying sequences' tokens ``x`` [T, C] (token order), each
        sequence's positions in order in one call, the state after each but the last kept in
        its scratch row (``reference.linear_attention_verify.conv_verify``; ``step`` is the
        reference's, unused here)."""
        slots, starts, keep = _runs(verify)
        return self._conv_runs(x, weight, conv_states, slots, None, (starts, keep), activation)

    def conv_prefill(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_states: torch.Tensor,
        meta: LinearAttentionMetadata,
        activation: str,
    ) -> torch.Tensor:
        """The prefill tokens ``x`` [N, C] (sequences contiguous) -> [N, C]; every prefill
        sequence's state slot is left holding its last K - 1 inputs (as
        ``reference.causal_conv1d.causal_conv1d_prefill``)."""
        p = _prefill(meta)
        tokens, channels, taps = self._conv_checks(x, weight, conv_states, activation)
        out = torch.empty(tokens, channels, dtype=x.dtype)
        taps_rows = weight.contiguous()
        initial = _prefill_initial(p)
        code = self._conv_prefill(
            out.data_ptr(), x.data_ptr(), taps_rows.data_ptr(), conv_states.data_ptr(),
            p.state_slots.data_ptr(), _pointer(initial), p.run_starts.data_ptr(),
            p.state_slots.shape[0], channels, taps, x.stride(0), _DTYPES[x.dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"the native conv prefill refused its arguments (code {code})")
        return out

    @staticmethod
    def _conv_checks(
        x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, activation: str
    ) -> tuple[int, int, int]:
        check_activation(activation)
        tokens, channels = x.shape
        taps = weight.shape[1]
        if x.stride(1) != 1 or weight.dtype is not x.dtype or conv_states.dtype is not x.dtype:
            raise ValueError("the conv update takes contiguous rows, taps and states of x's dtype")
        if conv_states.shape[1:] != (channels, taps - 1) or not conv_states.is_contiguous():
            raise ValueError("the conv states must be one contiguous [slots, C, K - 1] pool")
        return tokens, channels, taps

    def _conv_runs(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_states: torch.Tensor,
        slots: torch.Tensor,
        initial: torch.Tensor | None,
        runs: tuple[torch.Tensor, torch.Tensor] | None,
        activation: str,
    ) -> torch.Tensor:
        tokens, channels, taps = self._conv_checks(x, weight, conv_states, activation)
        taps_rows = weight.contiguous()
        starts, keep = (None, None) if runs is None else runs
        out = torch.empty(tokens, channels, dtype=x.dtype)
        code = self._conv(
            out.data_ptr(), x.data_ptr(), taps_rows.data_ptr(), conv_states.data_ptr(),
            slots.data_ptr(), _pointer(initial), _pointer(starts), _pointer(keep),
            slots.shape[0], channels, taps, x.stride(0), _DTYPES[x.dtype],
            torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"the native conv update refused its arguments (code {code})")
        return out

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
        slots = meta.decode_slots.contiguous()
        return self._recurrent_runs(q, k, v, g, beta, states, slots, _initial(meta), None)

    def recurrent_verify(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        verify: LinearVerifyIndices,
        step: DeltaStep,
    ) -> torch.Tensor:
        """The delta rule over verifying sequences' tokens (token order), each sequence's
        positions in order in one call, the state after each but the last kept in its scratch
        row (``reference.linear_attention_verify.delta_verify``; ``step`` unused here)."""
        slots, starts, keep = _runs(verify)
        return self._recurrent_runs(q, k, v, g, beta, states, slots, None, (starts, keep))

    def recurrent_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        meta: LinearAttentionMetadata,
    ) -> torch.Tensor:
        """The prefill tokens (sequences contiguous), each sequence's tokens in order in one
        run from its state (zeros on its first chunk), the state after its last token written
        back (as ``reference.gated_delta_rule.chunk_gated_delta_rule``)."""
        p = _prefill(meta)
        return self._recurrent_runs(
            q, k, v, g, beta, states, p.state_slots, _prefill_initial(p), (p.run_starts, None)
        )

    def _recurrent_runs(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        initial: torch.Tensor | None,
        runs: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        tokens, k_heads, k_dim = q.shape
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
        starts, keep = (None, None) if runs is None else runs
        out = torch.empty(tokens, v_heads, v_dim, dtype=v.dtype)
        code = self._recurrent(
            out.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), gf.data_ptr(),
            betac.data_ptr(), states.data_ptr(), slots.data_ptr(), _pointer(initial),
            _pointer(starts), _pointer(keep), slots.shape[0], k_heads, v_heads, k_dim, v_dim,
            q.stride(0), k.stride(0), v.stride(0), _DTYPES[v.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"the native gated delta rule refused its arguments (code {code})")
        return out


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _runs(verify: LinearVerifyIndices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifying sequences' slots, run starts and kept rows, as the kernels take them."""
    if verify.run_slots is None or verify.run_starts is None or verify.keep_rows is None:
        raise ValueError("the verify metadata lacks its runs (run_slots, run_starts, keep_rows)")
    return (
        verify.run_slots.contiguous(),
        verify.run_starts.contiguous(),
        verify.keep_rows.contiguous(),
    )


def _prefill(meta: LinearAttentionMetadata) -> LinearPrefillIndices:
    if meta.prefill is None:
        raise ValueError("a prefill kernel needs the step's prefill metadata")
    return meta.prefill


def _prefill_initial(p: LinearPrefillIndices) -> torch.Tensor | None:
    """Per prefill sequence, 1 where it continues its state; None where all do. A bool
    tensor's bytes are 0 or 1, read by the kernel as they are."""
    return None if p.all_have_initial_state else p.has_initial_state.view(torch.uint8)


def _initial(meta: LinearAttentionMetadata) -> torch.Tensor | None:
    """Per decode, 1 where it continues its state; None where all do (known on the host)."""
    if meta.decodes_have_initial_state:
        return None
    return meta.decode_has_initial_state.to(torch.uint8).contiguous()


def load_native_linear_attention(
    build_dir: Path | None = None, isa: IsaLevel | None = None
) -> NativeLinearAttention | None:
    """Build (if needed) and load the kernel; None, with the reason logged, where it cannot
    be had."""
    if os.environ.get("TANDEM_LINEAR_ATTENTION", "").lower() == "torch":
        logger.info("TANDEM_LINEAR_ATTENTION=torch: linear-attention kernels run in torch")
        return None
    try:
        path = build_library(SOURCE, "tandem_linear_attention", build_dir=build_dir, isa=isa)
        return NativeLinearAttention(path)
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(
            logger,
            exc,
            "no native CPU linear-attention kernels (%s); they run in torch",
            exc,
        )
        return None


# The process's kernel, built and loaded on first use.
native_linear_attention = ProcessOnce(load_native_linear_attention)


def native_linear_attention_kernel(name: str) -> NativeChoice[Any]:
    """The kernel registry's CPU choice ``name`` (``recurrent``, ``conv_prefill``, ...) for a
    dtype, where the library is built."""
    return library_choice(native_linear_attention, name)
