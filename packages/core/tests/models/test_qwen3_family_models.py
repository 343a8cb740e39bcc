"""Qwen3.5, Qwen3.5-MoE (both also as the text part of ``*ForConditionalGeneration``) and
Qwen3-MoE against transformers on random tiny checkpoints written by ``save_pretrained``, in
float32, through the real engine (``LLMEngine``): logits of a whole prompt (against
transformers in float64, within twice transformers' own float32 error), then greedy
generation of three prompts of different lengths at once, 48 new tokens each, with a token
budget of 8 per step, so every prompt is prefilled in several chunks and steps mix prefill
chunks with decodes; then the same with tensor parallelism over two in-process ranks.

Greedy tokens must equal transformers' ``generate``. The one divergence allowed is at a near-tie
of transformers' top two logits (within ``NEAR_TIE``), where float rounding legitimately decides;
the test stops comparing that prompt there, and only there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from reference_models import write_reference_model

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import ParallelConfig

from ..conftest import EngineFactory, assert_all_returned, prompt_logits

NEW_TOKENS = 48
NEAR_TIE = 1e-3
LOGITS_TOLERANCE = 1e-4
PROMPTS = [
    [5, 17, 200, 42, 9, 100, 7],
    [3, 9, 27, 81, 243, 11, 33, 99, 41, 2, 6, 18, 54, 162, 230, 178, 22, 66, 198, 82, 246, 226],
    list(range(10, 250, 6)),  # 40 tokens
]
# Tokens per engine step: the prompts above span 1, 3 and 5 chunks, all in flight together.
TOKENS_PER_STEP = 8

_TEXT = {"vocab_size": 256, "max_position_embeddings": 512}
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

L, F = "linear_attention", "full_attention"
# name: (architecture, text config overrides, save fused experts)
CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    # Every 4th layer full (the config default), GQA 4/2, tied embeddings.
    "qwen3_5-default-mix-tied": (
        "Qwen3_5ForCausalLM",
        {**_TEXT, "num_hidden_layers": 4, "intermediate_size": 96, "full_attention_interval": 4,
         "tie_word_embeddings": True},
        False,
    ),
    # Full attention first, attention biases, one KV head, three value heads per key head.
    "qwen3_5-full-first-bias-mqa": (
        "Qwen3_5ForCausalLM",
        {**_TEXT, "layer_types": [F, L, L], "num_hidden_layers": 3, "intermediate_size": 96,
         "attention_bias": True, "num_key_value_heads": 1, "linear_num_value_heads": 6,
         "partial_rotary_factor": 0.5},
        False,
    ),
    # The text model of the composite checkpoint; vision weights skipped.
    "qwen3_5-conditional-generation": (
        "Qwen3_5ForConditionalGeneration",
        {**_TEXT, "layer_types": [L, F], "num_hidden_layers": 2, "intermediate_size": 96},
        False,
    ),
    # Top-2 of 8 experts and a shared expert, per-expert checkpoint names.
    "qwen3_5_moe": (
        "Qwen3_5MoeForCausalLM",
        {**_TEXT, **_MOE, "layer_types": [L, F, L], "num_hidden_layers": 3,
         "shared_expert_intermediate_size": 48},
        False,
    ),
    # The composite MoE checkpoint with fused expert tensors (as Qwen3.5-MoE releases).
    "qwen3_5_moe-conditional-generation-fused": (
        "Qwen3_5MoeForConditionalGeneration",
        {**_TEXT, **_MOE, "layer_types": [F, L], "num_hidden_layers": 2,
         "shared_expert_intermediate_size": 48},
        True,
    ),
    # No shared expert; a dense layer among sparse ones, unnormalised top-k.
    "qwen3_moe-mlp-only-layer": (
        "Qwen3MoeForCausalLM",
        {**_TEXT, **_MOE, "num_hidden_layers": 3, "intermediate_size": 96, "head_dim": 16,
         "mlp_only_layers": [1]},
        False,
    ),
    # Every second layer sparse, normalised top-k, one KV head.
    "qwen3_moe-sparse-step-2": (
        "Qwen3MoeForCausalLM",
        {**_TEXT, **_MOE, "num_hidden_layers": 4, "intermediate_size": 96, "head_dim": 16,
         "decoder_sparse_step": 2, "norm_topk_prob": True, "num_key_value_heads": 1},
        False,
    ),
}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    """These tensors are tiny: on a busy machine waking a second OpenMP thread costs more than
    the work (a depthwise conv1d of 4 steps: 25 ms with two threads, 0.2 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """The case's checkpoint folder (with the demo tokenizer) and its transformers model."""
    built: dict[str, tuple[Path, Any]] = {}

    def get(case: str) -> tuple[Path, Any]:
        if case not in built:
            architecture, text, fused = CASES[case]
            folder = tmp_path_factory.mktemp(case)
            hf = write_reference_model(folder, architecture, fused_experts=fused, **text)
            built[case] = (folder, hf)
        return built[case]

    return get


def _engine(make_engine: EngineFactory, folder: Path, **kwargs: Any) -> LLMEngine:
    return make_engine(folder, max_tokens_per_batch=TOKENS_PER_STEP, num_blocks=128, **kwargs)


def _generate(engine: LLMEngine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def _reference_greedy(model: Any, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


def _float64_logits(hf: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' logits of ``prompt`` computed in float64 (its grouped-GEMM experts run
    in float32 only, so the experts of the copy run eagerly)."""
    model = copy.deepcopy(hf).double()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([prompt])).logits[0]
    return logits.float()


def _assert_greedy_equal(
    got: list[int], expected: list[int], expected_logits: list[torch.Tensor]
) -> None:
    assert len(got) == len(expected) == NEW_TOKENS
    for t, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        if ours != theirs:
            top = expected_logits[t].topk(2)
            gap = float(top.values[0] - top.values[1])
            assert ours == int(top.indices[1]) and gap <= NEAR_TIE, (
                f"diverged at token {t} without a near-tie (gap {gap}): {got} != {expected}"
            )
            return  # past a legitimate near-tie the two continuations differ


def _assert_like_transformers(tokens: list[list[int]], hf: Any) -> None:
    for prompt, ours in zip(PROMPTS, tokens, strict=True):
        _assert_greedy_equal(ours, *_reference_greedy(hf, prompt))


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_logits_and_chunked_batched_greedy_match_transformers(
    case: str, reference: Callable[[str], tuple[Path, Any]], make_engine: EngineFactory
) -> None:
    folder, hf = reference(case)
    engine = _engine(make_engine, folder)
    prompt = PROMPTS[2]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    got = prompt_logits(engine, prompt)
    assert got.shape == expected.shape
    # Against float64: random tiny hybrids amplify float32 rounding (the chunked delta rule)
    # on some CPUs to ~1e-4 in transformers itself; ours may be off by no more than twice
    # that, and never by more than LOGITS_TOLERANCE where float32 is well conditioned.
    exact = _float64_logits(hf, prompt)
    theirs = (expected - exact).abs().max().item()
    ours = (got - exact).abs().max().item()
    assert ours <= max(LOGITS_TOLERANCE, 2 * theirs), (ours, theirs)

    _assert_like_transformers(_generate(engine), hf)
    stats = engine.stats
    assert_all_returned(engine)
    assert (stats.num_state_slots > 0) == CASES[case][0].startswith("Qwen3_5")


def test_composite_checkpoints_skip_the_vision_tower_with_one_log_line(
    reference: Callable[[str], tuple[Path, Any]],
    make_engine: EngineFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder, hf = reference("qwen3_5-conditional-generation")
    caplog.set_level("INFO", logger="tandem.core.models.weight_mapping")
    make_engine(folder)
    vision = sum(1 for name, _ in hf.named_parameters() if name.startswith("model.visual."))
    lines = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(lines) == 1 and f"skipped {vision} " in lines[0]


@pytest.mark.parametrize(
    "case", ["qwen3_5-full-first-bias-mqa", "qwen3_5_moe", "qwen3_moe-sparse-step-2"]
)
def test_two_tensor_parallel_ranks_generate_what_transformers_does(
    case: str, reference: Callable[[str], tuple[Path, Any]], make_engine: EngineFactory
) -> None:
    """One KV head over two ranks (replicated), linear-attention heads and conv channels,
    experts' intermediate split; the single-process executor's worker threads."""
    folder, hf = reference(case)
    parallel = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    _assert_like_transformers(_generate(_engine(make_engine, folder, parallel=parallel)), hf)
