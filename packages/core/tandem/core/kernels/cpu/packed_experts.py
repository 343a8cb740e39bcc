"""Routed experts' stacked weights in the layout of a grouped CPU kernel, and the call every
such kernel shares: expert e's rows of x (sorted by expert, ``offsets[e]`` to
``offsets[e + 1]``) times expert e's weight, every expert in one call. The offsets stay a
tensor the kernel reads where it lies, so routing needs no host sync.

Layouts, per expert, one after another (the dense kernels' packed panels):
  float32:  [N / panel][Kp][panel], Kp = K rounded up to 16 with zero rows;
  bfloat16: [N / 64][K / 2][64][2], the pairs AVX512-BF16's VDPBF16PS multiplies;
  bfloat16 on AMX: [N / 32][K / 32][16][32][2], the dense AMX kernel's layout (panel 32).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.core.kernels.cpu.native_build import c_function

# float32 panels are padded to a multiple of this many K rows.
K_PAD = 16


@dataclass(frozen=True)
class PackedExperts:
    """Stacked expert weights [E, N, K] in a grouped kernel's layout (module docstring)."""

    packed: torch.Tensor
    experts: int
    out_features: int
    in_features: int
    panel: int


@dataclass(frozen=True)
class GroupedEntry:
    """A grouped kernel's C entry point (``grouped_call``'s signature), for native code that
    calls it (``moe_routing.py``'s block): its address, and the panel width it takes (-1:
    it takes none)."""

    address: int
    panel: int


class GroupedExpertKernel(Protocol):
    name: str
    dtype: torch.dtype

    def pack_experts(self, weight: torch.Tensor) -> PackedExperts | None:
        """``weight`` [E, N, K] in this kernel's layout; None for a shape or dtype it does
        not take (those experts stay on the torch path)."""

    def grouped_matmul(
        self, x: torch.Tensor, experts: PackedExperts, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``offsets[e]`` to ``offsets[e + 1]`` of ``x`` [M, K] times expert ``e``'s
        weight, every expert in one call -> [M, N]."""

    def gates_silu(self, experts: PackedExperts) -> bool:
        """Whether ``grouped_silu_matmul`` takes these gate/up weights [E, 2 I, K]."""

    def grouped_silu_matmul(
        self, x: torch.Tensor, experts: PackedExperts, offsets: torch.Tensor
    ) -> torch.Tensor:
        """``grouped_matmul`` of gate/up weights with SiLU-and-mul as its epilogue -> [M, I],
        what ``silu_mul`` of the [M, 2 I] product gives, bit for bit."""

    def grouped_entry(self, experts: PackedExperts, silu: bool) -> GroupedEntry:
        """The C entry point behind ``grouped_silu_matmul`` (``silu``) or ``grouped_matmul``
        for these experts."""


def pack_panels(weight: torch.Tensor, panel: int) -> PackedExperts:
    """``weight`` [E, N, K] (N a multiple of ``panel``) in the module docstring's layout for
    its dtype (bfloat16: ``panel`` 64, K even)."""
    experts, out_features, in_features = weight.shape
    w = weight.detach()
    if w.dtype is torch.bfloat16:
        pairs = w.view(experts, out_features // panel, panel, in_features // 2, 2)
        packed = pairs.permute(0, 1, 3, 2, 4).contiguous()
    else:
        padded = -(-in_features // K_PAD) * K_PAD
        w = torch.nn.functional.pad(w, (0, padded - in_features))
        packed = w.view(experts, out_features // panel, panel, padded).permute(0, 1, 3, 2)
        packed = packed.contiguous()
    return PackedExperts(packed, experts, out_features, in_features, panel)


def grouped_call(
    function: ctypes._NamedFuncPointer,
    name: str,
    dtype: torch.dtype,
    x: torch.Tensor,
    experts: PackedExperts,
    offsets: torch.Tensor,
    *limits: int,
    out_features: int | None = None,
) -> torch.Tensor:
    """Runs a grouped kernel's C entry point (out, x, w, offsets, E, M, N, K, ldx, ldo,
    *limits, num_threads) -> int after checking what it cannot check itself; the output
    has ``out_features`` columns (default: the weight's N)."""
    if x.stride(1) != 1 or x.shape[1] != experts.in_features or x.dtype is not dtype:
        raise ValueError(f"the grouped kernel takes {dtype} rows of in_features, contiguous")
    if offsets.dtype is not torch.int64 or not offsets.is_contiguous():
        raise ValueError("expert offsets must be a contiguous int64 tensor")
    if offsets.shape != (experts.experts + 1,):
        raise ValueError(f"expert offsets must have {experts.experts + 1} entries")
    out = torch.empty(x.shape[0], out_features or experts.out_features, dtype=dtype)
    code = function(
        out.data_ptr(), x.data_ptr(), experts.packed.data_ptr(), offsets.data_ptr(),
        experts.experts, x.shape[0], experts.out_features, experts.in_features,
        x.stride(0), out.stride(0), *limits, torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise ValueError(f"the grouped {name} kernel refused its arguments ({code})")
    return out


def bind_grouped(function: ctypes._NamedFuncPointer, limits: int) -> ctypes._NamedFuncPointer:
    """``function``'s C signature: four pointers, six int64, ``limits`` + 1 int32."""
    return c_function(
        function, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_int32] * (limits + 1)
    )


class GroupedPanelCalls:
    """``GroupedExpertKernel``'s calls for a library whose grouped entry points are
    ``grouped_call``'s, a plain one and one with SiLU-and-mul as its epilogue, on experts
    packed in panels (each half of a gate/up weight must be whole panels to fuse)."""

    name: str
    dtype: torch.dtype

    def bind_grouped_calls(
        self,
        plain: ctypes._NamedFuncPointer,
        silu: ctypes._NamedFuncPointer,
        takes_panel: bool = False,
    ) -> None:
        """``takes_panel``: the entry points take the experts' panel width as their limit
        (a library that reads more than one width)."""
        limits = 1 if takes_panel else 0
        self._grouped = bind_grouped(plain, limits)
        self._grouped_silu = bind_grouped(silu, limits)
        self._takes_panel = takes_panel

    def _grouped_limits(self, experts: PackedExperts) -> tuple[int, ...]:
        return (experts.panel,) if self._takes_panel else ()

    def grouped_entry(self, experts: PackedExperts, silu: bool) -> GroupedEntry:
        function = self._grouped_silu if silu else self._grouped
        address = ctypes.cast(function, ctypes.c_void_p).value
        assert address is not None  # a bound library function
        return GroupedEntry(address, experts.panel if self._takes_panel else -1)

    def grouped_matmul(
        self, x: torch.Tensor, experts: PackedExperts, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``offsets[e]`` to ``offsets[e + 1]`` of ``x`` [M, K] (sorted by expert) times
        expert ``e``'s weight, every expert in one call, at any M -> [M, N]. ``offsets``:
        int64 [E + 1], read by the kernel where it lies (no host sync)."""
        return grouped_call(self._grouped, self.name, self.dtype, x, experts, offsets,
                            *self._grouped_limits(experts))  # fmt: skip

    def gates_silu(self, experts: PackedExperts) -> bool:
        """Whether ``grouped_silu_matmul`` takes these gate/up weights: both halves whole
        panels."""
        return experts.out_features % (2 * experts.panel) == 0

    def grouped_silu_matmul(
        self, x: torch.Tensor, experts: PackedExperts, offsets: torch.Tensor
    ) -> torch.Tensor:
        """``grouped_matmul`` of the experts' gate/up weights [E, 2 I, K] with SiLU-and-mul
        as its epilogue -> [M, I], what ``silu_mul`` of the [M, 2 I] product gives, bit for
        bit, without that product ever written out."""
        return grouped_call(
            self._grouped_silu, f"{self.name} SiLU", self.dtype, x, experts, offsets,
            *self._grouped_limits(experts), out_features=experts.out_features // 2,
        )  # fmt: skip
