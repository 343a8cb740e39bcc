"""``benchmarks/inflate_model.py`` grows a Qwen3.5 hybrid and its multi-token-prediction head
without changing what they compute: transformers' logits of the grown model, and the head's
drafts, are the small one's (the speed target of speculative decoding's MTP figures rests on
this)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference_models import write_reference_model

from tandem.core.models.mtp_training import (
    TrainableHead,
    load_reference_model,
    reference_drafts,
    text_config,
)
from tandem.core.models.mtp_writer import MTP_FILE, initial_head, write_mtp_head

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "inflate_model.py"
TOKENS = [3, 17, 250, 9, 41, 41, 7, 300, 12, 5, 88, 19]


def _head(folder: Path, model: object) -> TrainableHead:
    from safetensors.torch import load_file

    head = TrainableHead(text_config(model))
    tensors = load_file(str(folder / MTP_FILE))
    head.load_head({k: v.float() for k, v in tensors.items()})
    return head


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("inflate")
    small, big = root / "small", root / "big"
    write_reference_model(small, "Qwen3_5ForCausalLM")
    write_mtp_head(small, initial_head(small, seed=2))
    config = json.loads((small / "config.json").read_text())
    args = {
        "--hidden": 2 * config["hidden_size"],
        "--intermediate": 3 * config["intermediate_size"],
        "--layers": 3 * config["num_hidden_layers"],
        "--heads": 2 * config["num_attention_heads"],
        "--kv-heads": 2 * config["num_key_value_heads"],
        "--linear-key-heads": 2 * config["linear_num_key_heads"],
        "--linear-value-heads": 2 * config["linear_num_value_heads"],
    }
    command = [sys.executable, str(SCRIPT), str(small), str(big)]
    for flag, value in args.items():
        command += [flag, str(value)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    return small, big


def test_the_grown_model_computes_the_small_ones_logits(models: tuple[Path, Path]) -> None:
    small, big = (load_reference_model(folder) for folder in models)
    grown = json.loads((models[1] / "config.json").read_text())
    assert (
        grown["num_hidden_layers"]
        == len(grown["layer_types"])
        == 3 * len(json.loads((models[0] / "config.json").read_text())["layer_types"])
    )
    assert sum(p.numel() for p in big.parameters()) > 3 * sum(p.numel() for p in small.parameters())
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        expected, got = small(input_ids=ids).logits, big(input_ids=ids).logits
    # Not bit-exact: each hidden-size norm's epsilon (1e-6) weighs H'/H times more inside its
    # root, and sums run in another order. Measured: 2.7e-4 at most on logits of std 1.6; a
    # grown model without the norms' compensation is 7.9 off.
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_grown_head_drafts_the_small_ones_tokens(models: tuple[Path, Path]) -> None:
    drafts = []
    for folder in models:
        model = load_reference_model(folder)
        drafts.append(reference_drafts(model, _head(folder, model), TOKENS))
    assert drafts[0] == drafts[1]
