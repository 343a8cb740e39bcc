"""Random checkpoints written by transformers itself, for checks of our models against the
reference implementation (logits, greedy tokens, topology equivalence).

A test helper, not part of the product: it sits on the test path (pytest's ``pythonpath``)
beside the end-to-end harness, for the core, integration and hardware suites alike."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from tandem.core.demo.demo_model import tiny_spec, write_demo_model


def write_reference_model(
    folder: Path,
    architecture: str,
    max_shard_size: str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> Any:
    """Save a random ``architecture`` model (HF layout, safetensors) with the tiny demo
    tokenizer into ``folder``; returns the transformers model. Weights have std 0.2, so greedy
    choices are decided by real margins, not by float rounding."""
    import transformers

    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, architecture)
    settings: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    tokenizer_dir = folder / ".tokenizer"
    write_demo_model(tokenizer_dir, tiny_spec())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    shutil.rmtree(tokenizer_dir)
    return model
