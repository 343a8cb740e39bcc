"""What the attention kernels read besides the tensors: the step's groups of sequences, their
cache blocks, masks and lengths, built once per step on the host and shared by every layer.

The step's tokens are laid out decodes first (one query each), then prefill chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from tandem.core.kernels.cpu.flash_prefill import PrefillSplit
from tandem.core.kernels.linear_attention_metadata import FinishLinear, LinearAttentionMetadata


@dataclass
class AttentionGroup:
    """A batch of sequences whose queries are padded to one length."""

    # Cache blocks each sequence reads, in order; padding reads the null block.
    gather_blocks: torch.Tensor  # [B, N], N * block_size = L
    # True where query j of sequence b may attend context position l.
    mask: torch.Tensor | None  # [B, 1, Q, L] or None when nothing is masked
    # For prefill groups: flat token index of each padded query, and where results go back.
    query_index: torch.Tensor | None  # [B, Q]
    valid_queries: torch.Tensor | None  # [N] indices into B*Q of the real queries
    num_tokens: int
    # For the decode kernel reading the cache in place, per query token: how many cached
    # tokens it reads and which row of gather_blocks holds its sequence's blocks.
    kv_lens: torch.Tensor | None = None  # [num_tokens] int64
    table_row: torch.Tensor | None = None  # [num_tokens] int64
    # For the prefill kernel, per sequence (row of gather_blocks): its first query row in
    # the group, its query count and the tokens it attends (cached ones and its own).
    seq_query_start: torch.Tensor | None = None  # [B] int64
    seq_query_len: torch.Tensor | None = None  # [B] int64
    seq_kv_len: torch.Tensor | None = None  # [B] int64
    # How the prefill kernel divides the group between flash attention and itself: made by
    # the first layer that needs it, the same for every layer of the step.
    split: PrefillSplit | None = None
    # For ops that take lengths on the host (torch_npu's attention: ``context_lens`` is a host
    # tensor, ``actual_seq_lengths`` a list), the plan's own copies, int32: per sequence its
    # cached-plus-new tokens, and (prefill) its query count.
    host_kv_lens: torch.Tensor | None = None
    host_query_lens: torch.Tensor | None = None
    _block_table_int32: torch.Tensor | None = None

    def block_table_int32(self) -> torch.Tensor:
        """``gather_blocks`` as int32 (torch_npu's block tables), made once per step on the
        device by the first layer that asks."""
        table = self._block_table_int32
        if table is None:
            table = self.gather_blocks.to(torch.int32)
            self._block_table_int32 = table
        return table


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    num_decode_tokens: int
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    # For models with linear-attention (Gated DeltaNet) layers: their per-sequence state slots.
    linear: LinearAttentionMetadata | None = None
    _slot_mapping_int32: torch.Tensor | None = None

    def slot_mapping_int32(self) -> torch.Tensor:
        """``slot_mapping`` as int32 (torch_npu's cache write), made once per step."""
        slots = self._slot_mapping_int32
        if slots is None:
            slots = self.slot_mapping.to(torch.int32)
            self._slot_mapping_int32 = slots
        return slots


# A group kernel: (q, k, v of the group's new tokens, k_cache, v_cache, group, scale,
# out) -> out, with q/out [N, H, D] and k/v [N, Hkv, D]; writes the attention into out.
GroupKernel = Callable[..., torch.Tensor]


# Finishes a group on the device from its moved tensors (taken in the order they were listed).
FinishGroup = Callable[[Iterator[torch.Tensor], torch.device], AttentionGroup]


@dataclass
class AttentionPlan:
    """A step's attention metadata as host tensors to move, and how to finish it there."""

    tensors: list[torch.Tensor]
    num_decode_tokens: int
    decode: FinishGroup | None
    prefill: FinishGroup | None
    linear: FinishLinear | None

    def finish(self, moved: Sequence[torch.Tensor], device: torch.device) -> AttentionMetadata:
        """``moved``: ``tensors`` on ``device``, in order."""
        parts = iter(moved)
        slot_mapping = next(parts)
        decode = self.decode(parts, device) if self.decode else None
        prefill = self.prefill(parts, device) if self.prefill else None
        linear = self.linear(parts) if self.linear else None
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=self.num_decode_tokens,
            decode=decode,
            prefill=prefill,
            linear=linear,
        )
