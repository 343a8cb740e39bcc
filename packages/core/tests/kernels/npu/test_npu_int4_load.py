"""The load step that lays 4-bit layers out for torch_npu's op (``layers/npu_packing.py``),
against the stand-in: the layout made there still counts in the model's weight bytes (the KV
cache is sized from what is left beside them), and layers that keep the torch reference say
so in the log, by name, with the reason."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import cast

import pytest
import torch
from torch import nn

from tandem.core.layers.linear import RowParallelLinear
from tandem.core.layers.npu_packing import pack_npu_quantized_weights
from tandem.core.layers.quant_scheme import W4A16Scheme
from tandem.core.layers.weights import parameter_bytes
from tandem.core.llm.model_runner import ModelRunner
from tandem.core.models.causal_lm import CausalLM
from tandem.core.models.w4a16_writer import gptq_tensors

from ...layers.shard_helpers import load_tensors, rank_of

FAMILIES = ("torch_npu", "triton")
K, N, GROUP = 128, 48, 32
PACKING_LOG = "tandem.core.layers.npu_packing"


class _Model(nn.Module):
    """Just what ``ModelRunner`` asks of a model to count its weights: two 4-bit layers."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        scheme = W4A16Scheme(group_size=GROUP, sym=True, desc_act=False)
        gen = torch.Generator().manual_seed(3)
        self.first = RowParallelLinear(K, N, False, rank_of(0, 1), quant=scheme)
        self.second = RowParallelLinear(K, N, False, rank_of(0, 1), quant=scheme)
        for name, layer in (("first", self.first), ("second", self.second)):
            load_tensors(
                layer, gptq_tensors("weight", torch.randn(N, K, generator=gen), GROUP, True)
            )
            layer.finish_loading(name)
        self.to(dtype)

    def linear_attention_layers(self) -> list[nn.Module]:
        return []


def _runner(model: _Model, dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(cast(CausalLM, model), torch.device("cpu"), dtype, seed=0, samples=False)


@pytest.mark.usefixtures("standin_torch_npu")
def test_the_npu_layout_counts_in_the_weight_bytes() -> None:
    model = _Model(torch.bfloat16)
    before = _runner(model, torch.bfloat16).weight_bytes()
    assert pack_npu_quantized_weights(model, torch.bfloat16, FAMILIES) == 2
    layouts = [layer.int4.npu for layer in (model.first, model.second) if layer.int4]
    assert all(layout is not None for layout in layouts)
    held = sum(layout.nbytes for layout in layouts if layout is not None)
    after = _runner(model, torch.bfloat16).weight_bytes()
    assert after == parameter_bytes(model) + held
    # The same codes and scales; the CPU layout's zero points (uint8, all 8) are gone.
    assert after == before - 2 * N * (K // GROUP)


def test_layers_kept_on_the_reference_are_named_with_the_reason(
    standin_torch_npu: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    model = _Model(torch.float32)
    with caplog.at_level(logging.INFO, logger=PACKING_LOG):
        assert pack_npu_quantized_weights(model, torch.float32, FAMILIES) == 0
    kept = [r.getMessage() for r in caplog.records if "keep the torch 4-bit reference" in r.message]
    assert kept == [
        "first, second keep the torch 4-bit reference on NPU: npu_weight_quant_batchmatmul "
        "takes float16 and bfloat16 activations, not torch.float32"
    ]
    assert model.first.int4 is not None and model.first.int4.npu is None
