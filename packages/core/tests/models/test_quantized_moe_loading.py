"""Quantized Qwen3-MoE folders served end to end: written by ``tandem quantize`` (``write_w8a8``,
``write_w4a16``) from a random transformers Qwen3-MoE with a dense MLP layer between two MoE
layers, or rewritten here (static activation scales; AutoAWQ's layout).

The references are independent of the quantized paths, as for the dense models
(``test_quantized_loading.py``, ``test_w4a16_loading.py``): the folder's weights dequantized
into a float folder served by the float model, whose linear layers and experts (W8A8)
fake-quantize their inputs the same way in float64. A scale on the wrong expert or row, or an
expert's shard off by a word, cannot hide behind the quantization error: greedy tokens must be
equal. Then the topologies: two tensor-parallel ranks give one rank's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem.core import SamplingParams
from tandem.core.config import ParallelConfig
from tandem.core.errors import ModelLoadError, TandemError
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.kernels import handles
from tandem.core.kernels.cpu.int8_gemm import native_int8
from tandem.core.kernels.reference import quantized_moe as qmoe_ref
from tandem.core.layers.fused_moe import FusedMoeExperts
from tandem.core.layers.quantized_linear import QuantizableLinear
from tandem.core.llm.engine import LLMEngine
from tandem.core.models import loader
from tandem.core.models.w4a16_writer import write_w4a16
from tandem.core.models.w8a8_writer import write_w8a8
from tandem.device.cpu import collapse_to_huge_pages

from ..conftest import HfFactory
from ..layers.test_quantized_moe import fake_quantize
from .checkpoint_files import read_tensors
from .gptq_reference import dequantized_folder
from .test_quantized_loading import STATIC_SCALE, _dequantized, _fake_quantized_matmul, _static
from .test_w4a16_loading import _awq

PROMPTS = [[5, 17, 300, 42, 9, 100, 7], [3, 9, 27, 81, 243, 11, 33, 99, 297, 2, 6, 18, 54]]
NEW_TOKENS = 24
EXPERTS, INTER = 8, 64
# Three layers, the middle one a dense MLP: 3 x (q, k, v, o), 2 x 8 experts x (gate, up,
# down), and the dense gate, up and down.
QUANTIZED = 3 * 4 + 2 * EXPERTS * 3 + 3
TWO_RANKS = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
MOE = {
    "head_dim": 16,
    "moe_intermediate_size": INTER,
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
}


@pytest.fixture(scope="module")
def float_folder(hf_model: HfFactory) -> Path:
    folder, _ = hf_model("Qwen3MoeForCausalLM", **MOE)
    return folder


@pytest.fixture(scope="module")
def w8a8(float_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("moe-w8a8") / "model"
    assert write_w8a8(float_folder, dst) == QUANTIZED
    return dst


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in engine.generate(PROMPTS, params)]


def _fake_quantized_experts(static: float | None) -> Callable[..., torch.Tensor]:
    """Float experts (one rank, plain weights) whose projections' inputs are fake-quantized
    per row or with ``static``, multiplied in float64."""

    def forward(
        self: FusedMoeExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float64)
        for e in sorted(set(topk_ids.reshape(-1).tolist())):
            token, choice = (topk_ids == e).nonzero(as_tuple=True)
            rows = fake_quantize(x[token].double(), static)
            gate, up = (rows @ self.w13[e].double().t()).chunk(2, -1)
            hidden = fake_quantize(F.silu(gate) * up, static)
            y = hidden @ self.w2[e].double().t()
            out.index_add_(0, token, topk_weights[token, choice].double().unsqueeze(1) * y)
        return out.to(x.dtype)

    return forward


@contextmanager
def _float_reference(monkeypatch: pytest.MonkeyPatch, static: float | None) -> Iterator[None]:
    """Float models built inside keep plain weights; W8A8 (``static`` not False) fake-quantizes
    the inputs of their linear layers and experts."""
    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_linear_weights", lambda *args: 0)
        patch.setattr(loader, "pack_expert_weights", lambda *args: 0)
        if static is not False:
            patch.setattr(QuantizableLinear, "matmul", _fake_quantized_matmul(static))
            patch.setattr(FusedMoeExperts, "forward", _fake_quantized_experts(static))
        yield


@pytest.mark.parametrize("static", [None, STATIC_SCALE], ids=["dynamic", "static"])
def test_w8a8_tokens_equal_the_dequantized_float_reference(
    static: float | None,
    w8a8: Path,
    tmp_path: Path,
    make_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = w8a8 if static is None else _static(w8a8, tmp_path / "static")
    got = _generate(make_engine(folder))
    with _float_reference(monkeypatch, static):
        expected = _generate(make_engine(_dequantized(folder, tmp_path / "float")))
    assert got == expected


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_w8a8_two_tensor_parallel_ranks_generate_what_one_does(
    static: bool, w8a8: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """The experts' down projections reduce exact int32 sums: the same logits bit for bit."""
    folder = _static(w8a8, tmp_path / "static") if static else w8a8
    assert _generate(make_engine(folder, parallel=TWO_RANKS)) == _generate(make_engine(folder))


def test_the_cpu_int8_kernels_generate_what_the_reference_does(
    w8a8: Path, make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts packed at load and run by the native kernels against the torch reference
    over the plain weights: the same logits bit for bit, so the same tokens."""
    from tandem.core.kernels.reference import int8_linear as int8_ref
    from tandem.core.layers.int8_packing import pack_int8_weights

    if native_int8() is None:
        pytest.skip("no CPU int8 kernel here (no compiler, or TANDEM_INT8=torch)")
    from tandem.core.layers import int8_packing

    packed: list[int] = []
    handed: list[tuple[int, int]] = []

    def pack(model: torch.nn.Module, device: torch.device) -> int:
        packed.append(pack_int8_weights(model, device))
        return packed[-1]

    def collapse(ranges: Iterable[tuple[int, int]]) -> int:
        handed.extend(ranges)
        return collapse_to_huge_pages(handed)

    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_int8_weights", pack)
        patch.setattr(int8_packing, "collapse_to_huge_pages", collapse)
        got = _generate(make_engine(w8a8))
    # qkv, o of three layers, gate_up and down of the dense one, w13 and w2 of both MoE ones;
    # each one's codes and compensations moved onto 2 MiB pages (the logits below unchanged).
    assert packed == [3 * 2 + 2 + 2 * 2]
    assert len(handed) == 2 * packed[0] and all(end > start for start, end in handed)

    def reference(self: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_ref.int8_linear(x, self.weight, self.weight_scale, None, bias)

    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_int8_weights", lambda *a: 0)
        patch.setattr(QuantizableLinear, "matmul", reference)
        patch.setattr(handles, "moe_int8_linear", lambda: qmoe_ref.moe_int8_linear)
        assert _generate(make_engine(w8a8)) == got


def test_int8_weights_packed_at_load_still_count_in_the_models_size(
    w8a8: Path, make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV cache is sized from what is left beside the weights: int8 weights packed for
    the CPU kernel (whose parameters are then emptied) count as much as plain ones, or more
    (padding, and an int32 per output channel)."""
    from ..conftest import model_runner

    def weight_bytes(engine: LLMEngine) -> int:
        executor = engine.executor
        assert isinstance(executor, ThreadExecutor)
        return executor.call(0, lambda worker: model_runner(worker).weight_bytes())

    if native_int8() is None:
        pytest.skip("no CPU int8 kernel here (no compiler, or TANDEM_INT8=torch)")
    packed = weight_bytes(make_engine(w8a8))
    with monkeypatch.context() as patch:
        patch.setattr(loader, "pack_int8_weights", lambda *a: 0)
        plain = weight_bytes(make_engine(w8a8))
    assert plain <= packed <= 2 * plain


def test_the_w8a8_folder_is_what_llm_compressor_writes_for_moe(
    float_folder: Path, w8a8: Path
) -> None:
    qc = json.loads((w8a8 / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    tensors = read_tensors(w8a8)
    base = "model.layers.2.mlp.experts.5"
    for part, shape in (
        ("gate_proj", (INTER, 64)),
        ("up_proj", (INTER, 64)),
        ("down_proj", (64, INTER)),
    ):
        q, scale = tensors[f"{base}.{part}.weight"], tensors[f"{base}.{part}.weight_scale"]
        assert q.dtype is torch.int8 and q.shape == shape and scale.shape == (shape[0], 1)
    # The routers and the norms stay float, as they are.
    router = "model.layers.2.mlp.gate.weight"
    assert torch.equal(tensors[router], read_tensors(float_folder)[router])
    assert "model.layers.2.mlp.gate.weight_scale" not in tensors
    assert tensors["model.layers.1.mlp.down_proj.weight"].dtype is torch.int8


def test_stacked_float_experts_are_written_one_by_one(
    hf_model: HfFactory, w8a8: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """A float folder with each layer's experts in one tensor (as transformers 5 may save
    them) quantizes to the per-expert names, and serves what the per-expert folder does."""
    stacked, _ = hf_model("Qwen3MoeForCausalLM", fused_experts=True, **MOE)
    assert "model.layers.0.mlp.experts.gate_up_proj" in read_tensors(stacked)
    dst = tmp_path / "w8a8"
    assert write_w8a8(stacked, dst) == QUANTIZED
    assert read_tensors(dst).keys() == read_tensors(w8a8).keys()
    assert _generate(make_engine(dst)) == _generate(make_engine(w8a8))


FOUR_BIT = {
    "gptq group 32 sym": (32, True, False),
    "gptq group 32 asym": (32, False, False),
    "gptq per channel": (-1, True, False),
    "awq group 32": (32, False, True),
}


def _four_bit(float_folder: Path, tmp_path: Path, case: str) -> Path:
    group, sym, awq = FOUR_BIT[case]
    written = tmp_path / "gptq"
    assert write_w4a16(float_folder, written, group_size=group, sym=sym) == QUANTIZED
    return _awq(written, tmp_path / "awq", group) if awq else written


@pytest.mark.parametrize("case", sorted(FOUR_BIT))
def test_4bit_tokens_equal_the_dequantized_float_reference(
    case: str,
    float_folder: Path,
    tmp_path: Path,
    make_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = _four_bit(float_folder, tmp_path, case)
    got = _generate(make_engine(folder))
    with _float_reference(monkeypatch, static=False):
        expected = _generate(make_engine(dequantized_folder(folder, tmp_path / "float")))
    assert got == expected
    assert got != _generate(make_engine(float_folder))  # the quantization is there to see


@pytest.mark.parametrize("case", ["gptq group 32 asym", "awq group 32"])
def test_4bit_two_tensor_parallel_ranks_generate_what_one_does(
    case: str, float_folder: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    folder = _four_bit(float_folder, tmp_path, case)
    assert _generate(make_engine(folder, parallel=TWO_RANKS)) == _generate(make_engine(folder))


def test_the_gptq_folder_lists_nothing_when_everything_is_4bit(
    float_folder: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "gptq"
    write_w4a16(float_folder, folder, group_size=32)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert "modules_in_block_to_quantize" not in qc
    tensors = read_tensors(folder)
    base = "model.layers.0.mlp.experts.7.down_proj"
    assert tensors[f"{base}.qweight"].shape == (INTER // 8, 64)
    assert tensors[f"{base}.scales"].shape == (INTER // 32, 64)
    assert tensors["model.layers.0.mlp.gate.weight"].dtype is torch.float32


def test_experts_the_format_cannot_hold_stay_float_and_serve(
    hf_model: HfFactory, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """Experts of 100 channels (not a multiple of 8) stay float; the config lists the 4-bit
    projections, which the loader reads back: float experts beside 4-bit attention."""
    src, _ = hf_model("Qwen3MoeForCausalLM", head_dim=16, moe_intermediate_size=100)
    folder = tmp_path / "gptq"
    assert write_w4a16(src, folder, group_size=32) == 2 * 4
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["modules_in_block_to_quantize"] == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    ]
    engine = make_engine(folder)
    assert all(len(tokens) == NEW_TOKENS for tokens in _generate(engine))


def test_a_group_straddling_two_ranks_is_refused(
    float_folder: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """Groups of 64 over the experts' 64 down inputs: two ranks would hold 32 each (the
    attention, which the same groups would cut, kept float)."""
    folder = tmp_path / "gptq"
    write_w4a16(float_folder, folder, group_size=64, keep_float=frozenset({"self_attn"}))
    with pytest.raises(TandemError) as caught:
        make_engine(folder, parallel=TWO_RANKS)
    message = str(caught.value)
    assert "model.layers.0.mlp.experts: its 64 inputs over 2 tensor-parallel ranks" in message
    assert "group of 64 inputs" in message and "keep whole groups: 1" in message


def test_a_quantized_router_is_refused_at_start_up(w8a8: Path, tmp_path: Path) -> None:
    """A config that does not ignore the routers describes int8 routers, which vLLM and we
    serve float: refused from the config, before any weight is read."""
    from tandem.core.models.config_json import load_model_config

    config = json.loads((w8a8 / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"router model\.layers\.0\.mlp\.gate"):
        load_model_config(tmp_path)
