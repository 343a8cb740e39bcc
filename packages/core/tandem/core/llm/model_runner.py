"""The LLM's step runner: attention metadata, forward, logits, sampling, on the worker's
device. The KV cache, the linear-attention state pools (hybrid models) and the sampler live
here, built once."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tandem.collectives import ProcessGroup
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.cpu.packed_linear import packed_bytes
from tandem.core.kernels.device_copy import to_device_once
from tandem.core.kv.block_pool import NULL_BLOCK
from tandem.core.kv.cache_sizing import CacheSize, check_state_cache_mb
from tandem.core.kv.kv_cache import (
    BlockDemand,
    SequenceLimits,
    allocate_kv_cache,
    bytes_per_block,
    copy_rows,
)
from tandem.core.layers.int8_packing import int8_packed_bytes
from tandem.core.layers.linear_attention_state import (
    allocate_linear_attention_state,
    state_bytes_per_slot,
)
from tandem.core.layers.npu_packing import npu_int4_bytes
from tandem.core.layers.weights import parameter_bytes
from tandem.core.llm.attention_metadata import plan_attention_metadata, plan_decode_metadata
from tandem.core.llm.forward_input import AheadInputs, ForwardInput, SamplerOutput
from tandem.core.llm.logits_processor import ProcessorContext
from tandem.core.llm.logits_processors import LogitsProcessors
from tandem.core.llm.prompt_logprobs import score_prompt
from tandem.core.llm.sampler import Sampler
from tandem.core.models.causal_lm import CausalLM
from tandem.core.models.config_json import load_model_config
from tandem.core.models.loader import load_model, resolve_dtype, state_slot_bytes_before_load
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.registry import model_class
from tandem.core.worker.lane_stager import LaneStager, Staged
from tandem.core.worker.step_runner import LaneState, RunnerContext


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        samples: bool,
        processors: LogitsProcessors | None = None,
        limits: SequenceLimits | None = None,
        group: ProcessGroup | None = None,
        head_drafts: int = 1,
    ) -> None:
        """``limits``: what bounds the KV cache beside memory (None: memory alone);
        ``group``: the tensor-parallel ranks (a multi-token-prediction head's input needs
        the sampled tokens on every rank; None: one rank); ``head_drafts``: the drafts a
        multi-token-prediction head makes per sequence a step, when the steps carry its
        inputs."""
        self.model = model
        self.group = group
        self.head_drafts = head_drafts
        self._limits = limits
        self.device = device
        self.dtype = dtype
        # With tensor parallelism every rank has the full logits; only one needs to sample.
        self.sampler = Sampler(seed, processors) if samples else None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.state_pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._linear_layers = model.linear_attention_layers()
        # Every linear-attention layer of a model has the same conv width; None: no such layer.
        self._conv_kernel_size = (
            self._linear_layers[0].conv_kernel_size if self._linear_layers else None
        )

    def weight_bytes(self) -> int:
        # Weights packed at load (float and int8 for the CPU kernels, 4-bit for torch_npu's
        # op) live beside the parameters, which then hold none of them.
        packed = packed_bytes(self.model) + int8_packed_bytes(self.model)
        return parameter_bytes(self.model) + packed + npu_int4_bytes(self.model)

    def block_bytes(self, block_size: int) -> int:
        layers = self.model.attention_layers()
        if not layers:
            return 0
        return bytes_per_block(
            len(layers), layers[0].num_kv_heads, layers[0].head_dim, block_size, self.dtype
        )

    def state_slot_bytes(self) -> int:
        return state_bytes_per_slot(self._linear_layers, self.dtype)

    def block_demand(self, block_size: int) -> BlockDemand | None:
        return None if self._limits is None else self._limits.block_demand(block_size)

    def init_kv_cache(self, size: CacheSize, block_size: int, prefault: bool) -> None:
        layers = self.model.attention_layers()
        if layers:
            first = layers[0]
            self.kv_caches = allocate_kv_cache(
                num_layers=len(layers),
                num_blocks=size.num_blocks,
                block_size=block_size,
                num_kv_heads=first.num_kv_heads,
                head_dim=first.head_dim,
                dtype=self.dtype,
                device=self.device,
                prefault=prefault,
            )
        for layer, (k, v) in zip(layers, self.kv_caches, strict=True):
            layer.bind_cache(k, v)
        if self._linear_layers:
            self.state_pools = allocate_linear_attention_state(
                self._linear_layers, size.num_state_rows, self.dtype, self.device
            )

    def stage(self, fi: ForwardInput, stager: LaneStager) -> tuple[ForwardInput, Staged]:
        """The step's inputs and the host half of its attention metadata in one copy."""
        plan = plan_attention_metadata(fi, self._conv_kernel_size)
        ahead = _ahead_tensors(fi)
        staged = stager.stage(
            [fi.input_ids, fi.positions, fi.sample_indices, *ahead, *plan.tensors]
        )
        ids, positions, samples, *rest = staged.tensors
        own = replace(
            fi, input_ids=ids, positions=positions, sample_indices=samples,
            ahead=_moved_ahead(fi, rest[: len(ahead)]),
            staged_attention=(plan, tuple(rest[len(ahead) :])),
        )  # fmt: skip
        return own, staged

    def _on_device(self, fi: ForwardInput) -> tuple[torch.Tensor, _StepTensors]:
        """Sampled rows, and token ids, positions, attention metadata and the head's inputs
        on the device. Nothing is read back from it: what depends on the step's values was
        decided on the host."""
        if fi.staged_attention is not None:
            plan, staged = fi.staged_attention
            meta = plan.finish(staged, self.device)
            return fi.sample_indices, _StepTensors(fi.input_ids, fi.positions, meta, fi.ahead)
        plan = plan_attention_metadata(fi, self._conv_kernel_size)
        ahead = _ahead_tensors(fi)
        moved = to_device_once(
            [fi.input_ids, fi.positions, fi.sample_indices, *ahead, *plan.tensors], self.device
        )
        ids, positions, samples, *rest = moved
        meta = plan.finish(rest[len(ahead) :], self.device)
        return samples, _StepTensors(ids, positions, meta, _moved_ahead(fi, rest[: len(ahead)]))

    def _forward(self, fi: ForwardInput) -> tuple[torch.Tensor, torch.Tensor, _StepTensors]:
        """The step's hidden states and sampled rows, with the state rows' copies around the
        forward (hybrid models: rollbacks of rejected drafts, prefix-caching snapshots)."""
        copies = fi.state_copies
        if copies is not None:
            copy_rows(self.state_pools, copies.rollbacks)
            copy_rows(self.kv_caches, copies.blocks)
            copy_rows(self.state_pools, copies.restores)
        samples, step = self._on_device(fi)
        hidden = self.model(step.ids, step.positions, step.meta)
        if copies is not None:
            copy_rows(self.state_pools, copies.snapshots)
        return hidden, samples, step

    @torch.inference_mode()
    def execute(self, fi: ForwardInput, state: LaneState | None = None) -> SamplerOutput | None:
        hidden, samples, step = self._forward(fi)
        out = self._sample(hidden, samples, fi)
        if step.ahead is not None:
            out = self._draft_ahead(step.ahead, step, hidden, out, fi)
        if fi.prompt_logprobs is None:
            return out
        scored = score_prompt(
            self.model.compute_logits, hidden, fi.prompt_logprobs, keep=out is not None
        )
        return None if out is None else replace(out, prompt_logprobs=scored)

    def _sample(
        self, hidden: torch.Tensor, samples: torch.Tensor, fi: ForwardInput
    ) -> SamplerOutput | None:
        if samples.numel() == 0:
            if self.sampler is None:
                return None
            # The batch's changes still reach the processors, once, in step order.
            self.sampler.update(fi.sampling)
            return SamplerOutput(token_ids=[])
        logits = self.model.compute_logits(hidden[samples])
        if self.sampler is None:
            return None
        return self.sampler(logits, fi.sampling)

    def _draft_ahead(
        self,
        ahead: AheadInputs,
        step: _StepTensors,
        hidden: torch.Tensor,
        out: SamplerOutput | None,
        fi: ForwardInput,
    ) -> SamplerOutput | None:
        """Run the multi-token-prediction head over the step's tokens (``ahead``: its inputs,
        on the device), filling its KV cache at every position as the model's layers do, and
        draft, per sequence that sampled, the token after the sampled one: the head's argmax
        at its last accepted position; then the drafts after it (``_later_drafts``).

        The head's input at a token is the token one place ahead: the step's next token,
        the prompt's next one for a chunk cut short, the sampled token after a sequence's
        last accepted position. Inputs at rejected positions are wrong and so is what the
        head caches there, but the next step computes those positions again."""
        last, after = ahead.last_index, ahead.sampled_after
        sampled = self._sampled_on_every_rank(out, int(after.shape[0]))
        next_ids = step.ids.roll(-1)
        next_ids[last] = torch.where(ahead.next_ids >= 0, ahead.next_ids, next_ids[last])
        rows = after + sampled[1]
        next_ids[rows] = sampled[0]
        predicted = self.model.predict_ahead(next_ids, step.positions, hidden, step.meta)
        if rows.numel() == 0:
            return out
        # On every rank: the logits are gathered across them.
        first = predicted[rows]
        drafts = [self.model.compute_logits(first).argmax(dim=-1)]
        if self.head_drafts > 1:
            drafts += self._later_drafts(ahead, sampled[1], drafts[0], first, fi)
        if out is None:
            return None
        # A sequence's drafts end where its chain stopped (-1 after).
        chains = torch.stack(drafts, dim=1).tolist()
        return replace(out, draft_token_ids=[[t for t in c if t >= 0] for c in chains])

    def _later_drafts(
        self,
        ahead: AheadInputs,
        accepted: torch.Tensor,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        fi: ForwardInput,
    ) -> list[torch.Tensor]:
        """The head's second to ``head_drafts``-th drafts, [S] each on the device (-1 where
        a sequence has none), one head step per draft over every sequence that sampled.

        Each step runs the head one position further: its input there is the token it drafted
        last and, in place of the model's hidden state (not computed yet), its own output at
        the position before, as vLLM's MTP proposer chains them. Its KV goes to the
        sequence's blocks past the step's tokens (``Scheduler._reserve_lookahead``) and is
        overwritten by the next step, which computes those positions with the model's
        states. A sequence whose blocks end sooner (none were free), or that reaches the
        rotary table's end, drafts no further.

        The positions and slots are host arithmetic on the step's host tensors and the
        accepted counts (on ranks other than 0 those come from rank 0: on an accelerator a
        read-back, as the sampled tokens are one on rank 0)."""
        assert ahead.sampled_positions is not None and ahead.sampled_rows is not None
        tables = fi.block_tables[ahead.sampled_rows]
        block_size = fi.block_size
        limit = torch.clamp(
            (tables != NULL_BLOCK).sum(dim=1) * block_size,
            max=self.model.config.max_position_embeddings,
        )
        position = ahead.sampled_positions + accepted.cpu()
        live = torch.arange(position.shape[0])
        drafts: list[torch.Tensor] = []
        for _ in range(1, self.head_drafts):
            position = position + 1
            fits = (position < limit)[live]
            if not bool(fits.all()):
                keep = fits.nonzero().squeeze(1)
                live = live[keep]
                moved_keep = keep.to(self.device)
                ids, hidden = ids[moved_keep], hidden[moved_keep]
            if live.numel() == 0:
                break
            at = position[live]
            plan = plan_decode_metadata(at, tables[live], block_size)
            moved_at, moved_live, *meta_tensors = to_device_once(
                [at, live, *plan.tensors], self.device
            )
            meta = plan.finish(meta_tensors, self.device)
            hidden = self.model.predict_ahead(ids, moved_at, hidden, meta)
            ids = self.model.compute_logits(hidden).argmax(dim=-1)
            step_drafts = torch.full_like(accepted, -1)
            step_drafts[moved_live] = ids
            drafts.append(step_drafts)
        return drafts

    def _sampled_on_every_rank(self, out: SamplerOutput | None, count: int) -> torch.Tensor:
        """[2, count] on the device: the tokens sampled on rank 0 and how many drafts each
        sequence had accepted, on every rank (only rank 0 samples)."""
        values = torch.zeros(2, count, dtype=torch.int64)
        if out is not None and count:
            values[0] = torch.tensor(out.token_ids, dtype=torch.int64)
            if out.num_accepted is not None:
                values[1] = torch.tensor(out.num_accepted, dtype=torch.int64)
        moved = values.to(self.device)
        # ``count`` is the same on every rank: a step that samples nothing broadcasts nothing.
        if self.group is None or self.group.size == 1 or count == 0:
            return moved
        return self.group.broadcast(moved, root=0)

    @torch.inference_mode()
    def prompt_logits(self, fi: ForwardInput) -> torch.Tensor:
        """Logits of every token of the step (for checks against a reference model)."""
        hidden, _, _ = self._forward(fi)
        return self.model.compute_logits(hidden).float().cpu()


@dataclass(frozen=True)
class _StepTensors:
    """The step's inputs on the device, its attention metadata and the head's inputs."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    ahead: AheadInputs | None


def _ahead_tensors(fi: ForwardInput) -> list[torch.Tensor]:
    """The multi-token-prediction head's host inputs, moved with the step's others."""
    a = fi.ahead
    return [] if a is None else [a.last_index, a.next_ids, a.sampled_after]


def _moved_ahead(fi: ForwardInput, moved: list[torch.Tensor]) -> AheadInputs | None:
    if fi.ahead is None:
        return None
    last_index, next_ids, sampled_after = moved
    return replace(fi.ahead, last_index=last_index, next_ids=next_ids, sampled_after=sampled_after)


@dataclass(frozen=True)
class LLMRunnerFactory:
    """Loads a decoder model's shard (dense, MoE or hybrid) into a ``ModelRunner`` (picklable:
    it crosses into worker processes)."""

    model_config: ModelConfig

    @classmethod
    def from_folder(cls, folder: Path) -> LLMRunnerFactory:
        """For the model folder's config; an architecture we cannot serve fails here."""
        model_config = load_model_config(folder)
        model_class(model_config.architecture)
        return cls(model_config)

    def __call__(self, context: RunnerContext) -> ModelRunner:
        config = context.config
        dtype = resolve_dtype(
            config.model.dtype, self.model_config.checkpoint_dtype, context.device.kind
        )
        model_config = self.model_config
        spec = config.speculative
        if spec is not None and spec.drafts_with_head:
            model_config = replace(model_config, serve_mtp=True)
        cache = config.cache
        if model_config.has_linear_attention and cache.enable_prefix_cache and cache.state_cache_mb:
            # A --state-cache-mb too small for one snapshot is refused before the weights load
            # (minutes for a large checkpoint), not after.
            row_bytes = state_slot_bytes_before_load(model_config, context.group, dtype)
            if row_bytes:
                check_state_cache_mb(cache, row_bytes)
        model = load_model(
            Path(config.model.model), model_config, context.group, dtype, context.torch_device
        )
        samples = context.group.rank == 0
        processors = None
        if samples:
            processors = LogitsProcessors(
                ProcessorContext(
                    vocab_size=self.model_config.vocab_size,
                    device=context.torch_device,
                    max_rows=config.scheduler.max_seqs_per_batch,
                ),
            )
        return ModelRunner(
            model,
            context.torch_device,
            dtype,
            seed=config.model.seed,
            samples=samples,
            processors=processors,
            limits=SequenceLimits(
                max_seqs=config.scheduler.max_seqs_per_batch,
                context_len=config.model.context_length(self.model_config.max_position_embeddings),
                # A hybrid model left without a state snapshot row serves without it
                # (cache_sizing.py then sizes the blocks without it).
                prefix_cache=config.cache.enable_prefix_cache,
            ),
            group=context.group,
            head_drafts=spec.num_speculative_tokens if spec is not None else 1,
        )
