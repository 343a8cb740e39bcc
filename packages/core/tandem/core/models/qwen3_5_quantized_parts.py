"""What a quantized Qwen3.5 checkpoint asks of the model before its weights load: how its
projections shard (for ``int4_shard_check``), and a refusal of a multi-token-prediction head
stored quantized: it is built float here, as the recipes that quantize Qwen3.5 leave it
(llm-compressor quantizes the decoder's ``Linear`` modules; the ``mtp.*`` weights are not
in the transformers model it loads), so quantized tensors there would load as garbage."""

from __future__ import annotations

from tandem.core.errors import ModelLoadError
from tandem.core.models.int4_shard_check import ShardedProjection, feed_forward_shards
from tandem.core.models.qwen3_family_config import LINEAR_ATTENTION, Qwen3FamilyConfig

# The tensors a quantized linear layer stores beside or instead of its float weight
# (compressed-tensors int8; GPTQ and AWQ 4-bit).
_QUANTIZED_SUFFIXES = (
    ".weight_scale",
    ".input_scale",
    ".weight_zero_point",
    ".weight_packed",
    ".qweight",
    ".qzeros",
    ".scales",
    ".g_idx",
)
_MTP_PREFIX = "mtp."


def sharded_projections(config: Qwen3FamilyConfig) -> list[ShardedProjection]:
    """Each layer's projections: the inputs of the row-parallel ones, the output sections
    of the column-parallel ones, as the layers split them."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim
    heads = config.linear_num_value_heads
    attention_out = config.num_heads * config.head_dim
    found: list[ShardedProjection] = []
    for i in range(config.num_layers):
        if config.layer_types[i] == LINEAR_ATTENTION:
            found += [
                ShardedProjection(i, "linear_attn.in_proj_qkv", output_sections=(key, key, value)),
                ShardedProjection(i, "linear_attn.in_proj_z", output_sections=(value,)),
                ShardedProjection(i, "linear_attn.in_proj_b", output_sections=(heads, heads)),
                ShardedProjection(i, "linear_attn.out_proj", split_inputs=value),
            ]
        else:
            found.append(ShardedProjection(i, "self_attn.o_proj", split_inputs=attention_out))
        found += feed_forward_shards(config, i)
    return found


def refuse_quantized_mtp(names: list[str], architecture: str) -> None:
    """Refuse a checkpoint whose multi-token-prediction head (``mtp.*``) is quantized."""
    stored = next(
        (n for n in names if n.startswith(_MTP_PREFIX) and n.endswith(_QUANTIZED_SUFFIXES)),
        None,
    )
    if stored is not None:
        raise ModelLoadError(
            f"{architecture}: the checkpoint's multi-token-prediction head is quantized "
            f"({stored}); it is served float only: serve without --speculative-config mtp, or "
            "from a checkpoint that keeps mtp.* float (as llm-compressor's recipes do)"
        )
