"""Greedy token ids are byte-identical across topologies: TP=1; TP=2 in one process; TP=2 as
one process per device; TP=4 as 2 nodes x 2 devices, one process per node, on loopback. For
dense models (one of them GPTQ 4-bit), a Qwen3.5 hybrid (state slots, linear-attention heads
and conv channels split; float, int8 W8A8 and GPTQ 4-bit, and an int8 Qwen3.5-MoE) and
Qwen3-MoE models (experts' intermediate split; float, int8 W8A8 and GPTQ 4-bit experts), the
latter with prompts prefilled in chunks of 8 tokens beside decodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import PROMPT_IDS, free_port, generate_token_ids
from reference_models import write_reference_model

from tandem.core.models.w4a16_writer import write_w4a16
from tandem.core.models.w8a8_writer import write_w8a8

STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260k"

# Enough for the topologies to part ways if they can (chunked prefills beside decodes,
# every rank's collectives over tens of steps); each process start costs more than them.
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    # One KV head for up to 4 ranks: replicated, not split.
    write_reference_model(root / "llama", "LlamaForCausalLM", num_key_value_heads=1)
    # q/k norm, head_dim apart from hidden/heads, 2 KV heads: split at TP=2, replicated at 4.
    write_reference_model(root / "qwen3", "Qwen3ForCausalLM", head_dim=32)
    # Linear-attention heads split over up to 4 ranks, 2 KV heads replicated at 4.
    write_reference_model(
        root / "qwen3_5", "Qwen3_5ForCausalLM", linear_num_key_heads=4, linear_num_value_heads=8
    )
    # Top-2 of 8 experts, the experts' intermediate split 4 ways.
    write_reference_model(root / "qwen3_moe", "Qwen3MoeForCausalLM", head_dim=16)
    # The qwen3 model's GPTQ 4-bit copy (zero points, groups of 32): packed words and groups
    # split at every rank count here.
    write_w4a16(root / "qwen3", root / "qwen3_w4a16", group_size=32, sym=False)
    # Quantized experts of 128 channels (and o_proj inputs, head_dim 32): 32 per rank at TP=4,
    # a whole group of 32 (4-bit); the int8 experts' down projections reduce exact int32 sums
    # over every rank count.
    moe_float = root / "qwen3_moe_128"
    write_reference_model(moe_float, "Qwen3MoeForCausalLM", head_dim=32, moe_intermediate_size=128)
    write_w8a8(moe_float, root / "qwen3_moe_w8a8")
    write_w4a16(moe_float, root / "qwen3_moe_w4a16", group_size=32, sym=False)
    # The hybrid's int8 copy: q/k/v/z sections and their scales split; out_proj, o_proj and
    # the MLP reduce exact int32 sums.
    write_w8a8(root / "qwen3_5", root / "qwen3_5_w8a8")
    # Its GPTQ 4-bit copy, groups of 32: out_proj's 128 inputs are 32 per rank at TP=4, each
    # q/k/v/z section a whole number of packed words per rank. b and a (8 rows, 2 per rank at
    # TP=4) cannot be cut into words of 8: kept float, as vLLM replicates them for GPTQ.
    write_w4a16(
        root / "qwen3_5", root / "qwen3_5_w4a16", group_size=32, sym=False,
        keep_float=frozenset({"in_proj_b"}),
    )  # fmt: skip
    # Qwen3.5-MoE int8: the shared expert's down projection reduces its own int32 sums.
    write_reference_model(
        root / "qwen3_5_moe", "Qwen3_5MoeForCausalLM", linear_num_key_heads=4,
        linear_num_value_heads=8, shared_expert_intermediate_size=64,
    )  # fmt: skip
    write_w8a8(root / "qwen3_5_moe", root / "qwen3_5_moe_w8a8")
    names = (
        "llama", "qwen3", "qwen3_w4a16", "qwen3_5", "qwen3_moe", "qwen3_moe_w8a8",
        "qwen3_moe_w4a16", "qwen3_5_w8a8", "qwen3_5_w4a16", "qwen3_5_moe_w8a8",
    )  # fmt: skip
    found = {name: root / name for name in names}
    if (STORIES / "model.safetensors").is_file():
        found["stories260k"] = STORIES
    return found


TOPOLOGIES = ["tp2-single-process", "tp2-multi-process", "tp4-2nodes-single-process"]


# Small steps for the family models: every prompt spans chunks, mixed with others' decodes.
CHUNKED = ("--max-tokens-per-batch", "8")


@pytest.mark.parametrize(
    "model",
    [
        "llama", "qwen3", "qwen3_w4a16", "stories260k", "qwen3_5", "qwen3_moe",
        "qwen3_moe_w8a8", "qwen3_moe_w4a16", "qwen3_5_w8a8", "qwen3_5_w4a16",
        "qwen3_5_moe_w8a8",
    ],
)  # fmt: skip
def test_greedy_tokens_identical_across_topologies(models: dict[str, Path], model: str) -> None:
    if model not in models:
        pytest.skip(f"{STORIES} is not present")
    extra = CHUNKED if model.startswith(("qwen3_5", "qwen3_moe")) else ()
    reference = generate_token_ids(models[model], "tp1", NEW_TOKENS, extra).token_ids
    for topology in TOPOLOGIES:
        tokens = generate_token_ids(models[model], topology, NEW_TOKENS, extra).token_ids
        assert tokens == reference, topology


def test_torchrun_environment_names_the_nodes(models: dict[str, Path]) -> None:
    """torchrun starting one process per "node" (2 x 2 devices) gives the same tokens."""
    model = models["qwen3"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "tandem.server.cli.main", "generate", "--log-level", "WARNING",
               "--model", str(model), "--num-blocks", "256", "--max-tokens", str(NEW_TOKENS),
               "--ignore-eos", "--json", "--devices", "cpu:0,cpu:1"]  # fmt: skip
    for prompt in PROMPT_IDS:
        command += ["--prompt-token-ids", prompt]
    env = {**os.environ, "TANDEM_ENABLE_SINGLE_PROCESS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line[line.index("{") :] for line in done.stdout.splitlines() if "{" in line]
    tokens = [json.loads(line)["token_ids"] for line in lines]
    assert tokens == generate_token_ids(model, "tp1", NEW_TOKENS).token_ids


def _ids(tokens: list[int]) -> str:
    return ",".join(str(t) for t in tokens)


def test_hybrid_prefix_cache_hits_are_identical_across_topologies(
    models: dict[str, Path],
) -> None:
    """One request at a time, so each finds the snapshots of those before it: the second
    shares 80 tokens with the first (its prefill is cut there for a snapshot), the third the
    same 80 (it starts from that snapshot), the fourth continues the first's whole prompt (it
    starts from the snapshot at that prompt's end, 85 tokens, inside a block). Every topology
    gives the tokens of TP=1 without prefix caching."""
    shared = [(7 * i + 3) % 500 + 5 for i in range(80)]
    first = [*shared, 11, 12, 13, 14, 15]
    prompts = [first, [*shared, 21, 22, 23], [*shared, 31, 32, 33, 34], [*first, 41, 42]]
    ids = [_ids(p) for p in prompts]
    one_at_a_time = ("--max-seqs-per-batch", "1", *CHUNKED)
    model = models["qwen3_5"]
    reference = generate_token_ids(
        model, "tp1", NEW_TOKENS, (*one_at_a_time, "--no-enable-prefix-caching"), prompts=ids
    )
    assert reference.num_cached_tokens == [0, 0, 0, 0]
    for topology in ["tp1", *TOPOLOGIES]:
        cached = generate_token_ids(model, topology, NEW_TOKENS, one_at_a_time, prompts=ids)
        assert cached.num_cached_tokens == [0, 0, 80, 85], topology
        assert cached.token_ids == reference.token_ids, topology
