"""Fresh prompts' causal attention on AMX tiles (csrc/amx_prefill.cpp): on the CPU's own tiles
where it has AMX-BF16, and on the test build whose tile instructions are software
(csrc/amx_tiles.h), which every CPU runs (its softmax through AVX-512 where the ISA level has
it, plain loops below). Checked against float64 attention over the same bfloat16 values, for
every KV grouping, head sizes 64 to 256, prompt lengths on and off the 16-row and 32-key
tiles, q/k/v as views of one fused projection, and prompts with rows between them the kernel
must not touch."""

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

# (query heads, KV heads, head size), prompt lengths.
CASES = [
    (8, 2, 64, [256, 17, 1, 33, 300]),
    (16, 8, 64, [130, 16, 32, 15]),
    (4, 4, 128, [70, 5, 31]),
    (32, 4, 128, [48]),
    (8, 1, 256, [40, 64, 2]),
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> AmxPrefillAttention:
    try:
        path = build_amx_prefill(tmp_path_factory.mktemp("fresh-emulated"), emulated=True)
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


def _prompts(
    heads: int, kv_heads: int, dim: int, lens: list[int], seed: int
) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one [N, (H + 2 Hkv) D] projection; each prompt after a gap of 3
    rows (NaN in q, k and v: a tile that read them would spread NaN into the outputs)."""
    gen = torch.Generator().manual_seed(seed)
    gap = 3
    starts = torch.tensor([sum(lens[:i]) + gap * (i + 1) for i in range(len(lens))])
    rows = int(starts[-1]) + lens[-1] + gap
    qkv = torch.full((rows, (heads + 2 * kv_heads) * dim), float("nan"))
    for start, n in zip(starts.tolist(), lens, strict=True):
        qkv[start : start + n] = torch.randn(n, qkv.shape[1], generator=gen)
    qkv = qkv.bfloat16()
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    return q, k, v, starts, torch.tensor(lens)


def _exact(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, n: int, scale: float
) -> torch.Tensor:
    """Causal attention of one prompt in float64, [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    qs = q[start : start + n].double().transpose(0, 1)
    ks = k[start : start + n].double().transpose(0, 1).repeat_interleave(group, 0)
    vs = v[start : start + n].double().transpose(0, 1).repeat_interleave(group, 0)
    scores = (qs @ ks.transpose(1, 2)) * scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ vs).transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "lens"), CASES)
def test_matches_float64_attention(
    kernel: AmxPrefillAttention, heads: int, kv_heads: int, dim: int, lens: list[int]
) -> None:
    q, k, v, starts, lens_t = _prompts(heads, kv_heads, dim, lens, seed=dim + heads)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    scale = dim**-0.5
    kernel(q, k, v, starts, lens_t, scale, out)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for start, n in zip(starts.tolist(), lens, strict=True):
        covered[start : start + n] = True
        got = out[start : start + n].double()
        # Error analysis: the scores are exact products summed in float32 (relative 2^-24
        # a term); each probability is rounded to bfloat16 (relative 2^-9) before it weighs
        # its value, so the weighted mean moves by at most 2^-9 max|v|; the output is rounded
        # once more (2^-9 |out| <= 2^-9 max|v|). Within 2^-8 max|v|, with float32's share.
        vmax = v[start : start + n].double().abs().max().item()
        error = (got - _exact(q, k, v, start, n, scale)).abs().max().item()
        assert error <= 2**-8 * vmax * (1 + 1e-3), (start, n, error, vmax)
    # Rows outside the prompts are not written.
    assert out[~covered].isnan().all()


def test_the_emulated_build_runs_its_tile_instructions(emulated: AmxPrefillAttention) -> None:
    before = int(emulated.lib.tandem_amx_emulated_dot_products())
    q, k, v, starts, lens = _prompts(8, 2, 64, [40], seed=1)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    emulated(q, k, v, starts, lens, 0.125, out)
    # A head's 40 rows are 3 items of 16, 16 and 8 rows, which see 16, 32 and 40 keys: 1, 2
    # and 3 score tiles of 2 products (64 dims), 1, 1 and 2 key blocks of 4 value products.
    assert int(emulated.lib.tandem_amx_emulated_dot_products()) - before == 8 * (12 + 16)


def test_bad_arguments_are_refused(emulated: AmxPrefillAttention) -> None:
    q, k, v, starts, lens = _prompts(8, 2, 64, [20], seed=2)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        emulated(q.float(), k, v, starts, lens, 0.125, out)
    with pytest.raises(ValueError, match="outside"):
        emulated(q, k, v, starts, lens + q.shape[0], 0.125, out)
    with pytest.raises(ValueError, match="outside"):
        emulated(q, k, v, starts, lens * 0, 0.125, out)
    with pytest.raises(ValueError, match="int64"):
        emulated(q, k, v, starts.int(), lens, 0.125, out)
    three = torch.zeros(q.shape[0], 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group"):
        emulated(q, three, three, starts, lens, 0.125, out)
    with pytest.raises(ValueError, match="contiguous"):
        emulated(q.transpose(1, 2), k, v, starts, lens, 0.125, out)
    # A head size the kernel has no tiles for: refused by the library itself.
    q96 = torch.zeros(4, 2, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="code 1"):
        emulated(q96, q96, q96, torch.tensor([0]), torch.tensor([4]), 0.1, q96.clone())
