"""The routing around the grouped expert GEMMs on CPU (``csrc/moe_routing.cpp``): the router's
softmax and top-k, the (token, choice) pairs sorted by expert, each sorted pair's row of x
gathered, and each token's expert outputs summed back with its routing weights, one native
pass each where torch took a handful of small ops (4-5 % of a served float32 step of the bench
MoE model for the sort and the sum; in serving, torch's softmax and top-k took 54 us a layer
against 17 us alone, each op waking an OpenMP thread). The sort, the gather and the sum are bit
for bit what the torch reference (``reference/fused_moe.py``: ``sort_rows``, ``combine``)
gives. The top-k chooses on the logits as torch.topk chooses on the probabilities: the same
experts in the same order for bfloat16 logits, ties included, and for float32 logits except
where two a rounding apart get one probability, or a row holds a NaN; its weights within
float32 roundings of ``topk_softmax``'s. Built on first use (see ``native_build``); None where
the library cannot be had (the grouped path then does all of it in torch). ``block`` runs all
of it around the grouped kernel's two GEMMs in one native call."""

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
    IsaLevel,
    KernelBuildError,
    build_library,
    c_function,
    compiled_path,
    log_unbuilt,
)
from tandem.core.kernels.cpu.packed_experts import GroupedEntry, PackedExperts
from tandem.core.kernels.handle import NativeChoice, library_choice
from tandem.core.kernels.process_once import ProcessOnce

logger = logging.getLogger(__name__)

SOURCE = CSRC / "moe_routing.cpp"
# No FMA contraction: each product rounds before it is added, as torch's mul_ and index_add_.
FLAGS = (*BASE_FLAGS, "-ffp-contract=off")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_vp, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_ALIGN = 64


class NativeMoeRouting:
    """The loaded library."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.compiled_path = compiled_path(self.lib)
        self._route = c_function(self.lib.tandem_moe_route, [_vp, _i64, _i64, _i64, _vp, _vp, _vp])
        self._topk = c_function(
            self.lib.tandem_moe_topk_softmax, [_vp] + [_i64] * 4 + [_i32, _vp, _vp, _i32, _i32]
        )
        self._gather = c_function(self.lib.tandem_moe_gather, [_vp] * 3 + [_i64] * 4 + [_i32] * 2)
        self._combine = c_function(
            self.lib.tandem_moe_combine, [_vp] * 4 + [_i64] * 5 + [_i32, _i32]
        )
        self._block = c_function(
            self.lib.tandem_moe_block,
            [_vp, _vp] + [_i64] * 4 + [_vp] + [_i64] * 3
            + [_i32, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _vp, _i64, _i32, _i32],
        )  # fmt: skip

    @staticmethod
    def handles(dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def topk_softmax(
        self, logits: torch.Tensor, top_k: int, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk_softmax``'s choice from router logits [..., E] (see the module's text): the
        experts in descending order, tied ones in torch.topk's, and their weights, rounded to
        the logits' dtype; ids int64, each [..., top_k]."""
        if logits.dtype not in _DTYPES or logits.device.type != "cpu":
            raise ValueError("the native top-k takes float32 or bfloat16 logits on the CPU")
        experts = logits.shape[-1]
        rows = logits.reshape(-1, experts)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        weights = torch.empty(rows.shape[0], top_k, dtype=logits.dtype)
        ids = torch.empty(rows.shape[0], top_k, dtype=torch.int64)
        code = self._topk(
            rows.data_ptr(), rows.stride(0), rows.shape[0], experts, top_k, int(normalize),
            weights.data_ptr(), ids.data_ptr(), _DTYPES[logits.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"top_k must be from 1 to the router's {experts} experts, got {top_k}")
        shape = (*logits.shape[:-1], top_k)
        return weights.view(shape), ids.view(shape)

    def gather(self, x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """``x.index_select(0, token)`` for x [T, H] (float32 or bfloat16) and the route's
        ``token``."""
        if x.dim() != 2 or x.dtype not in _DTYPES:
            raise ValueError("the MoE gather takes float32 or bfloat16 rows")
        if x.stride(1) != 1:
            x = x.contiguous()
        if token.dtype is not torch.int64 or token.dim() != 1 or token.stride(0) != 1:
            raise ValueError("the MoE gather takes the route's tokens: contiguous int64")
        out = torch.empty(token.shape[0], x.shape[1], dtype=x.dtype)
        code = self._gather(
            out.data_ptr(), x.data_ptr(), token.data_ptr(), token.shape[0], x.shape[1],
            x.stride(0), x.shape[0], _DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if code == 1:
            raise ValueError(f"a routed token is outside the {x.shape[0]} rows of x")
        if code != 0:
            raise ValueError(f"the MoE gather refused its arguments ({code})")
        return out

    def route(
        self, topk_ids: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``sort_rows``' sort: each expert's rows ``offsets`` [E + 1] (int64), each sorted
        row's token [T k], and where each pair (token t, choice j) went, ``slot[t k + j]``
        (the inverse of ``sort_rows``' order)."""
        ids = topk_ids.to(torch.int64).contiguous()
        pairs = ids.numel()
        offsets = torch.empty(num_experts + 1, dtype=torch.int64)
        token = torch.empty(pairs, dtype=torch.int64)
        slot = torch.empty(pairs, dtype=torch.int64)
        code = self._route(
            ids.data_ptr(), ids.shape[0], ids.shape[1], num_experts,
            offsets.data_ptr(), token.data_ptr(), slot.data_ptr(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"a routed expert id is outside the layer's {num_experts} experts")
        return offsets, token, slot

    def combine(
        self, rows: torch.Tensor, topk_weights: torch.Tensor, slot: torch.Tensor
    ) -> torch.Tensor:
        """``combine``'s sum: for each token, its sorted ``rows`` [T k, H] at its slots
        times its routing weights [T, k], summed in expert order -> [T, H]."""
        if rows.stride(1) != 1 or rows.dtype not in _DTYPES:
            raise ValueError("the MoE combine takes float32 or bfloat16 rows, contiguous")
        tokens, k = topk_weights.shape
        if slot.shape != (tokens * k,) or rows.shape[0] != tokens * k:
            raise ValueError("the MoE combine needs one slot and one row for every pair")
        weights = topk_weights.to(rows.dtype).contiguous()
        out = torch.empty(tokens, rows.shape[1], dtype=rows.dtype)
        code = self._combine(
            out.data_ptr(), rows.data_ptr(), weights.data_ptr(), slot.data_ptr(),
            tokens, k, rows.shape[1], rows.stride(0), out.stride(0),
            _DTYPES[rows.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if code != 0:
            raise ValueError(f"the MoE combine refused its arguments ({code})")
        return out

    def block(
        self,
        x: torch.Tensor,
        logits: torch.Tensor,
        top_k: int,
        normalize: bool,
        gate_up: tuple[PackedExperts, GroupedEntry],
        down: tuple[PackedExperts, GroupedEntry],
    ) -> torch.Tensor:
        """A layer's routed experts in one native call: ``topk_softmax`` of the router's
        ``logits`` [T, E] (rows of both may lie apart: a router padded to a kernel's panels),
        ``route``, ``gather``, the grouped gate/up GEMM with SiLU-and-mul
        (``gate_up``: the packed [E, 2 I, H] weights and that kernel's entry point), the
        grouped down one (``down``: [E, H, I]) and ``combine``, in that order on the same
        buffers: their result [T, H] bit for bit, where a decode step paid each call's way
        through Python (at 48 rows of the bench MoE, more than a tenth of the layer)."""
        w13, up_entry = gate_up
        w2, down_entry = down
        tokens, hidden = x.shape
        inter = w2.in_features
        if x.dtype not in _DTYPES or logits.dtype is not x.dtype:
            raise ValueError("the MoE block takes float32 or bfloat16 rows and logits alike")
        if logits.shape != (tokens, w13.experts):
            raise ValueError(f"the MoE block takes logits [{tokens}, {w13.experts}]")
        x = x if x.stride(1) == 1 else x.contiguous()
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        fits = (w13.in_features, w13.out_features, w2.out_features, w2.experts)
        if fits != (hidden, 2 * inter, hidden, w13.experts):
            raise ValueError("the MoE block's gate/up and down weights do not fit its rows")
        size = workspace_bytes(tokens * top_k, w13.experts, hidden, inter, x.dtype)
        workspace = torch.empty(size, dtype=torch.uint8)
        out = torch.empty(tokens, hidden, dtype=x.dtype)
        code = self._block(
            out.data_ptr(), x.data_ptr(), tokens, hidden, x.stride(0), out.stride(0),
            logits.data_ptr(), logits.stride(0), w13.experts, top_k, int(normalize),
            w13.packed.data_ptr(), up_entry.address, up_entry.panel,
            w2.packed.data_ptr(), down_entry.address, down_entry.panel, inter,
            workspace.data_ptr(), size, _DTYPES[x.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if code == 1:
            raise ValueError(f"top_k must be from 1 to the router's {w13.experts} experts, "
                             f"got {top_k}")  # fmt: skip
        if code != 0:
            raise ValueError(f"the MoE block refused its arguments ({code})")
        return out


def workspace_bytes(pairs: int, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> int:
    """The scratch ``block`` takes for ``pairs`` (token, expert) pairs (``block_workspace``
    in the C source, which refuses less): the ids, offsets, tokens and slots (int64), the
    routing weights, the gathered rows and the intermediate activations, each from a
    multiple of 64 bytes."""
    elem = torch.finfo(dtype).bits // 8

    def aligned(size: int) -> int:
        return -(-size // _ALIGN) * _ALIGN

    return (
        aligned(pairs * 8) * 3
        + aligned((experts + 1) * 8)
        + aligned(pairs * elem)
        + aligned(pairs * hidden * elem)
        + aligned(pairs * inter * elem)
    )


def load_native_moe_routing(
    build_dir: Path | None = None, isa: IsaLevel | None = None
) -> NativeMoeRouting | None:
    """Build (if needed) and load the library; None, with the reason logged, where it cannot
    be had. ``TANDEM_MOE_ROUTING=torch`` keeps the torch ops."""
    if os.environ.get("TANDEM_MOE_ROUTING", "").lower() == "torch":
        logger.info("TANDEM_MOE_ROUTING=torch: MoE top-k, sort, gather and sum back run in torch")
        return None
    try:
        return NativeMoeRouting(build_library(SOURCE, "tandem_moe_routing", FLAGS, build_dir, isa))
    except (KernelBuildError, OSError) as exc:
        log_unbuilt(
            logger,
            exc,
            "no native MoE routing kernels (%s); top-k, sort, gather and sum back run in torch",
            exc,
        )
        return None


# The process's library, built and loaded on first use.
native_moe_routing = ProcessOnce(load_native_moe_routing)


def native_moe_routing_kernel(name: str) -> NativeChoice[Any]:
    """The CPU kernel ``name`` of this library for a dtype, where it is built."""
    return library_choice(native_moe_routing, name)
