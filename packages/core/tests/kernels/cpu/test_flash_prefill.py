"""Long chunks through torch's flash attention (fresh prompts in one call, chunks after cached
tokens in two merged by their log-sum-exps), the rest of a prefill group through the native
kernel: which sequence goes where, and the whole group's output against the torch reference
path, on any CPU (the split forced where this one would not choose it)."""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.cpu.amx_prefill import AmxPrefillAttention, load_amx_prefill
from tandem.core.kernels.cpu.attention_groups import native_prefill
from tandem.core.kernels.cpu.flash_prefill import (
    FLASH_MIN_TOKENS,
    flash_prefill_dtypes,
    split_prefill,
)
from tandem.core.kernels.cpu.native_build import ISA_LEVELS, selected_isa
from tandem.core.kernels.cpu.prefill_attention import native_prefill_attention
from tandem.core.kernels.reference.paged_attention import reference_prefill
from tandem.core.llm.attention_metadata import build_attention_metadata

from .attention_steps import make_step

NATIVE = native_prefill_attention()


def test_long_chunks_go_to_flash_and_the_rest_stays_native() -> None:
    # (cached, new): long fresh, short fresh, long after cached tokens, long fresh, short
    # after cached tokens, long after more than FLASH_MAX_CACHED_RATIO times its cached.
    chunks = [(0, 200), (0, 37), (90, 140), (0, FLASH_MIN_TOKENS), (30, 5), (600, 128)]
    qlens = torch.tensor([n for _, n in chunks])
    kv = torch.tensor([c + n for c, n in chunks])
    starts = torch.cumsum(qlens, 0) - qlens
    blocks = torch.arange(6 * 48).view(6, 48)
    split = split_prefill(blocks, starts, qlens, kv)
    assert split.flash == ((0, 200), (377, FLASH_MIN_TOKENS))
    assert [(c.start, c.tokens, c.cached) for c in split.continued] == [(237, 140, 90)]
    assert torch.equal(split.continued[0].blocks, blocks[2])
    assert split.native is not None
    native_blocks, native_starts, native_qlens, native_kv = split.native
    assert torch.equal(native_blocks, blocks[[1, 4, 5]])
    assert native_starts.tolist() == [200, 505, 510]
    assert native_qlens.tolist() == [37, 5, 128] and native_kv.tolist() == [37, 35, 728]

    # The tile kernel's threshold: the 37-token prompt joins, and every chunk taken is
    # also given as the native kernel's share is (the tile kernel's arguments).
    tiles = split_prefill(blocks, starts, qlens, kv, min_tokens=32)
    assert tiles.flash == ((0, 200), (200, 37), (377, FLASH_MIN_TOKENS))
    assert [(c.start, c.tokens) for c in tiles.continued] == [(237, 140)]
    assert tiles.long is not None and tiles.native is not None
    assert tiles.long[1].tolist() == [0, 200, 237, 377]
    assert torch.equal(tiles.long[0], blocks[:4]) and tiles.long[3].tolist() == [200, 37, 230, 128]
    assert tiles.native[1].tolist() == [505, 510]
    assert split.long is not None and split.long[1].tolist() == [0, 237, 377]
    # The tile kernel's rule: any cached share, up to a sequence length (the chunk after 600
    # cached joins; with max_keys 700 the 728-token sequence stays native).
    free = split_prefill(blocks, starts, qlens, kv, min_tokens=32, max_cached_ratio=None)
    assert free.long is not None and free.long[1].tolist() == [0, 200, 237, 377, 510]
    assert [(c.start, c.cached) for c in free.continued] == [(237, 90), (510, 600)]
    capped = split_prefill(blocks, starts, qlens, kv, 32, max_cached_ratio=None, max_keys=700)
    assert capped.long is not None and capped.long[1].tolist() == [0, 200, 237, 377]
    assert capped.native is not None and capped.native[1].tolist() == [505, 510]

    everything = split_prefill(blocks[[0, 2]], starts[[0, 2]], qlens[[0, 2]], kv[[0, 2]])
    assert everything.flash == ((0, 200),) and len(everything.continued) == 1
    assert everything.native is None and everything.long is not None
    nothing = split_prefill(blocks[[1, 4]], starts[[1, 4]], qlens[[1, 4]], kv[[1, 4]])
    assert nothing.flash == () and nothing.continued == () and nothing.native is not None
    assert torch.equal(nothing.native[0], blocks[[1, 4]]) and nothing.long is None


@pytest.fixture(scope="module")
def emulated_tiles(tmp_path_factory: pytest.TempPathFactory) -> AmxPrefillAttention:
    kernel = load_amx_prefill(tmp_path_factory.mktemp("tiles-emulated"), emulated=True)
    if kernel is None:
        pytest.skip("no C++ compiler to build the tile kernel")
    return kernel


@pytest.mark.skipif(NATIVE is None, reason="no C++ compiler to build the kernel")
@pytest.mark.parametrize(
    ("dtype", "long_chunks"),
    [(torch.float32, "torch"), (torch.bfloat16, "torch"), (torch.bfloat16, "tiles")],
)
def test_a_mixed_group_matches_the_reference(
    dtype: torch.dtype, long_chunks: str, request: pytest.FixtureRequest
) -> None:
    """``long_chunks``: through torch's flash attention, or all in one call of the AMX tile
    kernel (its emulated build, on any CPU), which takes chunks from ``TILE_MIN_TOKENS``
    (the 37-token one too)."""
    assert NATIVE is not None
    tiles: AmxPrefillAttention | None = None
    if long_chunks == "tiles":
        tiles = request.getfixturevalue("emulated_tiles")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block_size = 16, 8, 64, 16
    # Long fresh, short fresh, long after cached tokens (twice: one of them after a cached
    # part that ends inside a block, one after whole blocks), long fresh, short after cached.
    chunks = [(0, 200), (0, 37), (90, 140), (0, 130), (21, 3), (160, 128)]
    num_blocks = -(-288 // block_size) * len(chunks) + 1
    fi = make_step([], chunks, block_size=block_size, num_blocks=num_blocks, gen=gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    tokens = fi.num_tokens
    # q, k, v as the fused projection leaves them: views of one [T, (H + 2 Hkv) D] matrix;
    # the new tokens' K/V written into the cache as the layer writes them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    width_q, width_kv = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :width_q].view(tokens, heads, head_dim)
    k = qkv[:, width_q : width_q + width_kv].view(tokens, kv_heads, head_dim)
    v = qkv[:, width_q + width_kv :].view(tokens, kv_heads, head_dim)
    for cache, new in zip(caches, (k, v), strict=True):
        cache.view(-1, kv_heads, head_dim).index_copy_(0, fi.slot_mapping, new)
    group = build_attention_metadata(fi, torch.device("cpu")).prefill
    assert group is not None
    scale = head_dim**-0.5
    exact = torch.empty(q.shape)
    reference_prefill(
        q.float(), k.float(), v.float(), caches[0].float(), caches[1].float(), group, scale,
        exact,
    )  # fmt: skip

    out = torch.full(q.shape, float("nan"), dtype=dtype)
    kernel = native_prefill(NATIVE, flash_dtypes=frozenset({dtype}), tiles=lambda: tiles)
    kernel(q, k, v, *caches, group, scale, out)
    assert group.split is not None
    assert [n for _, n in group.split.flash] == ([200, 37, 130] if tiles else [200, 130])
    assert [(c.cached, c.tokens) for c in group.split.continued] == [(90, 140), (160, 128)]
    # bfloat16: each output is within a few units in the last place (2^-8 relative) of the
    # largest output, from rounding the inputs' products' sums and the output (twice for
    # the chunks after cached tokens: each call's, then the merge's).
    error = (out.float() - exact).abs().max().item()
    assert error <= (1e-5 if dtype is torch.float32 else 2e-2), error


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_float32_long_chunks_go_to_flash_only_without_avx512(
    monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    """Built without AVX-512 the native float32 kernel takes 1.3-3x flash attention's time
    from 64 tokens up (flash_prefill_dtypes has the figures); with it, the native one wins."""
    monkeypatch.setenv("TANDEM_CPU_ISA", level)
    without_avx512 = "avx512f" not in selected_isa().cpu_flags()
    assert (torch.float32 in flash_prefill_dtypes()) == without_avx512
    assert (torch.bfloat16 in flash_prefill_dtypes()) == torch.cpu._is_amx_tile_supported()
