"""Our Llama / Qwen2 / Qwen3 against transformers on random tiny checkpoints: prompt logits
within 1e-4 in float32, and greedy generation token for token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.core import SamplingParams
from tandem.core.llm.engine import LLMEngine

from ..conftest import prompt_logits

CASES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    # GQA, untied, head_dim != hidden / heads, rope_theta in rope_parameters (transformers 5).
    "llama-gqa-untied": ("LlamaForCausalLM", {"head_dim": 32}, None),
    # Llama with attention and MLP biases, tied embeddings, sharded safetensors.
    "llama-bias-tied-sharded": (
        "LlamaForCausalLM",
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        "60KB",
    ),
    # Qwen2: q/k/v bias, no o bias, tied.
    "qwen2-bias-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}, None),
    # Qwen3: q/k RMSNorm, head_dim 32 != 64 / 4, untied, 4 query heads over 1 KV head.
    "qwen3-qknorm": ("Qwen3ForCausalLM", {"head_dim": 32, "num_key_value_heads": 1}, None),
}

PROMPTS = [[5, 17, 300, 42, 9, 100, 7], [3, 9, 27, 81, 243, 11, 33, 99, 297, 2, 6, 18, 54]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(
    case: str,
    hf_model: Callable[..., tuple[Path, Any]],
    make_engine: Callable[..., LLMEngine],
) -> None:
    architecture, overrides, shard = CASES[case]
    folder, reference = hf_model(architecture, max_shard_size=shard, **overrides)
    if shard is not None:
        assert (Path(folder) / "model.safetensors.index.json").is_file()
        assert len(list(Path(folder).glob("*.safetensors"))) > 1
    engine = make_engine(folder)

    for prompt in PROMPTS:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        got = prompt_logits(engine, prompt)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-4

    new_tokens = 40
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([PROMPTS[1]]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPTS[1]) :].tolist()
    assert len(generated) == new_tokens
    [out] = engine.generate(
        [PROMPTS[1]], SamplingParams.greedy(max_tokens=new_tokens, ignore_eos=True)
    )
    assert out.token_ids == generated
