"""How one rank splits its cache memory between KV blocks and linear-attention state slots.

A KV block costs the same whatever sequence holds it; a state slot is one whole sequence's
state (every linear-attention layer's conv and recurrent state), however long the sequence.
So the two are sized differently out of the same budget:

* State slots first: ``max_seqs_per_batch`` of them, because the scheduler never runs more
  sequences at once (every running sequence is scheduled each step), so further slots would
  be memory no sequence can use. They may take at most half of what is free after the
  weights: the full-attention layers' KV blocks need the rest, and a running sequence needs
  both. With less than that, fewer slots, and sequences wait for one at admission.
* KV blocks from what remains, as for the dense models, but never more than the product's
  scheduler can hold at once (``BlockDemand``): for the LLM, ``--max-num-seqs`` sequences
  of ``--max-model-len`` tokens, twice over with prefix caching. Memory past that would be
  reserved for blocks no sequence can use.

* State snapshots (hybrid models with prefix caching, kv/state_snapshots.py): rows of the same
  pools, after the slots; ``--state-cache-mb`` of them, or by default two per slot (at least
  16), within the same share of memory, which the slots take first.
* Scratch rows (hybrid models with speculative decoding): ``num_speculative_tokens`` per slot,
  after the snapshots, where a verifying sequence's state after each draft position is kept
  until the drafts are judged (layers/gated_delta_net.py). A slot is sized with its scratch.

``--num-state-slots`` and ``--num-blocks`` override either count. A budget without room for
a single slot fails at start-up, saying which flags to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tandem.core.config import CacheConfig
from tandem.core.errors import ConfigError
from tandem.core.kv.kv_cache import GIB, MIB, BlockDemand, num_blocks_for_memory, usable_cache_bytes
from tandem.device import Device, MemoryInfo

logger = logging.getLogger(__name__)

# The most of the free memory that state slots may take when sized from the budget.
MAX_STATE_SHARE = 0.5
# Default snapshots at least: a server that runs few sequences at once still keeps the states
# of its last few conversations.
MIN_SNAPSHOTS = 16


@dataclass(frozen=True)
class CacheSize:
    """What every rank allocates: KV blocks, and state slots and snapshot rows (0 for models
    without linear-attention layers)."""

    num_blocks: int
    num_state_slots: int = 0
    num_state_snapshots: int = 0
    num_state_scratch: int = 0

    @property
    def num_state_rows(self) -> int:
        """Rows of every state pool beside the null one: slots, snapshots, scratch rows."""
        return self.num_state_slots + self.num_state_snapshots + self.num_state_scratch


@dataclass(frozen=True)
class CacheCosts:
    """What one rank's weights, one KV block and one state slot take, in bytes."""

    weight_bytes: int
    block_bytes: int
    state_slot_bytes: int


def size_cache(
    config: CacheConfig,
    max_seqs_per_batch: int,
    device: Device,
    memory: MemoryInfo,
    costs: CacheCosts,
    demand: BlockDemand | None = None,
    scratch_per_slot: int = 0,
) -> CacheSize:
    """``scratch_per_slot``: scratch state rows each slot needs (speculative decoding's
    ``num_speculative_tokens``; 0 without it)."""
    if costs.state_slot_bytes == 0:
        return CacheSize(
            num_blocks_for_memory(
                config, device, memory, costs.weight_bytes, costs.block_bytes, demand=demand
            )
        )
    usable, hint = usable_cache_bytes(config, device, memory, costs.weight_bytes)
    affordable = int(max(usable, 0) * MAX_STATE_SHARE) // costs.state_slot_bytes
    rows_per_slot = 1 + scratch_per_slot
    slots = config.num_state_slots
    if slots is None:
        slots = min(max_seqs_per_batch, affordable // rows_per_slot)
        if slots < 1:
            raise ConfigError(
                f"no memory for a linear-attention state slot on {device}: one sequence's "
                f"state takes {costs.state_slot_bytes * rows_per_slot} bytes (with "
                f"{scratch_per_slot} scratch rows for speculative drafts), and state slots "
                f"may use at most half of the {max(usable, 0)} bytes free after the weights; "
                f"{hint.replace('--num-blocks', '--num-state-slots')}"
            )
    scratch = slots * scratch_per_slot
    snapshots = _snapshot_rows(config, slots, affordable - scratch, costs.state_slot_bytes)
    if snapshots == 0 and demand is not None and demand.without_prefix_cache is not None:
        # Prefix caching is off without a snapshot row (the engine says so): no blocks for it.
        demand = demand.without_prefix_cache
    state_bytes = (slots + snapshots + scratch) * costs.state_slot_bytes
    logger.info(
        "linear-attention state on %s: %d slots, %d prefix-cache snapshots and %d scratch rows "
        "for speculative drafts, of %d bytes (%.2f GiB)",
        device,
        slots,
        snapshots,
        scratch,
        costs.state_slot_bytes,
        state_bytes / GIB,
    )
    num_blocks = num_blocks_for_memory(
        config,
        device,
        memory,
        costs.weight_bytes,
        costs.block_bytes,
        reserved_bytes=state_bytes,
        demand=demand,
    )
    return CacheSize(num_blocks, slots, snapshots, scratch)


def _snapshot_rows(config: CacheConfig, slots: int, affordable: int, row_bytes: int) -> int:
    """State snapshot rows: none without prefix caching; ``--state-cache-mb`` of them; else
    two per slot (a request leaves two: at its prompt's end and at its own), at least
    ``MIN_SNAPSHOTS``, as far as the state's share of memory (``affordable`` rows, less
    any scratch rows) goes beside the slots."""
    if not config.enable_prefix_cache:
        return 0
    if config.state_cache_mb is not None:
        check_state_cache_mb(config, row_bytes)
        return int(config.state_cache_mb * MIB) // row_bytes
    return max(0, min(max(2 * slots, MIN_SNAPSHOTS), affordable - slots))


def check_state_cache_mb(config: CacheConfig, row_bytes: int) -> None:
    """Refuses a ``--state-cache-mb`` above 0 that holds no state snapshot of ``row_bytes``
    (0 turns a hybrid model's prefix caching off, and says so)."""
    given = config.state_cache_mb
    if given is None or given <= 0 or int(given * MIB) // row_bytes > 0:
        return
    need = -(-row_bytes // MIB)
    raise ConfigError(
        f"--state-cache-mb {given:g} holds no state snapshot: one takes {row_bytes} bytes; "
        f"give it at least {need}, or 0 to serve this hybrid model without prefix caching"
    )
