"""Quantized Qwen3.5 and Qwen3.5-MoE folders served end to end, written by ``tandem quantize``
(``write_w8a8``, ``write_w4a16``) from random transformers models, with the Gated DeltaNet
projections quantized or kept float (``keep_float``, the ignore list llm-compressor's Qwen3.5
recipes write: ``re:.*linear_attn.*``).

References as for the other quantized models (``test_quantized_moe_loading.py``): the folder
dequantized into a float folder served by the float model, whose linear layers and experts
fake-quantize their inputs in float64 (W8A8) where the checkpoint quantized them. Greedy
tokens must be equal: a scale cut with the wrong q/k/v/z section, or a shared expert reduced
twice, cannot hide behind the quantization error. Then the refusals: a tensor-parallel size
that would split a 4-bit group, and a quantized multi-token-prediction head.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.core import SamplingParams
from tandem.core.config import ParallelConfig, SpeculativeConfig
from tandem.core.errors import TandemError
from tandem.core.layers.fused_moe import FusedMoeExperts
from tandem.core.layers.gated_delta_net import GatedDeltaNet
from tandem.core.layers.quantized_linear import QuantizableLinear
from tandem.core.llm.engine import LLMEngine
from tandem.core.models import loader
from tandem.core.models.calibration import collect_hessians
from tandem.core.models.mtp_writer import initial_head, write_mtp_head
from tandem.core.models.w4a16_writer import write_w4a16
from tandem.core.models.w8a8_writer import quantize_weight, write_w8a8

from ..conftest import HfFactory
from .gptq_reference import dequantized_folder
from .test_quantized_loading import _dequantized, _fake_quantized_matmul
from .test_quantized_moe_loading import _fake_quantized_experts

PROMPTS = [[5, 17, 300, 42, 9, 100, 7], [3, 9, 27, 81, 243, 11, 33, 99, 297, 2, 6, 18, 54]]
NEW_TOKENS = 16
TWO_RANKS = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=1)
ARCHITECTURES = {"dense": "Qwen3_5ForCausalLM", "moe": "Qwen3_5MoeForCausalLM"}
LINEAR_ATTENTION = frozenset({"linear_attn"})


@pytest.fixture(scope="module")
def float_folders(hf_model: HfFactory) -> dict[str, Path]:
    return {kind: hf_model(arch)[0] for kind, arch in ARCHITECTURES.items()}


def _write(float_folder: Path, dst: Path, scheme: str, gdn_float: bool) -> Path:
    keep = LINEAR_ATTENTION if gdn_float else frozenset()
    if scheme == "w8a8":
        write_w8a8(float_folder, dst, keep_float=keep)
    else:
        write_w4a16(float_folder, dst, group_size=32, sym=False, keep_float=keep)
    return dst


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in engine.generate(PROMPTS, params)]


@contextmanager
def _w8a8_float_reference(monkeypatch: pytest.MonkeyPatch, gdn_float: bool) -> Iterator[None]:
    """Float models built inside keep plain weights and fake-quantize the inputs of their
    linear layers and experts per row, but the Gated DeltaNet's where the checkpoint keeps
    them float."""
    fake = _fake_quantized_matmul(None)
    plain = QuantizableLinear.matmul
    build = GatedDeltaNet.__init__

    def matmul(self: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = (plain if getattr(self, "kept_float", False) else fake)(self, x, bias)
        return out

    def init(self: GatedDeltaNet, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        for layer in (self.in_proj_qkvz, self.in_proj_ba, self.out_proj):
            if layer is not None:  # in_proj_ba: None where in_proj_qkvz computes b and a
                layer.__dict__["kept_float"] = gdn_float

    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_linear_weights", lambda *args: 0)
        patch.setattr(loader, "pack_expert_weights", lambda *args: 0)
        patch.setattr(QuantizableLinear, "matmul", matmul)
        patch.setattr(FusedMoeExperts, "forward", _fake_quantized_experts(None))
        patch.setattr(GatedDeltaNet, "__init__", init)
        yield


@pytest.mark.parametrize("gdn_float", [False, True], ids=["gdn-quantized", "gdn-float"])
@pytest.mark.parametrize("scheme", ["w8a8", "w4a16"])
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_tokens_equal_the_dequantized_float_reference(
    kind: str,
    scheme: str,
    gdn_float: bool,
    float_folders: dict[str, Path],
    tmp_path: Path,
    make_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = _write(float_folders[kind], tmp_path / "quantized", scheme, gdn_float)
    got = _generate(make_engine(folder))
    if scheme == "w4a16":
        expected = _generate(make_engine(dequantized_folder(folder, tmp_path / "float")))
    else:
        with _w8a8_float_reference(monkeypatch, gdn_float):
            expected = _generate(make_engine(_dequantized(folder, tmp_path / "float")))
    assert got == expected


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_w8a8_two_tensor_parallel_ranks_generate_what_one_does(
    kind: str, float_folders: dict[str, Path], tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """Sections of q/k/v/z cut with their scales; the int8 row-parallel layers (out_proj,
    o_proj, the shared expert's down projection) reduce exact int32 sums: one rank's logits
    bit for bit."""
    folder = _write(float_folders[kind], tmp_path / "w8a8", "w8a8", gdn_float=False)
    assert _generate(make_engine(folder, parallel=TWO_RANKS)) == _generate(make_engine(folder))


def test_a_shard_that_splits_a_4bit_group_is_refused_naming_the_layer(
    float_folders: dict[str, Path], tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """out_proj's 64 inputs in groups of 64: two ranks would hold half a group each."""
    folder = tmp_path / "w4a16"
    write_w4a16(float_folders["dense"], folder, group_size=64)
    with pytest.raises(TandemError) as caught:
        make_engine(folder, parallel=TWO_RANKS)
    message = str(caught.value)
    assert "model.layers.0.linear_attn.out_proj" in message
    assert "group of 64 inputs" in message and "keep whole groups: 1" in message


def test_activation_order_serves_shards_that_hold_part_of_a_group(
    float_folders: dict[str, Path], tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """The same out_proj in activation order (GPTQ's ``desc_act``): every rank keeps every
    group, so two ranks serve it, and generate what one does."""
    folder = tmp_path / "act_order"
    hessians = collect_hessians(float_folders["dense"], PROMPTS)
    write_w4a16(float_folders["dense"], folder, group_size=64, hessians=hessians, act_order=True)
    assert _generate(make_engine(folder, parallel=TWO_RANKS)) == _generate(make_engine(folder))


def _with_head(folder: Path, float_folder: Path, quantized: bool) -> Path:
    """``folder`` with a multi-token-prediction head made from ``float_folder``'s last
    full-attention layer, its projections int8 (``quantized``) or float."""
    head = initial_head(float_folder, seed=3)
    if quantized:
        for name in [n for n in head if n.endswith("_proj.weight")]:
            q, scale = quantize_weight(head[name])
            head[name] = q
            head[name.removesuffix("weight") + "weight_scale"] = scale
    write_mtp_head(folder, head)
    return folder


def test_a_float_head_drafts_for_a_quantized_model(
    float_folders: dict[str, Path], tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """The head is built float beside int8 layers; drafting keeps greedy tokens."""
    folder = _write(float_folders["dense"], tmp_path / "w8a8", "w8a8", gdn_float=False)
    _with_head(folder, float_folders["dense"], quantized=False)
    plain = _generate(make_engine(folder))
    assert _generate(make_engine(folder, speculative=MTP)) == plain


def test_a_quantized_head_is_refused_at_start_up(
    float_folders: dict[str, Path], tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    folder = tmp_path / "w8a8"
    shutil.copytree(
        _write(float_folders["dense"], tmp_path / "src", "w8a8", gdn_float=False), folder
    )
    _with_head(folder, float_folders["dense"], quantized=True)
    with pytest.raises(TandemError, match="multi-token-prediction head is quantized"):
        make_engine(folder, speculative=MTP)
    make_engine(folder)  # without drafting the head is not read


def test_w8a8_refuses_to_keep_routed_experts_float(
    float_folders: dict[str, Path], tmp_path: Path
) -> None:
    """Its writer quantizes every routed expert: asked to keep them float, it says so instead
    of writing an ignore entry that matches nothing."""
    with pytest.raises(TandemError, match=r"--keep-float: W8A8 writes every routed expert"):
        write_w8a8(float_folders["moe"], tmp_path / "out", keep_float=frozenset({"experts"}))
