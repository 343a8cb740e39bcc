"""GPTQ 4-bit folders served end to end: written by ``write_w4a16`` (what ``tandem quantize
--scheme w4a16`` runs), or rewritten here in activation order (``desc_act``, whose ``g_idx``
is a permutation's groups, as GPTQ proper writes it).

The reference is independent of the 4-bit path: the folder's tensors unpacked bit by bit here
and dequantized in float64 into a float folder, served by the float model. The dequantized
weight is exact in float32 on both sides, so a kernel, packing or sharding bug (a nibble out
of order, a group's scale on the wrong inputs, a shard off by a word) cannot hide behind the
quantization error: greedy tokens must be equal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.core import SamplingParams
from tandem.core.config import ParallelConfig
from tandem.core.errors import TandemError
from tandem.core.kernels.reference.int4_packing import AWQ_ORDER, pack_int4, unpack_int4
from tandem.core.llm.engine import LLMEngine
from tandem.core.models import loader
from tandem.core.models.w4a16_writer import gptq_tensors, write_w4a16

from ..conftest import HfFactory
from .checkpoint_files import read_tensors, rewrite_folder
from .gptq_reference import dequantized_folder, nibbles

PROMPTS = [[5, 17, 300, 42, 9, 100, 7], [3, 9, 27, 81, 243, 11, 33, 99, 297, 2, 6, 18, 54]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def float_folder(hf_model: HfFactory) -> Path:
    # Two KV heads under four query heads, head_dim 32 != hidden / heads: q/k/v of unequal
    # sizes in the fused projection; inputs of 64 (hidden) and 128 (attention, MLP).
    folder, _ = hf_model("Qwen3ForCausalLM", head_dim=32)
    return folder


def _act_order(src: Path, quantized: Path, dst: Path, group: int) -> Path:
    """``quantized`` (a GPTQ folder of ``src``) requantized in a random input order per input
    size, as GPTQ's activation order does: input ``perm[j]`` is in group ``j // group``, and
    fused projections (one input) share the order."""
    float_weights = read_tensors(src)
    tensors = read_tensors(quantized)
    config = json.loads((quantized / "config.json").read_text())
    sym = config["quantization_config"]["sym"]
    gen = torch.Generator().manual_seed(5)
    orders: dict[int, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        base = name.removesuffix(".qweight")
        weight = float_weights[f"{base}.weight"]
        perm = orders.setdefault(weight.shape[1], torch.randperm(weight.shape[1], generator=gen))
        # The permuted weight's tensors, with the code rows put back in input order.
        permuted = gptq_tensors("weight", weight[:, perm], group, sym)
        back = torch.argsort(perm)
        tensors[name] = pack_int4(unpack_int4(permuted["qweight"], dim=0)[back], dim=0)
        tensors[f"{base}.qzeros"] = permuted["qzeros"]
        tensors[f"{base}.scales"] = permuted["scales"]
        tensors[f"{base}.g_idx"] = permuted["g_idx"][back]
    config["quantization_config"]["desc_act"] = True
    return rewrite_folder(quantized, dst, tensors, config)


def _generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in engine.generate(PROMPTS, params)]


def _awq(gptq: Path, dst: Path, group: int) -> Path:
    """The asymmetric GPTQ folder ``gptq``'s weights in AutoAWQ's GEMM layout: codes and zero
    points packed along the outputs in AWQ's nibble order, zero points as they are, no
    g_idx."""
    tensors = read_tensors(gptq)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        kind = name.rpartition(".")[2]
        if kind == "qweight":
            out[name] = pack_int4(unpack_int4(t, dim=0), dim=1, order=AWQ_ORDER)
        elif kind == "qzeros":
            zeros = unpack_int4(t, dim=1).long() + 1
            out[name] = pack_int4(zeros, dim=1, order=AWQ_ORDER)
        elif kind != "g_idx":
            out[name] = t
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return rewrite_folder(gptq, dst, out, config)


CASES = {
    "group 32 sym": (32, True, ""),
    "group 64 asym": (64, False, ""),
    "per channel": (-1, True, ""),
    "act order asym": (32, False, "act order"),
    "awq group 32": (32, False, "awq"),
}


def _folder(float_folder: Path, tmp_path: Path, case: str) -> Path:
    group, sym, variant = CASES[case]
    written = tmp_path / "gptq"
    assert write_w4a16(float_folder, written, group_size=group, sym=sym) == 2 * 7
    if variant == "awq":
        return _awq(written, tmp_path / "awq", group)
    return _act_order(float_folder, written, tmp_path / "act", group) if variant else written


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_the_dequantized_float_reference(
    case: str,
    float_folder: Path,
    tmp_path: Path,
    make_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = _folder(float_folder, tmp_path, case)
    got = _generate(make_engine(folder))
    reference = dequantized_folder(folder, tmp_path / "float")
    with monkeypatch.context() as patch:
        # Plain float32 weights through F.linear, as the 4-bit kernel multiplies.
        patch.setattr(loader, "pack_linear_weights", lambda *args: 0)
        expected = _generate(make_engine(reference))
    assert got == expected
    float_tokens = _generate(make_engine(float_folder))
    assert got != float_tokens  # the quantization is there to see


@pytest.mark.parametrize("case", ["group 32 sym", "act order asym", "awq group 32"])
def test_two_tensor_parallel_ranks_generate_what_one_does(
    case: str, float_folder: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    folder = _folder(float_folder, tmp_path, case)
    one = _generate(make_engine(folder))
    parallel = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    assert _generate(make_engine(folder, parallel=parallel)) == one


def test_a_group_straddling_two_ranks_is_refused(
    float_folder: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """Group size 128 over o_proj's 128 inputs: two ranks would hold 64 each."""
    folder = tmp_path / "gptq"
    write_w4a16(float_folder, folder, group_size=128)
    parallel = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    # Refused before any layer is built, naming the first layer it would cut.
    with pytest.raises(TandemError) as caught:
        make_engine(folder, parallel=parallel)
    message = str(caught.value)
    assert "model.layers.0.self_attn.o_proj: its 128 inputs over 2 tensor-parallel" in message
    assert "group of 128 inputs" in message and "keep whole groups: 1" in message


def test_the_written_folder_is_what_autogptq_writes(float_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "gptq"
    write_w4a16(float_folder, folder, group_size=32)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (4, 32, True, False)
    assert "modules_in_block_to_quantize" not in qc
    tensors = read_tensors(folder)
    weight = read_tensors(float_folder)["model.layers.0.mlp.down_proj.weight"]  # [64, 128]
    base = "model.layers.0.mlp.down_proj"
    assert tensors[f"{base}.qweight"].dtype is torch.int32
    assert tensors[f"{base}.qweight"].shape == (128 // 8, 64)
    assert tensors[f"{base}.qzeros"].shape == (128 // 32, 64 // 8)
    # Symmetric: every stored zero point is 8 - 1.
    assert (tensors[f"{base}.qzeros"] == 0x77777777).all()
    assert tensors[f"{base}.scales"].dtype is torch.float16
    assert tensors[f"{base}.scales"].shape == (4, 64)
    assert torch.equal(tensors[f"{base}.g_idx"], (torch.arange(128) // 32).to(torch.int32))
    assert f"{base}.weight" not in tensors
    # Round to nearest: within half a step of the float weight. The top code 15 clips the
    # largest value, +7.5 steps, by half a step, and rounding the scale to float16 (2^-11
    # relative) can make it up to 7.5 * 2^-11 steps more.
    q = nibbles(tensors[f"{base}.qweight"], dim=0).t().double()
    step = tensors[f"{base}.scales"].double().t().repeat_interleave(32, dim=1)
    error = (weight.double() - (q - 8) * step).abs()
    assert (error <= step * (0.5 + 7.5 * 2.0**-11)).all()
    assert tensors["lm_head.weight"].dtype is torch.float32
    assert (folder / "tokenizer.json").is_file()


def test_sizes_the_format_cannot_hold_stay_float(
    hf_model: HfFactory, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """An MLP of 100 channels: not a multiple of 8, so gate/up/down stay float and the
    config lists the 4-bit projections; the folder still serves."""
    src, _ = hf_model("LlamaForCausalLM", intermediate_size=100)
    folder = tmp_path / "gptq"
    assert write_w4a16(src, folder, group_size=32) == 2 * 4
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["modules_in_block_to_quantize"] == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    ]
    tensors = read_tensors(folder)
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype is torch.float32
    assert "model.layers.0.self_attn.o_proj.qweight" in tensors
    assert all(len(tokens) == NEW_TOKENS for tokens in _generate(make_engine(folder)))
