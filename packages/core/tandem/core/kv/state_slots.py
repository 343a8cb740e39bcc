"""The state slots of linear-attention (Gated DeltaNet) layers: one per running sequence.

Beside its KV blocks, a sequence of a hybrid model holds one slot, the row of every
linear-attention layer's conv-state and recurrent-state pools that carries its state from one
chunk or decode step to the next. Unlike KV blocks, a slot's size does not depend on the
sequence's length: a sequence takes one when it is admitted and keeps it to its end (finish,
abort, or preemption by recompute, after which it starts over from a zero state).

Slot 0 is the null slot, as block 0 is the null block: models without linear attention pass
it for every sequence, and it is never handed out. A slot handed out again needs no clearing:
a sequence's first chunk starts from zero whatever its slot held.

Thread-safe like the block manager: one lock from the sync facade on every public method.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from tandem.device.sync import REAL_SYNC, Sync

NULL_STATE_SLOT = 0


class StateSlotOwner(Protocol):
    """What the pool needs of a sequence."""

    request_id: str
    # Its slot, or NULL_STATE_SLOT while it holds none.
    state_slot: int


class StateSlotPool:
    def __init__(self, num_slots: int, sync: Sync = REAL_SYNC) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        # Physical slots 1..num_slots; freed ones go to the back.
        self._free = deque(range(1, num_slots + 1))
        self._lock = sync.lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_slots

    def assign(self, owner: StateSlotOwner) -> bool:
        """Give ``owner`` a slot; False (and nothing changed) when none is free."""
        if owner.state_slot != NULL_STATE_SLOT:
            raise RuntimeError(f"request {owner.request_id} already holds slot {owner.state_slot}")
        with self._lock:
            if not self._free:
                return False
            owner.state_slot = self._free.popleft()
            return True

    def exchange(self, owner: StateSlotOwner, row: int) -> None:
        """Take ``owner``'s slot out of the pool (its row becomes a state snapshot, see
        state_snapshots.py) and put ``row`` in its place."""
        slot = owner.state_slot
        if slot == NULL_STATE_SLOT:
            raise RuntimeError(f"request {owner.request_id} holds no slot to exchange")
        with self._lock:
            owner.state_slot = NULL_STATE_SLOT
            self._free.append(row)

    def release(self, owner: StateSlotOwner) -> None:
        """Take ``owner``'s slot back (nothing if it holds none)."""
        slot = owner.state_slot
        if slot == NULL_STATE_SLOT:
            return
        with self._lock:
            owner.state_slot = NULL_STATE_SLOT
            self._free.append(slot)
