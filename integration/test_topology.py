"""Greedy token ids are byte-identical across topologies: TP=1; TP=2 in one process; TP=2 as
one process per device; TP=4 as 2 nodes x 2 devices, one process per node, on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port

from tandem.core.reference_models import write_reference_model

STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260k"

# Prompts of different lengths, given as token ids so every model reads the same ones.
PROMPTS = ["1,45,300,21", "7", "3,9,27,81,243,11,33,99,297,2,6,18,54,162,86,258,4,12,36,108"]
NEW_TOKENS = 64


def _generate(model: Path, topology: str) -> list[list[int]]:
    base = [sys.executable, "-m", "tandem.server.cli.main", "generate", "--log-level", "WARNING",
            "--model", str(model), "--num-blocks", "256", "--max-tokens", str(NEW_TOKENS),
            "--ignore-eos", "--json"]  # fmt: skip
    for prompt in PROMPTS:
        base += ["--prompt-token-ids", prompt]
    env = {**os.environ}
    addr = f"127.0.0.1:{free_port()}"
    nodes: list[list[str]]
    if topology == "tp1":
        nodes = [[]]
    elif topology == "tp2-single-process":
        env["TANDEM_ENABLE_SINGLE_PROCESS"] = "1"
        nodes = [["--devices", "cpu:0,cpu:1"]]
    elif topology == "tp2-multi-process":
        nodes = [["--devices", "cpu:0,cpu:1", "--master-node-addr", addr]]
    else:
        env["TANDEM_ENABLE_SINGLE_PROCESS"] = "1"
        shared = ["--devices", "cpu:0,cpu:1", "--nnodes", "2", "--master-node-addr", addr]
        nodes = [[*shared, "--node-rank", "0"], [*shared, "--node-rank", "1"]]
    procs = [
        subprocess.Popen(base + extra, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for extra in nodes
    ]  # fmt: skip
    outputs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    records = [json.loads(line) for line in outputs[0][0].splitlines()]
    assert len(records) == len(PROMPTS)
    assert all(len(r["token_ids"]) == NEW_TOKENS for r in records)
    return [r["token_ids"] for r in records]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    # One KV head for up to 4 ranks: replicated, not split.
    write_reference_model(root / "llama", "LlamaForCausalLM", num_key_value_heads=1)
    # q/k norm, head_dim apart from hidden/heads, 2 KV heads: split at TP=2, replicated at 4.
    write_reference_model(root / "qwen3", "Qwen3ForCausalLM", head_dim=32)
    found = {"llama": root / "llama", "qwen3": root / "qwen3"}
    if (STORIES / "model.safetensors").is_file():
        found["stories260k"] = STORIES
    return found


TOPOLOGIES = ["tp2-single-process", "tp2-multi-process", "tp4-2nodes-single-process"]


@pytest.mark.parametrize("model", ["llama", "qwen3", "stories260k"])
def test_greedy_tokens_identical_across_topologies(models: dict[str, Path], model: str) -> None:
    if model not in models:
        pytest.skip(f"{STORIES} is not present")
    reference = _generate(models[model], "tp1")
    for topology in TOPOLOGIES:
        assert _generate(models[model], topology) == reference, topology


def test_torchrun_environment_names_the_nodes(models: dict[str, Path]) -> None:
    """torchrun starting one process per "node" (2 x 2 devices) gives the same tokens."""
    model = models["qwen3"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "tandem.server.cli.main", "generate", "--log-level", "WARNING",
               "--model", str(model), "--num-blocks", "256", "--max-tokens", str(NEW_TOKENS),
               "--ignore-eos", "--json", "--devices", "cpu:0,cpu:1"]  # fmt: skip
    for prompt in PROMPTS:
        command += ["--prompt-token-ids", prompt]
    env = {**os.environ, "TANDEM_ENABLE_SINGLE_PROCESS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line[line.index("{") :] for line in done.stdout.splitlines() if "{" in line]
    tokens = [json.loads(line)["token_ids"] for line in lines]
    assert tokens == _generate(model, "tp1")
