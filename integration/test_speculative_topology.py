"""N-gram speculative decoding keeps greedy tokens byte-identical to plain decoding in every
topology: TP=1, TP=2 in one process (also with two steps in flight on pipeline lanes), TP=2
as one process per device; for a dense, an MoE and a hybrid (Qwen3.5) model, the last also
drafting with its multi-token-prediction head (``mtp``), the MoE one with prompts prefilled in
chunks of 8 tokens beside verify steps. Drafts are accepted (the engine's closing log line
says how many), so the comparison has teeth; on the hybrid, drafts are also rejected, so every
rank rolls its linear-attention states back (its random weights rarely repeat: its acceptance
is not asserted, packages/core/tests/llm/test_speculative_decoding.py drives every count)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness import generate_token_ids
from reference_models import write_reference_model

from tandem.core.models.mtp_writer import initial_head, write_mtp_head

NEW_TOKENS = 32
SPEC = ("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 3, "prompt_lookup_min": 1}')  # fmt: skip
# Qwen3.5's own multi-token-prediction head (untrained here: its drafts are mostly rejected),
# three drafts a step: every rank runs the head's later steps on rank 0's accepted counts.
MTP = ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}')
# Each topology, and TP=2 in one process with two steps in flight (pipeline lanes).
TOPOLOGIES: list[tuple[str, tuple[str, ...]]] = [
    ("tp1", ()),
    ("tp2-single-process", ()),
    ("tp2-multi-process", ()),
    ("tp2-single-process", ("--max-concurrency", "2")),
]
ACCEPTED = re.compile(r"speculative decoding: (\d+) drafts, (\d+) draft tokens, (\d+) accepted")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-models")
    write_reference_model(root / "qwen3", "Qwen3ForCausalLM", head_dim=32)
    write_reference_model(root / "qwen3_moe", "Qwen3MoeForCausalLM", head_dim=16)
    write_reference_model(root / "qwen3_5", "Qwen3_5ForCausalLM")
    write_reference_model(root / "qwen3_5_mtp", "Qwen3_5ForCausalLM")
    write_mtp_head(root / "qwen3_5_mtp", initial_head(root / "qwen3_5_mtp", seed=1))
    return {name: root / name for name in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_mtp")}


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_mtp"])
def test_greedy_tokens_identical_with_speculation(models: dict[str, Path], model: str) -> None:
    extra: tuple[str, ...] = ("--max-tokens-per-batch", "8") if model == "qwen3_moe" else ()
    spec = MTP if model == "qwen3_5_mtp" else SPEC
    reference = generate_token_ids(models[model], "tp1", NEW_TOKENS, extra).token_ids
    for topology, lanes in TOPOLOGIES:
        run = generate_token_ids(
            models[model], topology, NEW_TOKENS, (*extra, *spec, *lanes), log_level="INFO"
        )
        assert run.token_ids == reference, (topology, lanes)
        found = ACCEPTED.search(run.logs[0])
        assert found is not None, run.logs[0][-2000:]
        drafted, accepted = int(found.group(2)), int(found.group(3))
        if model.startswith("qwen3_5"):
            assert drafted > accepted, (topology, found.group(0))
        else:
            assert accepted > 0, (topology, found.group(0))
