"""Qwen3.5's multi-token-prediction head (the checkpoint's ``mtp.*``), the draft model of
speculative decoding's "mtp" method.

It predicts the token two places ahead: at position ``t`` it takes the token at ``t + 1``
(embedded with the model's own table) and the model's final hidden state at ``t``, each
zero-centred-RMS-normed, joins them (embedding first) and projects them back to the hidden
size (``fc``), runs one full-attention decoder layer of the model's kind (dense or MoE) and
a final norm; the model's ``lm_head`` turns that into logits. Its attention layer keeps a
paged KV cache like the model's own (the engine sizes it as one more attention layer and
fills it at every position the model computes, so drafts can attend to the whole sequence).

Tensor parallelism: the decoder layer is sharded as the model's layers are; ``fc`` is small
(2H x H) and every rank holds all of it.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.collectives import SingleRankGroup
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.layers.linear import ColumnParallelLinear
from tandem.core.layers.partial_rotary import PartialRotaryEmbedding
from tandem.core.layers.zero_centered_rms_norm import ZeroCenteredRMSNorm


class MultiTokenPredictor(nn.Module):
    def __init__(self, hidden_size: int, eps: float, layers: list[nn.Module]) -> None:
        """``layers``: its full-attention decoder layers (``mtp_num_hidden_layers``), built
        like the model's; the first serves every draft."""
        super().__init__()
        self.fc = ColumnParallelLinear(2 * hidden_size, hidden_size, False, SingleRankGroup())
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(hidden_size, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden_size, eps)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden_size, eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rotary: PartialRotaryEmbedding,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The head's final hidden states: ``embeds`` of the tokens one place ahead and the
        model's final ``hidden`` states at ``positions``."""
        joined = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1
        )
        x = self.fc(joined)
        x = self.layers[0](x, rotary, positions, meta)
        out: torch.Tensor = self.norm(x)
        return out
