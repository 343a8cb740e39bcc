"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous vocab range."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.collectives import ProcessGroup
from tandem.core.kernels.cpu.packed_linear import PackableLinear
from tandem.core.layers.weights import LazyTensor, copy_checked, read_shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, group: ProcessGroup):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // group.size)
        self.start = group.rank * self.per_rank
        self.num_real = max(0, min(self.per_rank, vocab_size - self.start))
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)

    def load_weight(self, param: nn.Parameter, loaded: LazyTensor, name: str) -> None:
        rows = loaded.get_shape()[0]
        if rows != self.vocab_size:
            raise ValueError(
                f"checkpoint tensor {name} has {rows} rows, config.json says vocab_size="
                f"{self.vocab_size}"
            )
        if self.num_real:
            src = read_shard(loaded, 0, self.start, self.num_real)
            copy_checked(param.data[: self.num_real], src, name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Logits over this rank's vocab range, gathered across ranks into the full vocabulary."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden)
        if self.group.size > 1:
            logits = self.group.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
