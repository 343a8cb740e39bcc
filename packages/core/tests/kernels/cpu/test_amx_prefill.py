"""Prefill chunks' causal attention on AMX tiles (csrc/amx_prefill.cpp): on the CPU's own tiles
where it has AMX-BF16, and on the test build whose tile instructions are software
(csrc/amx_tiles.h), which every CPU runs (its softmax through AVX-512 where the ISA level has
it, plain loops below). Checked against float64 attention over the same bfloat16 values, for
every KV grouping, head sizes 64 to 256, fresh prompts and chunks after cached tokens, lengths
on and off the 16-row and 32-key tiles, blocks scattered over a cache whose unused slots hold
NaN, and query rows between the chunks the kernel must neither read nor write."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.core.kernels.cpu.amx_prefill import (
    AmxPrefillAttention,
    amx_prefill,
    build_amx_prefill,
)
from tandem.core.kernels.cpu.native_build import NoCompilerError

NATIVE = amx_prefill()
BLOCK_SIZE = 16

# (query heads, KV heads, head size), chunks as (cached tokens, new tokens).
CASES = [
    (8, 2, 64, [(0, 256), (0, 17), (0, 1), (0, 33), (0, 300)]),
    (16, 8, 64, [(0, 130), (90, 140), (16, 32), (7, 15)]),
    (4, 4, 128, [(0, 70), (128, 5), (33, 31)]),
    (32, 4, 128, [(0, 48), (200, 40)]),
    (8, 1, 256, [(0, 40), (64, 64), (1, 2)]),
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> AmxPrefillAttention:
    try:
        path = build_amx_prefill(tmp_path_factory.mktemp("tiles-emulated"), emulated=True)
    except NoCompilerError:
        pytest.skip("no C++ compiler")
    kernel = AmxPrefillAttention(Path(path))
    assert kernel.emulated
    return kernel


@pytest.fixture(params=["native", "emulated"])
def kernel(request: pytest.FixtureRequest) -> AmxPrefillAttention:
    if request.param == "emulated":
        emulated: AmxPrefillAttention = request.getfixturevalue("emulated")
        return emulated
    if NATIVE is None:
        pytest.skip("no AMX-BF16 tiles here (or at this ISA level) for the native build")
    return NATIVE


class Step:
    """A prefill group: q rows of each chunk after a gap of 3 NaN rows, and each sequence's
    keys and values (cached and new) on scattered blocks of caches that are NaN elsewhere."""

    def __init__(
        self, heads: int, kv_heads: int, dim: int, chunks: list[tuple[int, int]], seed: int
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        gap = 3
        news = [n for _, n in chunks]
        self.starts = torch.tensor([sum(news[:i]) + gap * (i + 1) for i in range(len(news))])
        rows = int(self.starts[-1]) + news[-1] + gap
        q = torch.full((rows, heads, dim), float("nan"))
        for start, n in zip(self.starts.tolist(), news, strict=True):
            q[start : start + n] = torch.randn(n, heads, dim, generator=gen)
        self.q = q.bfloat16()
        self.q_lens = torch.tensor(news)
        self.kv_lens = torch.tensor([c + n for c, n in chunks])
        width = -(-int(self.kv_lens.max()) // BLOCK_SIZE)
        num_blocks = len(chunks) * width + 1
        self.tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(len(chunks), width)
        shape = (num_blocks, BLOCK_SIZE, kv_heads, dim)
        self.k_cache = torch.full(shape, float("nan")).bfloat16()
        self.v_cache = torch.full(shape, float("nan")).bfloat16()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for i, total in enumerate(self.kv_lens.tolist()):
            keys = torch.randn(total, kv_heads, dim, generator=gen).bfloat16()
            values = torch.randn(total, kv_heads, dim, generator=gen).bfloat16()
            for j in range(total):
                block = int(self.tables[i, j // BLOCK_SIZE])
                self.k_cache[block, j % BLOCK_SIZE] = keys[j]
                self.v_cache[block, j % BLOCK_SIZE] = values[j]
            self.keys.append(keys)
            self.values.append(values)

    def run(self, kernel: AmxPrefillAttention, scale: float) -> torch.Tensor:
        out = torch.full(self.q.shape, float("nan"), dtype=torch.bfloat16)
        kernel(out, self.q, self.k_cache, self.v_cache, self.tables, self.starts, self.q_lens,
               self.kv_lens, scale)  # fmt: skip
        return out

    def exact(self, i: int, scale: float) -> torch.Tensor:
        """Chunk i's attention in float64, [new, H, D]."""
        start, n, total = int(self.starts[i]), int(self.q_lens[i]), int(self.kv_lens[i])
        group = self.q.shape[1] // self.keys[i].shape[1]
        qs = self.q[start : start + n].double().transpose(0, 1)
        ks = self.keys[i].double().transpose(0, 1).repeat_interleave(group, 0)
        vs = self.values[i].double().transpose(0, 1).repeat_interleave(group, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        later = torch.ones(n, total, dtype=torch.bool).triu(total - n + 1)
        return (scores.masked_fill(later, float("-inf")).softmax(-1) @ vs).transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "chunks"), CASES)
def test_matches_float64_attention(
    kernel: AmxPrefillAttention,
    heads: int,
    kv_heads: int,
    dim: int,
    chunks: list[tuple[int, int]],
) -> None:
    step = Step(heads, kv_heads, dim, chunks, seed=dim + heads)
    scale = dim**-0.5
    out = step.run(kernel, scale)
    covered = torch.zeros(out.shape[0], dtype=torch.bool)
    for i, (start, n) in enumerate(zip(step.starts.tolist(), step.q_lens.tolist(), strict=True)):
        covered[start : start + n] = True
        # Error analysis: the scores are exact products summed in float32 (relative 2^-24
        # a term); each probability is rounded to bfloat16 (relative 2^-9) before it weighs
        # its value, so the weighted mean moves by at most 2^-9 max|v|; the output is rounded
        # once more (2^-9 |out| <= 2^-9 max|v|). Within 2^-8 max|v|, with float32's share.
        vmax = step.values[i].double().abs().max().item()
        error = (out[start : start + n].double() - step.exact(i, scale)).abs().max().item()
        assert error <= 2**-8 * vmax * (1 + 1e-3), (i, error, vmax)
    # Rows outside the chunks are not written.
    assert out[~covered].isnan().all()


def test_the_emulated_build_runs_its_tile_instructions(emulated: AmxPrefillAttention) -> None:
    step = Step(8, 2, 64, [(0, 40)], seed=1)
    before = int(emulated.lib.tandem_amx_emulated_dot_products())
    step.run(emulated, 0.125)
    # A head's 40 rows are 3 items of 16, 16 and 8 rows, which see 16, 32 and 40 keys: 1, 2
    # and 3 score tiles of 2 products (64 dims), 1, 1 and 2 key blocks of 4 value products.
    assert int(emulated.lib.tandem_amx_emulated_dot_products()) - before == 8 * (12 + 16)


def test_bad_arguments_are_refused(emulated: AmxPrefillAttention) -> None:
    step = Step(8, 2, 64, [(4, 20)], seed=2)
    out = torch.empty(step.q.shape, dtype=torch.bfloat16)
    args = (step.k_cache, step.v_cache, step.tables, step.starts, step.q_lens, step.kv_lens)
    with pytest.raises(ValueError, match="bfloat16"):
        emulated(out, step.q.float(), *args, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        emulated(out, step.q.transpose(1, 2), *args, 0.125)
    with pytest.raises(ValueError, match="int64"):
        emulated(out, step.q, *args[:3], step.starts.int(), *args[4:], 0.125)
    # Fewer tokens attended than the chunk has, a group that does not divide, and a head
    # size the kernel has no tiles for: refused by the library itself.
    with pytest.raises(ValueError, match="code 1"):
        emulated(out, step.q, *args[:5], step.q_lens - 1, 0.125)
    three = torch.zeros(*step.k_cache.shape[:2], 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="code 1"):
        emulated(out, step.q, three, three, *args[2:], 0.125)
    q96 = torch.zeros(4, 2, 96, dtype=torch.bfloat16)
    cache96 = torch.zeros(2, BLOCK_SIZE, 2, 96, dtype=torch.bfloat16)
    one = torch.tensor([4])
    with pytest.raises(ValueError, match="code 1"):
        emulated(q96.clone(), q96, cache96, cache96, torch.tensor([[1]]), one * 0, one, one, 0.1)
