"""The CPU prefill-attention kernel against the torch reference path on the shapes its work
items split unevenly (query groups of 3, 7 and 64 heads, blocks smaller than its 16-key
tiles, head sizes up to 256), and the same checks for each code path it compiles to: the
AVX512-BF16 one this machine may pick, AVX-512 without BF16, and the portable loops CPUs
without AVX-512 get."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from tandem.core.kernels.attention_metadata import AttentionGroup
from tandem.core.kernels.cpu.prefill_attention import (
    NativePrefillAttention,
    build_library,
    native_prefill_attention,
)
from tandem.core.kernels.reference.paged_attention import reference_prefill
from tandem.core.llm.attention_metadata import build_attention_metadata

from .attention_steps import make_step

NATIVE = native_prefill_attention()
needs_native = pytest.mark.skipif(NATIVE is None, reason="no C++ compiler to build the kernel")

# (cached before, new) per chunk: fresh prompts, one-token chunks, long and short chunks
# after cached tokens, a chunk ending mid-tile.
CHUNKS = [(0, 37), (0, 1), (90, 5), (21, 44), (128, 16), (3, 1)]


def _case(
    heads: tuple[int, int], head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionGroup, torch.Tensor]:
    """q, the caches holding every chunk's K/V, the prefill group, and the reference output
    computed in float32 from the same values."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-256 // block_size) * len(CHUNKS) + 1
    fi = make_step([], CHUNKS, block_size=block_size, num_blocks=num_blocks, gen=gen)
    shape = (num_blocks, block_size, heads[1], head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    t = fi.num_tokens
    q = torch.randn(t, heads[0], head_dim, generator=gen).to(dtype)
    for cache in caches:
        new = torch.randn(t, heads[1], head_dim, generator=gen).to(dtype)
        cache.view(-1, heads[1], head_dim).index_copy_(0, fi.slot_mapping, new)
    group = build_attention_metadata(fi, torch.device("cpu")).prefill
    assert group is not None
    exact = torch.empty(q.shape)
    reference_prefill(
        q.float(), q.float(), q.float(), caches[0].float(), caches[1].float(), group,
        head_dim**-0.5, exact,
    )  # fmt: skip
    return q, caches[0], caches[1], group, exact


def _attend(
    kernel: NativePrefillAttention,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
) -> torch.Tensor:
    assert group.seq_query_start is not None and group.seq_query_len is not None
    assert group.seq_kv_len is not None
    out = torch.full_like(q, float("nan"))
    kernel(
        out, q, k_cache, v_cache, group.gather_blocks, group.seq_query_start,
        group.seq_query_len, group.seq_kv_len, q.shape[-1] ** -0.5,
    )  # fmt: skip
    return out


def _check(kernel: NativePrefillAttention, dtype: torch.dtype, **shape: object) -> None:
    q, k_cache, v_cache, group, exact = _case(dtype=dtype, seed=len(str(shape)), **shape)  # type: ignore[arg-type]
    out = _attend(kernel, q, k_cache, v_cache, group)
    error = (out.float() - exact).abs().max().item()
    # float32: summed in another order than the reference; bfloat16: the probabilities are
    # rounded for the value product (as torch's flash attention rounds them), the output once.
    assert error <= (1e-5 if dtype is torch.float32 else 2e-2), error


@needs_native
@pytest.mark.parametrize("heads", [(12, 4), (14, 2), (64, 1), (8, 8)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uneven_items_match_the_reference(
    heads: tuple[int, int], block_size: int, dtype: torch.dtype
) -> None:
    assert NATIVE is not None
    _check(NATIVE, dtype, heads=heads, head_dim=64, block_size=block_size)


@needs_native
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_heads_match_the_reference(head_dim: int, dtype: torch.dtype) -> None:
    assert NATIVE is not None
    _check(NATIVE, dtype, heads=(8, 2), head_dim=head_dim, block_size=8)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


# The code paths other CPUs compile to, built here for an x86 machine that can run them.
BUILDS = {
    "portable": ("-march=x86-64-v3", {"avx2", "fma"}),
    "avx512_without_bf16": ("-march=skylake-avx512", {"avx512f", "avx512bw", "avx512vl"}),
}


@needs_native
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_each_code_path_matches_the_reference(build: str, tmp_path: Path) -> None:
    march, needs = BUILDS[build]
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {build} build")
    flags = ("-O3", march, "-fopenmp", "-std=c++17", "-fPIC")
    kernel = NativePrefillAttention(build_library(tmp_path, flags=flags))
    for dtype in (torch.float32, torch.bfloat16):
        _check(kernel, dtype, heads=(14, 2), head_dim=64, block_size=16)
        _check(kernel, dtype, heads=(8, 8), head_dim=128, block_size=4)


@needs_native
def test_the_kernel_refuses_what_it_cannot_read() -> None:
    assert NATIVE is not None
    q, k_cache, v_cache, group, _ = _case((4, 2), 64, 16, torch.float32, seed=1)
    assert group.seq_query_start is not None and group.seq_kv_len is not None
    assert group.seq_query_len is not None
    with pytest.raises(ValueError, match="contiguous"):
        NATIVE(
            torch.empty_like(q), q.transpose(1, 2).contiguous().transpose(1, 2), k_cache,
            v_cache, group.gather_blocks, group.seq_query_start, group.seq_query_len,
            group.seq_kv_len, 0.125,
        )  # fmt: skip
    # A chunk longer than the tokens it attends cannot be.
    with pytest.raises(ValueError, match="code 4"):
        NATIVE(
            torch.empty_like(q), q, k_cache, v_cache, group.gather_blocks,
            group.seq_query_start, group.seq_query_len, group.seq_query_len - 1, 0.125,
        )  # fmt: skip
    assert not NATIVE.supports(80, torch.float32)
    assert not NATIVE.supports(64, torch.float16)
