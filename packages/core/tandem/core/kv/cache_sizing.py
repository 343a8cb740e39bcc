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

``--num-state-slots`` and ``--num-blocks`` override either count. A budget without room for
a single slot fails at start-up, saying which flags to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tandem.core.config import CacheConfig
from tandem.core.errors import ConfigError
from tandem.core.kv.kv_cache import GIB, BlockDemand, num_blocks_for_memory, usable_cache_bytes
from tandem.device import Device, MemoryInfo

logger = logging.getLogger(__name__)

# The most of the free memory that state slots may take when sized from the budget.
MAX_STATE_SHARE = 0.5


@dataclass(frozen=True)
class CacheSize:
    """What every rank allocates: KV blocks, and state slots (0 for models without
    linear-attention layers)."""

    num_blocks: int
    num_state_slots: int = 0


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
) -> CacheSize:
    if costs.state_slot_bytes == 0:
        return CacheSize(
            num_blocks_for_memory(
                config, device, memory, costs.weight_bytes, costs.block_bytes, demand=demand
            )
        )
    slots = config.num_state_slots
    if slots is None:
        usable, hint = usable_cache_bytes(config, device, memory, costs.weight_bytes)
        affordable = int(max(usable, 0) * MAX_STATE_SHARE) // costs.state_slot_bytes
        slots = min(max_seqs_per_batch, affordable)
        if slots < 1:
            raise ConfigError(
                f"no memory for a linear-attention state slot on {device}: one sequence's "
                f"state takes {costs.state_slot_bytes} bytes, and state slots may use at most "
                f"half of the {max(usable, 0)} bytes free after the weights; "
                f"{hint.replace('--num-blocks', '--num-state-slots')}"
            )
    state_bytes = slots * costs.state_slot_bytes
    logger.info(
        "linear-attention state on %s: %d slots of %d bytes (%.2f GiB)",
        device,
        slots,
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
    return CacheSize(num_blocks, slots)
