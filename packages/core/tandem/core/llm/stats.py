"""What the LLM engine publishes about itself: a snapshot, replaced (never mutated) after
every step and every request it takes in or gives up, so other threads (the server's
metrics and health routes) read a consistent view without touching the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.core.llm.scheduler import Scheduler
    from tandem.core.llm.spec_decode_stats import SpecDecodeStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    # Steps launched (on pipeline lanes, or one launched ahead) and not completed yet.
    num_steps_in_flight: int = 0
    # Steps launched ahead of the processing of the previous one's outputs, since start.
    num_steps_launched_ahead: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    # Preemptions since start (each one recomputes a sequence later).
    num_preemptions: int = 0
    # Linear-attention state slots (hybrid models; 0 for the others).
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    # Prompt tokens looked up in the prefix cache at admission, and found there (for hybrid
    # models: up to a state snapshot); snapshot lookups and hits; snapshots held, and the KV
    # blocks only they hold (their prefixes' partial last blocks), cache like the free ones.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    state_snapshot_queries: int = 0
    state_snapshot_hits: int = 0
    num_state_snapshots: int = 0
    num_snapshot_blocks: int = 0
    # Speculative decoding since start (spec_decode_stats.py); all 0 without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        scheduler: Scheduler,
        num_steps_in_flight: int,
        num_steps_launched_ahead: int,
        spec: SpecDecodeStats | None = None,
    ) -> EngineStats:
        """The snapshot of ``scheduler``, its KV blocks and state slots, and ``spec``'s
        counters, now."""
        blocks, slots, snapshots = (
            scheduler.block_manager,
            scheduler.state_slots,
            scheduler.snapshots,
        )
        return cls(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_steps_in_flight=num_steps_in_flight,
            num_blocks=blocks.num_blocks,
            num_free_blocks=blocks.num_free_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_steps_launched_ahead=num_steps_launched_ahead,
            num_state_slots=slots.num_slots if slots is not None else 0,
            num_free_state_slots=slots.num_free if slots is not None else 0,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            state_snapshot_queries=scheduler.snapshot_queries,
            state_snapshot_hits=scheduler.snapshot_hits,
            num_state_snapshots=snapshots.num_snapshots if snapshots is not None else 0,
            num_snapshot_blocks=snapshots.num_tail_blocks if snapshots is not None else 0,
            spec_num_drafts=spec.num_drafts if spec is not None else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
            spec_accepted_per_position=spec.accepted_per_position if spec is not None else (),
        )

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use by requests (1 = full). Blocks only state snapshots
        hold are cache, like freed blocks whose prefix stays findable: the scheduler takes
        them back as soon as a request needs them."""
        if not self.num_blocks:
            return 0.0
        return 1.0 - (self.num_free_blocks + self.num_snapshot_blocks) / self.num_blocks

    @property
    def state_slot_usage(self) -> float:
        """Fraction of linear-attention state slots in use (1 = full; 0 without any)."""
        return (
            1.0 - self.num_free_state_slots / self.num_state_slots if self.num_state_slots else 0.0
        )
