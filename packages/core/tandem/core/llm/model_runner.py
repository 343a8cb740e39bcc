"""Runs the model for one step on the worker's device: attention metadata, forward, logits,
sampling. The KV cache and the sampler live here, built once."""

from __future__ import annotations

import torch

from tandem.core.kv.kv_cache import allocate_kv_cache
from tandem.core.llm.attention_metadata import build_attention_metadata
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.sampler import Sampler
from tandem.core.models.decoder import DecoderForCausalLM


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        samples: bool,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        # With tensor parallelism every rank has the full logits; only one needs to sample.
        self.sampler = Sampler(seed) if samples else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        layers = self.model.attention_layers()
        first = layers[0]
        self.kv_caches = allocate_kv_cache(
            num_layers=len(layers),
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for layer, (k, v) in zip(layers, self.kv_caches, strict=True):
            layer.bind_cache(k, v)

    @torch.inference_mode()
    def execute(self, fi: ForwardInput) -> SamplerOutput | None:
        meta = build_attention_metadata(fi, self.device)
        hidden = self.model(fi.input_ids.to(self.device), fi.positions.to(self.device), meta)
        if fi.sample_indices.numel() == 0:
            return SamplerOutput(token_ids=[]) if self.sampler is not None else None
        logits = self.model.compute_logits(hidden[fi.sample_indices.to(self.device)])
        if self.sampler is None:
            return None
        return self.sampler(logits, fi.sampling)

    @torch.inference_mode()
    def prompt_logits(self, fi: ForwardInput) -> torch.Tensor:
        """Logits of every token of the step (for checks against a reference model)."""
        meta = build_attention_metadata(fi, self.device)
        hidden = self.model(fi.input_ids.to(self.device), fi.positions.to(self.device), meta)
        return self.model.compute_logits(hidden).float().cpu()
