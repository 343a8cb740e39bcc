"""A W8A8 folder written by ``write_w8a8`` (what ``tandem quantize`` runs) served end to end.

The reference is independent of the int8 path: the folder's weights dequantized (q * scale,
in float64, read straight from the safetensors) into a float folder, served by the float model,
whose linear layers fake-quantize their inputs the same way and multiply in float64. The
quantization error is then the same on both sides, so a kernel or loading bug (a scale on the
wrong row, a shard off by one) cannot hide behind it: greedy tokens must be equal.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem.core import SamplingParams
from tandem.core.config import ParallelConfig
from tandem.core.llm.engine import LLMEngine
from tandem.core.models import loader
from tandem.core.models.w8a8_writer import write_w8a8

from ..conftest import HfFactory
from .checkpoint_files import read_tensors, rewrite_folder

PROMPTS = [[5, 17, 300, 42, 9, 100, 7], [3, 9, 27, 81, 243, 11, 33, 99, 297, 2, 6, 18, 54]]
NEW_TOKENS = 24
# A static activation scale for every layer: inputs beyond +-127 * 0.03 saturate, so the
# clamp is exercised too.
STATIC_SCALE = 0.03


@pytest.fixture(scope="module")
def quantized(hf_model: HfFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two KV heads under four query heads, head_dim 32 != hidden / heads: q/k/v of unequal
    # sizes in the fused projection.
    folder, _ = hf_model("Qwen3ForCausalLM", head_dim=32)
    dst = tmp_path_factory.mktemp("w8a8") / "model"
    assert write_w8a8(folder, dst) == 2 * 7
    return dst


def _dequantized(src: Path, dst: Path) -> Path:
    tensors = read_tensors(src)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_scale"):
            continue
        if t.dtype is torch.int8:
            scale = tensors[name.removesuffix("weight") + "weight_scale"]
            t = (t.double() * scale.double()).float()
        out[name] = t
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    return rewrite_folder(src, dst, out, config)


def _static(src: Path, dst: Path) -> Path:
    tensors = read_tensors(src)
    for name in [n for n, t in tensors.items() if t.dtype is torch.int8]:
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor([STATIC_SCALE])
    config = json.loads((src / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"].update(dynamic=False, strategy="tensor", observer="minmax")
    return rewrite_folder(src, dst, tensors, config)


def _fake_quantized_matmul(static: float | None) -> Callable[..., torch.Tensor]:
    def matmul(self: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = x.double()
        if static is None:
            scale = h.abs().amax(-1, keepdim=True) / 127
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        else:
            scale = torch.tensor(static, dtype=torch.float32).double()
        fake = torch.round(h / scale).clamp(-128, 127) * scale
        b = bias.double() if bias is not None else None
        return F.linear(fake, self.weight.double(), b).to(x.dtype)

    return matmul


@contextmanager
def _reference_float_model(monkeypatch: pytest.MonkeyPatch, static: float | None) -> Iterator[None]:
    """Float models built inside keep plain weights and fake-quantize their linear inputs."""
    from tandem.core.layers.quantized_linear import QuantizableLinear

    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_linear_weights", lambda *args: 0)
        patch.setattr(QuantizableLinear, "matmul", _fake_quantized_matmul(static))
        yield


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize("static", [None, STATIC_SCALE], ids=["dynamic", "static"])
def test_greedy_tokens_equal_the_dequantized_float_reference(
    static: float | None,
    quantized: Path,
    tmp_path: Path,
    make_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = quantized if static is None else _static(quantized, tmp_path / "static")
    got = _generate(make_engine(folder))
    reference_folder = _dequantized(folder, tmp_path / "float")
    with _reference_float_model(monkeypatch, static):
        expected = _generate(make_engine(reference_folder))
    assert got == expected


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_two_tensor_parallel_ranks_generate_what_one_does(
    static: bool, quantized: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """Row-parallel ranks share the tokens' scales and sum int32 products: the same logits
    bit for bit, so the same tokens (per-rank scales diverge within 24 tokens here)."""
    folder = _static(quantized, tmp_path / "static") if static else quantized
    one = _generate(make_engine(folder))
    parallel = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    assert _generate(make_engine(folder, parallel=parallel)) == one


def test_the_written_folder_is_what_llm_compressor_writes(quantized: Path) -> None:
    config = json.loads((quantized / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"]["strategy"] == "channel" and group["weights"]["symmetric"]
    assert group["input_activations"]["dynamic"] is True
    assert group["input_activations"]["strategy"] == "token"
    tensors = read_tensors(quantized)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    scale = tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    assert q.dtype is torch.int8 and scale.shape == (q.shape[0], 1)
    assert scale.dtype is torch.float32  # the checkpoint's dtype
    assert tensors["lm_head.weight"].dtype is torch.float32
    assert tensors["model.embed_tokens.weight"].dtype is torch.float32
    assert tensors["model.norm.weight"].dtype is torch.float32
    assert (quantized / "tokenizer.json").is_file()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_cpu_int8_kernel_generates_what_the_reference_does(
    static: bool,
    quantized: Path,
    tmp_path: Path,
    make_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native kernel over weights packed at load against the torch reference over the
    plain weights: the same logits bit for bit, so the same greedy tokens."""
    from tandem.core.kernels.cpu.int8_gemm import native_int8
    from tandem.core.kernels.reference import int8_linear as int8_ref
    from tandem.core.layers.int8_packing import pack_int8_weights
    from tandem.core.layers.quantized_linear import QuantizableLinear

    if native_int8() is None:
        pytest.skip("no CPU int8 kernel here (no compiler, or TANDEM_INT8=torch)")
    folder = _static(quantized, tmp_path / "static") if static else quantized
    packed: list[int] = []

    def pack(model: torch.nn.Module, device: torch.device) -> int:
        packed.append(pack_int8_weights(model, device))
        return packed[-1]

    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_int8_weights", pack)
        got = _generate(make_engine(folder))
    # qkv, o, gate_up and down of both layers: every projection served by the kernel.
    assert packed == [2 * 4]

    def reference(
        self: QuantizableLinear, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert self.weight_scale is not None and self.int8_packed is None
        scale = self.input_scale.max() if self.input_scale is not None else None
        return int8_ref.int8_linear(x, self.weight, self.weight_scale, scale, bias)

    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_int8_weights", lambda *a: 0)
        patch.setattr(QuantizableLinear, "matmul", reference)
        assert _generate(make_engine(folder)) == got
