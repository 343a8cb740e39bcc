"""Config parsing and dtype choice."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.core import LLMEngine, SamplingParams
from tandem.core.models.config_json import parse_model_config
from tandem.core.models.loader import FAST_BF16_FLAGS, resolve_dtype
from tandem.device.cpu import cpu_flags

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_rope_theta_top_level_or_in_rope_parameters() -> None:
    top = parse_model_config({**BASE, "rope_theta": 5e5})
    nested = parse_model_config(
        {**BASE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    )
    assert top.rope_theta == nested.rope_theta == 5e5
    assert top.rope_scaling is None and nested.rope_scaling is None
    llama3 = parse_model_config(
        {
            **BASE,
            "rope_parameters": {
                "rope_theta": 5e5,
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert llama3.rope_scaling is not None and llama3.rope_scaling["rope_type"] == "llama3"


def test_family_switches() -> None:
    assert parse_model_config(BASE).num_kv_heads == 4
    assert parse_model_config(BASE).head_dim == 16
    qwen2 = parse_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = parse_model_config({**BASE, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.qk_norm and not qwen3.qkv_bias
    llama = parse_model_config({**BASE, "attention_bias": True})
    assert llama.qkv_bias and llama.o_bias


def test_dtype_resolution(caplog: pytest.LogCaptureFixture) -> None:
    plain = frozenset({"avx2", "fma"})
    with caplog.at_level(logging.INFO):
        assert resolve_dtype("auto", "bfloat16", "cpu", plain) is torch.float32
    assert "float32 on CPU" in caplog.text and "neither AMX nor AVX512-BF16" in caplog.text
    caplog.clear()
    for flag in ("amx_bf16", "avx512_bf16"):
        with caplog.at_level(logging.INFO):
            assert resolve_dtype("auto", "bfloat16", "cpu", plain | {flag}) is torch.bfloat16
        assert f"the CPU reports {flag}" in caplog.text
    # Fast bfloat16 says nothing of float16, nor does it turn float32 checkpoints into bf16.
    assert resolve_dtype("auto", "float16", "cpu", frozenset({"amx_bf16"})) is torch.float32
    assert resolve_dtype("auto", "float32", "cpu", frozenset({"amx_bf16"})) is torch.float32
    assert resolve_dtype("float32", "bfloat16", "cpu", frozenset({"amx_bf16"})) is torch.float32
    assert resolve_dtype("bfloat16", "bfloat16", "cpu") is torch.bfloat16
    assert resolve_dtype("auto", "bfloat16", "npu") is torch.bfloat16
    assert resolve_dtype("auto", "float16", "cuda") is torch.float16
    assert resolve_dtype("float16", "float32", "cpu") is torch.float16


def test_bf16_checkpoint_runs_in_the_dtype_this_cpu_is_fast_at(
    demo_dir: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(demo_dir, folder)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    auto = make_engine(folder)
    fast = any(flag in cpu_flags() for flag in FAST_BF16_FLAGS)
    expected = torch.bfloat16 if fast else torch.float32
    assert auto.executor.workers[0].runner.dtype is expected  # type: ignore[attr-defined]
    explicit = make_engine(folder, dtype="bfloat16")
    assert explicit.executor.workers[0].runner.dtype is torch.bfloat16  # type: ignore[attr-defined]
    params = SamplingParams.greedy(max_tokens=4)
    assert len(explicit.generate(["hello"], params)[0].token_ids) == 4
