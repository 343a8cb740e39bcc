"""The Triton decode kernel against the torch reference, under Triton's interpreter: ragged
context lengths (one token, inside a block, across many blocks), scattered blocks, the GQA
ratios and head and block sizes the served models use.

Tolerance: the kernel computes in float32 whatever the cache dtype (inputs widen exactly)
and rounds the output once, so it is compared with the reference run in float32 on the same
values. The two differ in the order of their float32 sums: softmax weights summing to one
over L positions and D-term scores, so the error is within (L + D) u max|v| (u = 2^-24, a
gamma bound on each sum), plus, in float16 and bfloat16, the output's one rounding (half an
ulp to nearest; a whole one under the interpreter's truncating bfloat16 conversion).
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.reference.paged_attention import reference_decode
from tandem.core.kernels.triton.paged_attention import paged_decode
from tandem.core.llm.attention_metadata import build_attention_metadata

from ..cpu.attention_steps import make_step

SHAPES = [
    # heads, kv heads, head_dim, block_size
    (4, 2, 64, 16),
    (8, 1, 128, 32),
    (2, 2, 256, 128),
    (16, 4, 128, 16),
]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mag = x.abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(mag)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_matches_the_reference(shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks = 4096 // block_size
    lens = [1, 5, block_size, 3 * block_size + 7, 130]
    step = make_step(lens, [], block_size=block_size, num_blocks=num_blocks, gen=gen)
    meta = build_attention_metadata(step, torch.device("cpu"))
    assert meta.decode is not None
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    got = paged_decode(q, q, q, k_cache, v_cache, meta.decode, scale, torch.empty_like(q))
    want = torch.empty(q.shape)
    caches = (k_cache.float(), v_cache.float())
    reference_decode(q.float(), q, q, *caches, meta.decode, scale, want)
    err = (got.float() - want).abs()
    bound = (max(lens) + head_dim) * 2.0**-24 * v_cache.float().abs().max()
    if dtype is not torch.float32:
        bound = bound + (1.0 if dtype is torch.bfloat16 else 0.5) * ulp(want, dtype)
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"


def test_a_query_view_of_a_wider_projection_is_read_in_place() -> None:
    gen = torch.Generator().manual_seed(5)
    step = make_step([9, 40], [], block_size=16, num_blocks=64, gen=gen)
    meta = build_attention_metadata(step, torch.device("cpu"))
    assert meta.decode is not None
    k_cache, v_cache = (torch.randn(64, 16, 2, 64, generator=gen) for _ in range(2))
    wide = torch.randn(2, 4, 128, generator=gen)
    q = wide[:, :, :64]
    got = paged_decode(q, q, q, k_cache, v_cache, meta.decode, 0.125, torch.empty(2, 4, 64))
    want = reference_decode(
        q.contiguous(), q, q, k_cache, v_cache, meta.decode, 0.125, torch.empty(2, 4, 64)
    )
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
