"""The decode kernel's scores on AMX tiles (csrc/paged_attention.cpp, run_rows_tiles): on the
CPU's own tiles where it has AMX, and on the test build whose tile instructions are software
(csrc/amx_tiles.h), which every AVX-512 CPU runs. Checked against float32 attention over the
same bfloat16 values, for every group size the path takes, head sizes 64 to 256, blocks of 16
and 32 tokens, lengths that end inside a tile, and garbage (NaN) in the cache rows a tile
reads past a sequence's last token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.core.kernels.cpu import native_build
from tandem.core.kernels.cpu.native_build import NoCompilerError
from tandem.core.kernels.cpu.paged_attention import (
    NativePagedAttention,
    build_library,
    native_paged_attention,
)

NATIVE = native_paged_attention()

# (query heads, KV heads), head size: a group of 2, 4, 8 and 16 query heads a KV head.
SHAPES = [
    ((16, 8), 64),
    ((8, 2), 64),
    ((16, 2), 64),
    ((32, 2), 64),
    ((16, 8), 128),
    ((32, 4), 128),
    ((32, 2), 128),
    ((4, 2), 256),
    ((16, 2), 256),
    ((32, 2), 256),
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> NativePagedAttention:
    try:
        path = build_library(tmp_path_factory.mktemp("pa-emulated"), emulated=True)
    except NoCompilerError:
        pytest.skip("no C++ compiler")
    kernel = NativePagedAttention(path)
    if not kernel.emulated:
        pytest.skip("the tile path sits in the AVX-512 code: this ISA level has none")
    return kernel


@pytest.fixture(params=["native", "emulated"])
def kernel(request: pytest.FixtureRequest) -> NativePagedAttention:
    if request.param == "emulated":
        emulated: NativePagedAttention = request.getfixturevalue("emulated")
        return emulated
    if NATIVE is None or not NATIVE.tiles_available:
        pytest.skip("no AMX tiles here (or at this ISA level) for the native build")
    return NATIVE


def _batch(
    heads: tuple[int, int], head_dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """A decode batch on scattered blocks: enough queries for a work item per token at this
    thread count, lengths 0, 1, one short of and one past a tile or a block, and longer;
    every cache row past a sequence's length NaN (a tile reads the rest of its 16 rows)."""
    gen = torch.Generator().manual_seed(seed)
    queries = 4 * torch.get_num_threads() + 5
    lens = torch.randint(1, 200, (queries,), generator=gen)
    lens[:6] = torch.tensor([0, 1, 15, 17, block_size, 2 * block_size + 1])
    width = -(-int(lens.max()) // block_size)
    num_blocks = queries * width + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(queries, width)
    shape = (num_blocks, block_size, heads[1], head_dim)
    k_cache = torch.full(shape, float("nan")).bfloat16()
    v_cache = torch.full(shape, float("nan")).bfloat16()
    for i in range(queries):
        n = int(lens[i])
        for cache in (k_cache, v_cache):
            rows = cache[tables[i]].flatten(0, 1)
            rows[:n] = torch.randn(n, heads[1], head_dim, generator=gen).bfloat16()
            cache[tables[i]] = rows.view(width, block_size, heads[1], head_dim)
    q = (torch.randn(queries, heads[0], head_dim, generator=gen) * 3).bfloat16()
    return q, k_cache, v_cache, tables, lens


def _exact(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """float32 attention over the same bfloat16 values."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape)
    for i in range(q.shape[0]):
        n = int(lens[i])
        if n == 0:
            continue
        keys = k_cache[tables[i]].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        values = v_cache[tables[i]].flatten(0, 1)[:n].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), keys) * scale
        out[i] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("heads", "head_dim"), SHAPES)
def test_tile_scores_stay_within_rounding_of_float32(
    kernel: NativePagedAttention, heads: tuple[int, int], head_dim: int, block_size: int
) -> None:
    q, k_cache, v_cache, tables, lens = _batch(heads, head_dim, block_size, seed=head_dim)
    assert kernel.scores_on_tiles(q.shape[0], heads, head_dim, block_size, torch.bfloat16)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    products = kernel.emulated_dot_products()
    kernel(out, q, k_cache, v_cache, tables, torch.arange(q.shape[0]), lens, scale)
    if kernel.emulated:
        # The call went through the tiles: a product per 32 dimensions of every 16 keys
        # of every KV head.
        tiles = sum(-(-int(n) // 16) for n in lens) * heads[1] * head_dim // 32
        assert kernel.emulated_dot_products() - products == tiles
    exact = _exact(q, k_cache, v_cache, tables, lens, scale)
    error = (out.float() - exact).abs()
    # Products of bfloat16 are exact in float32 and everything after is float32, rounded to
    # bfloat16 once: within half a unit in the last place (plus float32's own rounding).
    assert bool((error <= exact.abs() * 2.0**-8 + 1e-5).all())
    assert bool((out[0] == 0).all())


def test_the_tile_path_is_taken_where_it_applies() -> None:
    if NATIVE is None:
        pytest.skip("no C++ compiler")
    flags = native_build.selected_isa().cpu_flags()
    has_tiles = {"amx_tile", "amx_bf16", "avx512f"} <= flags and native_build.amx_tiles_granted()
    assert NATIVE.tiles_available == has_tiles
    if not has_tiles:
        pytest.skip("no AMX at this ISA level")
    many = 4 * torch.get_num_threads()
    assert NATIVE.scores_on_tiles(many, (16, 8), 64, 16, torch.bfloat16)
    assert NATIVE.scores_on_tiles(many, (64, 4), 128, 32, torch.bfloat16)
    # float32, a block that splits a tile, a group of 1 or 3, too few queries: vectors.
    assert not NATIVE.scores_on_tiles(many, (16, 8), 64, 16, torch.float32)
    assert not NATIVE.scores_on_tiles(many, (16, 8), 64, 8, torch.bfloat16)
    assert not NATIVE.scores_on_tiles(many, (8, 8), 64, 16, torch.bfloat16)
    assert not NATIVE.scores_on_tiles(many, (12, 4), 64, 16, torch.bfloat16)
    assert not NATIVE.scores_on_tiles(many - 1, (16, 8), 64, 16, torch.bfloat16)


def test_switched_off_the_tiles_leave_the_scores_to_the_vectors(
    emulated: NativePagedAttention,
) -> None:
    q, k_cache, v_cache, tables, lens = _batch((8, 2), 64, 16, seed=1)
    rows, scale = torch.arange(q.shape[0]), 0.125
    on, off = torch.empty_like(q), torch.empty_like(q)
    emulated(on, q, k_cache, v_cache, tables, rows, lens, scale)
    try:
        emulated.use_tiles(False)
        products = emulated.emulated_dot_products()
        emulated(off, q, k_cache, v_cache, tables, rows, lens, scale)
        assert emulated.emulated_dot_products() == products
    finally:
        emulated.use_tiles(True)
    # The two paths sum the same exact products in other orders: a rounding apart at most.
    assert (on.float() - off.float()).abs().max().item() <= 2e-2


def test_tiles_are_refused_where_the_build_has_none(tmp_path: Path) -> None:
    try:
        path = build_library(tmp_path, native_build.ISA_LEVELS["avx2"])
    except NoCompilerError:
        pytest.skip("no C++ compiler")
    kernel = NativePagedAttention(path)
    assert not kernel.tiles_available and not kernel.tiles
    with pytest.raises(ValueError, match="no AMX tiles"):
        kernel.use_tiles(True)
