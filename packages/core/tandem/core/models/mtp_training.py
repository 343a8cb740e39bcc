"""A Qwen3.5 multi-token-prediction head to train, and the reference its drafts are checked
against: the same computation as ``multi_token_predictor.py``, on whole sequences at once,
built from transformers' own Qwen3.5 modules (differentiable, no KV cache).

Self-distillation (``benchmarks/train_mtp_head.py``): the head learns, from the model's own
hidden states over text the model generated, to predict the model's greedy choice two places
ahead, which is what a greedy verification accepts.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

_LAYER = "mtp.layers.0."


def text_config(model: Any) -> Any:
    """The text config of a transformers Qwen3.5 causal LM (or of its composite model)."""
    config = model.config
    return getattr(config, "text_config", None) or config


class TrainableHead(nn.Module):
    def __init__(self, config: Any) -> None:
        """``config``: the model's transformers text config (``Qwen3_5TextConfig`` or the MoE
        one), whose last full-attention layer kind the head's layer takes."""
        # The modeling module beside the config's: Qwen3.5's or Qwen3.5-MoE's classes.
        module = importlib.import_module(
            type(config).__module__.replace(".configuration_", ".modeling_")
        )
        prefix = "Qwen3_5Moe" if "moe" in config.model_type else "Qwen3_5"
        norm = getattr(module, f"{prefix}RMSNorm")
        super().__init__()
        hidden = config.hidden_size
        full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = getattr(module, f"{prefix}DecoderLayer")(config, layer_idx=full[-1])
        self.norm = norm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_embedding = norm(hidden, eps=config.rms_norm_eps)
        self.rotary = getattr(module, f"{prefix}TextRotaryEmbedding")(config)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] final hidden states of the head at every position of B sequences, from
        the embeddings of the tokens one place ahead and the model's final hidden states."""
        x = self.fc(
            torch.cat(
                [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1
            )
        )
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos_sin = self.rotary(x, positions)
        # No mask: transformers' attention is causal then, over every earlier position.
        x = self.layer(x, cos_sin, attention_mask=None, position_ids=positions)
        out: torch.Tensor = self.norm(x)
        return out

    def load_head(self, head: dict[str, torch.Tensor]) -> None:
        """Take ``mtp.*`` tensors (``mtp_writer.py``'s layout)."""
        state = {}
        for name, tensor in _fuse_experts(head).items():
            if name.startswith(_LAYER):
                state["layer." + name[len(_LAYER) :]] = tensor
            else:
                state[name.removeprefix("mtp.")] = tensor
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(f"head tensors do not fit: missing {missing}, unexpected {unexpected}")

    def head(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Its weights as ``mtp.*`` tensors in ``dtype``."""
        out = {}
        for name, tensor in self.state_dict().items():
            if name.startswith("rotary."):
                continue
            key = _LAYER + name[len("layer.") :] if name.startswith("layer.") else "mtp." + name
            out[key] = tensor.detach().to(dtype).clone()
        return _split_experts(out)


# A checkpoint names each routed expert's projections (``mlp.experts.{e}.gate_proj.weight``);
# transformers' MoE block holds them stacked, gate and up joined ([E, 2I, H], [E, H, I]).
_EXPERTS = _LAYER + "mlp.experts."


def _fuse_experts(head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    count = sum(
        1 for name in head if name.startswith(_EXPERTS) and name.endswith(".down_proj.weight")
    )
    if not count:
        return head
    out = {k: v for k, v in head.items() if not k.startswith(_EXPERTS)}

    def stacked(part: str) -> torch.Tensor:
        return torch.stack([head[f"{_EXPERTS}{e}.{part}.weight"] for e in range(count)])

    out[_EXPERTS + "gate_up_proj"] = torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1)
    out[_EXPERTS + "down_proj"] = stacked("down_proj")
    return out


def _split_experts(head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gate_up = head.pop(_EXPERTS + "gate_up_proj", None)
    down = head.pop(_EXPERTS + "down_proj", None)
    if gate_up is None or down is None:
        return head
    gate, up = gate_up.chunk(2, dim=1)
    for e in range(gate_up.shape[0]):
        head[f"{_EXPERTS}{e}.gate_proj.weight"] = gate[e].clone()
        head[f"{_EXPERTS}{e}.up_proj.weight"] = up[e].clone()
        head[f"{_EXPERTS}{e}.down_proj.weight"] = down[e].clone()
    return head


def load_reference_model(folder: Path) -> Any:
    """The checkpoint as transformers' causal LM, in float32, for hidden states and logits."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    return model


def reference_drafts(model: Any, head: TrainableHead, token_ids: list[int]) -> list[int]:
    """The head's greedy draft at every position of ``token_ids`` but the last: entry ``t``
    predicts the token at ``t + 2`` from the token at ``t + 1`` and the model's state at ``t``."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        embeds = model.get_input_embeddings()(ids[:, 1:])
        out = head(embeds, hidden[:, :-1])
        drafts = model.lm_head(out).argmax(-1)
    return [int(t) for t in drafts[0]]
