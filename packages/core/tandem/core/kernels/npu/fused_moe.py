"""The router's top-k through ``npu_moe_gating_top_k_softmax``, and the routed experts through
torch_npu's MoE ops, as vllm-ascend chains them: the (token,
choice) rows sorted by expert (``npu_moe_init_routing``), each expert's row count
(``npu_moe_compute_expert_tokens``, cumulative), one grouped matmul per projection
(``npu_grouped_matmul``, the experts' weights read as [E, in, out] views of the checkpoint's
[E, out, in]), SwiGLU between them, and the rows scaled by their routing weights and summed
back to their tokens (``npu_moe_finalize_routing``). Nothing is read back to the host."""

from __future__ import annotations

import torch
import torch_npu

from tandem.core.kernels.reference.fused_moe import fused_moe as reference_fused_moe

# group_list holds each expert's cumulative row end (group_list_type 0); one output tensor
# for the one x (split_item 2); rows grouped along M (group_type 0).
CUMULATIVE, ONE_OUTPUT, GROUP_ROWS = 0, 2, 0


def _grouped(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = torch_npu.npu_grouped_matmul(
        [rows],
        [weight.transpose(1, 2)],
        group_list=ends,
        split_item=ONE_OUTPUT,
        group_type=GROUP_ROWS,
        group_list_type=CUMULATIVE,
    )
    result: torch.Tensor = out[0]
    return result


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    if activation != "silu":
        return reference_fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
    num_tokens, k = topk_ids.shape
    experts = topk_ids.to(torch.int32)
    # Row (t, j) of the routing is source row j * T + t, as the gating op numbers them.
    row_idx = torch.arange(num_tokens * k, dtype=torch.int32, device=x.device)
    row_idx = row_idx.view(k, num_tokens).t().contiguous()
    rows, expanded_row_idx, expanded_experts = torch_npu.npu_moe_init_routing(
        x, row_idx, experts, active_num=num_tokens
    )
    ends = torch_npu.npu_moe_compute_expert_tokens(expanded_experts, w13.shape[0])
    ends = ends.to(torch.int64)
    hidden = torch_npu.npu_swiglu(_grouped(rows, w13, ends), dim=-1)
    down = _grouped(hidden, w2, ends)
    out: torch.Tensor = torch_npu.npu_moe_finalize_routing(
        down,
        None,
        None,
        None,
        topk_weights.to(x.dtype),
        expanded_row_idx,
        experts,
    )
    return out


def topk_softmax(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(logits, k=top_k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int64)
