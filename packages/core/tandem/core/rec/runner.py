"""Runs a recommender step on the worker's device: the shared weights and the shared paged
cross-attention cache, with each batch's beams in the state of the lane that runs it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tandem.core.kv.block_pool import NULL_BLOCK
from tandem.core.kv.cache_sizing import CacheSize
from tandem.core.kv.kv_cache import (
    BlockDemand,
    SequenceLimits,
    allocate_kv_cache,
    bytes_per_block,
)
from tandem.core.layers.weights import parameter_bytes
from tandem.core.models.loader import resolve_dtype
from tandem.core.models.rec_config import RecModelConfig
from tandem.core.models.rec_loader import load_rec_model
from tandem.core.models.rec_model import GenerativeRecommender
from tandem.core.rec.beam_search import Beams, beam_step, best_candidates, initial_beams
from tandem.core.rec.catalog import Catalog, load_catalog
from tandem.core.rec.fixed_steps_scheduler import rec_capacity
from tandem.core.rec.step import RecPrefill, RecStep, RecStepOutput
from tandem.core.worker.lane_stager import LaneStager, Staged
from tandem.core.worker.step_runner import LaneState, RunnerContext


@dataclass
class BatchState:
    """One in-flight batch, kept by the lane that runs it (lanes never share these)."""

    widths: torch.Tensor
    num_candidates: tuple[int, ...]
    beams: Beams
    # Built once at the prefill, read every round: cache slots of the history's keys and
    # which of them each request attends.
    slots: torch.Tensor  # [R, blocks * block_size]
    mask: torch.Tensor  # [R, blocks * block_size]


class RecModelRunner:
    def __init__(
        self,
        model: GenerativeRecommender,
        catalog: Catalog,
        device: torch.device,
        dtype: torch.dtype,
        limits: SequenceLimits | None = None,
    ) -> None:
        """``limits``: what bounds the KV cache beside memory (None: memory alone)."""
        self.model = model
        self._limits = limits
        self.catalog = catalog
        self.device = device
        self.dtype = dtype
        self.block_size = 0
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

    def weight_bytes(self) -> int:
        return parameter_bytes(self.model)

    def block_bytes(self, block_size: int) -> int:
        heads, head_dim = self.model.cross_heads()
        return bytes_per_block(
            len(self.model.decoder.layers), heads, head_dim, block_size, self.dtype
        )

    def state_slot_bytes(self) -> int:
        """None: a recommender keeps no per-sequence recurrent state."""
        return 0

    def block_demand(self, block_size: int) -> BlockDemand | None:
        return None if self._limits is None else self._limits.block_demand(block_size)

    def init_kv_cache(self, size: CacheSize, block_size: int, prefault: bool) -> None:
        heads, head_dim = self.model.cross_heads()
        self.block_size = block_size
        caches = allocate_kv_cache(
            num_layers=len(self.model.decoder.layers),
            num_blocks=size.num_blocks,
            block_size=block_size,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=self.dtype,
            device=self.device,
            prefault=prefault,
        )
        self.k_caches = [k for k, _ in caches]
        self.v_caches = [v for _, v in caches]

    def stage(self, step: RecStep, stager: LaneStager) -> tuple[RecStep, Staged | None]:
        """A prefill's tensors go through the lane's stager; decode rounds carry none."""
        p = step.prefill
        if p is None:
            return step, None
        staged = stager.stage([p.histories, p.lengths, p.block_tables, p.beam_widths])
        h, lengths, tables, widths = staged.tensors
        own = RecPrefill(h, lengths, tables, widths, p.num_candidates)
        return replace(step, prefill=own), staged

    def _slots(self, tables: torch.Tensor, length: int) -> torch.Tensor:
        """[R, length] cache slot of every history position."""
        pos = torch.arange(length, device=tables.device)
        return tables[:, pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def execute(self, step: RecStep, state: LaneState) -> RecStepOutput:
        """One round of a batch; the batch's beams live in the running lane's ``state``."""
        if step.round == 0:
            assert step.prefill is not None, "round 0 carries the prefill"
            batch = self._prefill(step.prefill)
            state[step.batch_id] = batch
        else:
            batch = state[step.batch_id]
        cross = [
            (k.view(-1, *k.shape[2:])[batch.slots], v.view(-1, *v.shape[2:])[batch.slots])
            for k, v in zip(self.k_caches, self.v_caches, strict=True)
        ]
        logits = self.model.decode(batch.beams.codes.to(self.device), cross, batch.mask)
        batch.beams = beam_step(batch.beams, logits.cpu(), self.catalog, batch.widths)
        if step.round < self.model.config.max_decode_rounds:
            return RecStepOutput(step.batch_id, step.round, finished=False)
        del state[step.batch_id]
        candidates, scores = best_candidates(batch.beams, list(batch.num_candidates))
        return RecStepOutput(step.batch_id, step.round, True, candidates, scores)

    def _prefill(self, p: RecPrefill) -> BatchState:
        items = p.histories.to(self.device)
        lengths = p.lengths.to(self.device)
        tables = p.block_tables.to(self.device)
        length = items.shape[1]
        mask = torch.arange(length, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        encoded = self.model.encode(items, mask)
        slots = self._slots(tables, length)[mask]
        for (k, v), k_cache, v_cache in zip(
            self.model.cross_key_values(encoded), self.k_caches, self.v_caches, strict=True
        ):
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[mask])
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[mask])
        span = tables.shape[1] * self.block_size
        # Kept across rounds: computed (or copied) here, because the step's inputs live in
        # scratch memory that is handed out again once this step's stream work is done.
        return BatchState(
            widths=p.beam_widths.clone(),
            num_candidates=p.num_candidates,
            beams=initial_beams(len(p.num_candidates), int(p.beam_widths.max())),
            slots=self._slots(tables, span),
            mask=torch.arange(span, device=self.device).unsqueeze(0) < lengths.unsqueeze(1),
        )


def pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables], dtype=torch.int64)


@dataclass(frozen=True)
class RecRunnerFactory:
    """Loads a recommender's shard and its catalog into a ``RecModelRunner``."""

    model_config: RecModelConfig

    def __call__(self, context: RunnerContext) -> RecModelRunner:
        config = context.config
        folder = Path(config.model.model)
        dtype = resolve_dtype(
            config.model.dtype, self.model_config.torch_dtype, context.device.kind
        )
        model = load_rec_model(
            folder, self.model_config, context.group, dtype, context.torch_device
        )
        catalog = load_catalog(folder, self.model_config.codebook_size)
        capacity = rec_capacity(config)
        # A request's blocks hold its history's cross-attention keys and values, reserved at
        # admission for its whole life. Its beams add none: they all read those same keys,
        # and the decoder's self-attention over the few codes emitted so far is computed
        # afresh every round, outside the cache. So one request is one sequence whatever its
        # beam width, at most the model's max_history items long; nothing is shared between
        # histories (no prefix cache).
        limits = SequenceLimits(
            max_seqs=capacity.running,
            context_len=self.model_config.max_history,
            prefix_cache=False,
            seqs=f"requests ({capacity.running_why}; a request's beams share its blocks)",
            length="history items (the model's max_history)",
        )
        return RecModelRunner(model, catalog, context.torch_device, dtype, limits)
