"""A documented CPU stand-in for torch_npu's fused ops.

A test launcher puts this package into ``sys.modules["torch_npu"]`` so that the engine's NPU
kernel family, calling ``torch_npu.<op>(...)``, runs on CPU tensors. Each op follows
torch_npu's documented rules (argument names, order, keyword-only markers, defaults, return
values, dtypes, shapes, limits and refusals), transcribed from the torch_npu API pages in
Ascend/op-plugin (``docs/zh/custom_APIs/torch_npu/``), the binding schemas
(``op_plugin/config/op_plugin_functions.yaml``, ``op_plugin/ops/atb/*.cpp``) and the Ascend
Transformer Boost operation pages on hiascend.com for the ATB-backed ``_npu_*`` ops. Every
op's docstring names its sources and the limits it enforces; where the documents are silent
it says so and what the stand-in does. Math runs in float32 and is rounded once to the
documented output dtype.

Errors: ``NpuDtypeError`` (RuntimeError and TypeError) and ``NpuValueError`` (RuntimeError
and ValueError); documented features the stand-in does not implement raise
``NotImplementedError`` naming them.
"""

from ._rules import NpuDtypeError, NpuValueError
from .activation import npu_swiglu
from .attention import _npu_paged_attention, npu_fused_infer_attention_score
from .cache import _npu_reshape_and_cache
from .moe import (
    npu_grouped_matmul,
    npu_moe_compute_expert_tokens,
    npu_moe_finalize_routing,
    npu_moe_gating_top_k_softmax,
    npu_moe_init_routing,
)
from .norms import npu_add_rms_norm, npu_rms_norm
from .quant import (
    npu_convert_weight_to_int4pack,
    npu_dynamic_quant,
    npu_quant_matmul,
    npu_quantize,
    npu_trans_quant_param,
    npu_weight_quant_batchmatmul,
)
from .rotary import _npu_rotary_embedding, npu_apply_rotary_pos_emb, npu_rotary_mul

__all__ = [
    "NpuDtypeError",
    "NpuValueError",
    "_npu_paged_attention",
    "_npu_reshape_and_cache",
    "_npu_rotary_embedding",
    "npu_add_rms_norm",
    "npu_apply_rotary_pos_emb",
    "npu_convert_weight_to_int4pack",
    "npu_dynamic_quant",
    "npu_fused_infer_attention_score",
    "npu_grouped_matmul",
    "npu_moe_compute_expert_tokens",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_quant_matmul",
    "npu_quantize",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_trans_quant_param",
    "npu_weight_quant_batchmatmul",
]
