"""Steps of decodes and prefill chunks on randomly scattered cache blocks, and attention
layers over them, for the attention kernels' tests."""

from __future__ import annotations

import torch

from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.reference.paged_attention import reference_decode, reference_prefill
from tandem.core.layers.attention import PagedAttention
from tandem.core.llm.forward_input import ForwardInput, SamplingBatch


def no_sampling() -> SamplingBatch:
    return SamplingBatch(
        temperatures=torch.zeros(0),
        top_p=torch.ones(0),
        top_k=torch.zeros(0, dtype=torch.int64),
        seeds=(),
        steps=(),
        all_greedy=True,
        needs_top_k_top_p=False,
        max_logprobs=None,
    )


def make_step(
    decode_lens: list[int],
    prefills: list[tuple[int, int]],
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
) -> ForwardInput:
    """A step of decodes (context lengths) then prefill chunks ((cached before, new)),
    each sequence on its own randomly scattered cache blocks."""
    seqs = [(n - 1, 1) for n in decode_lens] + prefills
    totals = [cached + new for cached, new in seqs]
    width = max(-(-t // block_size) for t in totals)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), width, dtype=torch.int64)  # padded with the null block
    for row, total in enumerate(totals):
        for col in range(-(-total // block_size)):
            tables[row, col] = free.pop()
    positions = torch.cat([torch.arange(c, c + n) for c, n in seqs])
    rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([n for _, n in seqs]))
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    return ForwardInput(
        input_ids=torch.zeros(positions.shape[0], dtype=torch.int64),
        positions=positions,
        slot_mapping=slots,
        query_lens=torch.tensor([n for _, n in seqs]),
        context_lens=torch.tensor(totals),
        block_tables=tables,
        state_slots=torch.zeros(len(seqs), dtype=torch.int64),
        num_decodes=len(decode_lens),
        sample_indices=torch.zeros(0, dtype=torch.int64),
        sampling=no_sampling(),
        block_size=block_size,
    )


def make_layer(
    heads: tuple[int, int], head_dim: int, caches: tuple[torch.Tensor, torch.Tensor]
) -> PagedAttention:
    layer = PagedAttention(heads[0], heads[1], head_dim, scale=head_dim**-0.5)
    layer.bind_cache(caches[0].clone(), caches[1].clone())
    return layer


def force_reference(layer: PagedAttention, dtype: torch.dtype) -> None:
    layer._decode._resolved = (dtype, reference_decode)
    layer._prefill._resolved = (dtype, reference_prefill)


def run_layer(
    layer: PagedAttention, qkv: tuple[torch.Tensor, ...], meta: AttentionMetadata
) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = layer(*qkv, meta)
    return out
