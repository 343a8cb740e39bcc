"""GPTQ (``models/gptq_solver.py``) against round to nearest, on a layer whose inputs are
correlated as real activations are: its output error on those inputs is lower, which only the
error feedback can give (both choose codes from the same quantizer grid); what it writes is a
valid GPTQ weight (codes in range, every group ``group_size`` inputs, in activation order too);
and on the pretrained stories260k, calibrated on stories it tells itself, it moves the
next-token distribution less than round to nearest does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.core import LLMEngine, SamplingParams
from tandem.core.demo.pretrained import stories260k_folder
from tandem.core.llm.tokenizer import Tokenizer
from tandem.core.models.calibration import collect_hessians
from tandem.core.models.gptq_solver import gptq_quantize, quantize_gptq
from tandem.core.models.w4a16_writer import write_w4a16

from ..conftest import EngineFactory, prompt_logits
from .test_quantized_accuracy import TEXTS

STORIES = stories260k_folder()


def _layer(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [32, 128] and 1024 activations mixed from 16 sources, with a few inputs much
    larger than the rest (as real activations have)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(32, 128, generator=gen, dtype=torch.float64)
    sources = torch.randn(1024, 16, generator=gen, dtype=torch.float64)
    x = sources @ torch.randn(16, 128, generator=gen, dtype=torch.float64)
    x += 0.1 * torch.randn(1024, 128, generator=gen, dtype=torch.float64)
    x[:, :4] *= 10
    return weight, x


def _dequantized(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    g = g_idx.long()
    return (codes.double() - zeros.double()[:, g]) * scales.double()[:, g]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_beats_round_to_nearest_on_correlated_inputs(act_order: bool, sym: bool) -> None:
    weight, x = _layer(seed=1)
    codes, zeros, scales, g_idx = gptq_quantize(weight, x.t() @ x, 32, sym, act_order)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert torch.bincount(g_idx.long()).tolist() == [32] * 4
    assert act_order != torch.equal(g_idx.long(), torch.arange(128) // 32)
    rtn_codes, rtn_zeros, rtn_scales = quantize_gptq(weight, 32, sym)
    consecutive = torch.arange(128) // 32
    rtn = _dequantized(rtn_codes, rtn_zeros, rtn_scales, consecutive)
    gptq = _dequantized(codes, zeros, scales, g_idx)
    rtn_error = torch.linalg.norm(x @ (weight - rtn).t())
    gptq_error = torch.linalg.norm(x @ (weight - gptq).t())
    assert gptq_error < 0.7 * rtn_error, (gptq_error, rtn_error)


def test_inputs_without_activations_get_zero_weights() -> None:
    weight, x = _layer(seed=2)
    x[:, 100:] = 0
    codes, zeros, scales, g_idx = gptq_quantize(weight, x.t() @ x, 32, sym=True)
    assert torch.equal(_dequantized(codes, zeros, scales, g_idx)[:, 100:], torch.zeros(32, 28))


def _log_probs(engine: LLMEngine, prompts: list[list[int]]) -> torch.Tensor:
    return torch.cat([prompt_logits(engine, p) for p in prompts]).double().log_softmax(-1)


@pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason="stories260k is absent")
def test_calibrated_stories260k_moves_less_than_round_to_nearest(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    """Measured here (group 32, symmetric, 32 calibration stories of 200 tokens, KL over
    the 506 positions of the accuracy test's three held-out stories): round to nearest mean
    KL 3.9e-2, GPTQ 1.9e-2 (2.2e-2 when, by one seed for all, the 32 were one story). The
    bound asks for a quarter less than round to nearest."""
    engine = make_engine(STORIES, dtype="float32")
    told = engine.generate(
        [[1]] * 32,
        [SamplingParams(max_tokens=199, temperature=1.0, seed=seed) for seed in range(32)],
    )
    samples = [[1, *out.token_ids] for out in told]
    assert len({tuple(s) for s in samples}) == len(samples)  # 32 stories, not one 32 times
    held_out = [Tokenizer(STORIES).encode(text) for text in TEXTS]
    exact = _log_probs(engine, held_out)
    kl = {}
    for name, hessians in (("rtn", None), ("gptq", collect_hessians(STORIES, samples))):
        folder = tmp_path / name
        write_w4a16(STORIES, folder, group_size=32, sym=True, hessians=hessians)
        approx = _log_probs(make_engine(folder, dtype="float32"), held_out)
        kl[name] = (exact.exp() * (exact - approx)).sum(-1).mean().item()
    assert kl["gptq"] < 0.75 * kl["rtn"], kl
