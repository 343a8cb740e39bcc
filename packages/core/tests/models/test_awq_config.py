"""An AWQ ``quantization_config``: the 4-bit schemes served (AutoAWQ's GEMM layout), and a
start-up refusal naming the field for everything else."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.core.errors import ModelLoadError
from tandem.core.layers.quant_scheme import AWQ_LAYOUT, EXPERTS, PROJECTIONS, W4A16Scheme
from tandem.core.models.config_json import parse_model_config

from .test_quantization_config import BASE, MOE

AUTOAWQ = {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True}
TRANSFORMERS = {
    "quant_method": "awq",
    "bits": 4,
    "group_size": 64,
    "zero_point": True,
    "version": "gemm",
    "modules_to_not_convert": None,
}


def _config(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**BASE, "quantization_config": {**base, **changes}}


def test_autoawq_and_transformers_field_names() -> None:
    scheme = parse_model_config(_config(AUTOAWQ)).quantization
    assert scheme == W4A16Scheme(128, sym=False, desc_act=False, layout=AWQ_LAYOUT)
    scheme = parse_model_config(_config(TRANSFORMERS)).quantization
    assert scheme == W4A16Scheme(64, sym=False, desc_act=False, layout=AWQ_LAYOUT)


def test_modules_to_not_convert_leave_projections_float() -> None:
    config = _config(TRANSFORMERS, modules_to_not_convert=["mlp", "visual"])
    scheme = parse_model_config(config).quantization
    assert isinstance(scheme, W4A16Scheme)
    assert scheme.quantized == frozenset(PROJECTIONS[:4])


@pytest.mark.parametrize(
    ("skipped", "experts"),
    [([], True), (["gate"], True), (["mlp.gate"], True), (["mlp.experts"], False)],
)
def test_moe_experts_stay_float_only_when_their_module_is_skipped(
    skipped: list[str], experts: bool
) -> None:
    """Matched as vLLM matches a fused MoE layer: against ``model.layers.{i}.mlp.experts``,
    so ``gate`` (the router) leaves the experts' ``gate_proj`` 4-bit."""
    config = {**MOE, "quantization_config": {**TRANSFORMERS, "modules_to_not_convert": skipped}}
    scheme = parse_model_config(config).quantization
    assert isinstance(scheme, W4A16Scheme)
    assert (EXPERTS in scheme.quantized) is experts
    assert set(PROJECTIONS[:4]) <= scheme.quantized


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "8-bit": ({"w_bit": 8}, "w_bit is 8"),
    "group size 256": ({"q_group_size": 256}, "q_group_size is 256"),
    "gemv": ({"version": "gemv"}, "version is 'gemv'"),
    "no zero point": ({"zero_point": False}, "zero_point is False"),
    "quantized lm_head": ({"lm_head": True}, "lm_head is True"),
    "fused parts apart": ({"modules_to_not_convert": ["k_proj"]}, "all 4-bit or all float"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_configs_are_refused_naming_the_field(case: str) -> None:
    changes, said = REFUSED[case]
    with pytest.raises(ModelLoadError) as caught:
        parse_model_config(_config(AUTOAWQ, **changes))
    message = str(caught.value)
    assert said in message and "quantization_config." in message and "supported" in message
