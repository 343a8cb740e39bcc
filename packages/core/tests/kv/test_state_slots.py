"""The state-slot pool: one slot per sequence, the null slot never handed out, slots given
back reused, and a sequence asking twice is a bug that says so."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tandem.core.kv.state_slots import NULL_STATE_SLOT, StateSlotPool


@dataclass
class _Owner:
    request_id: str
    state_slot: int = NULL_STATE_SLOT


def test_slots_are_distinct_never_null_and_run_out() -> None:
    pool = StateSlotPool(3)
    owners = [_Owner(f"r{i}") for i in range(4)]
    assert [pool.assign(o) for o in owners] == [True, True, True, False]
    assert sorted(o.state_slot for o in owners[:3]) == [1, 2, 3]
    assert owners[3].state_slot == NULL_STATE_SLOT
    assert pool.num_free == 0 and pool.usage == 1.0


def test_released_slots_come_back_and_release_is_idempotent() -> None:
    pool = StateSlotPool(2)
    a, b, c = _Owner("a"), _Owner("b"), _Owner("c")
    pool.assign(a)
    pool.assign(b)
    slot = a.state_slot
    pool.release(a)
    pool.release(a)  # a finished sequence freed again (abort after finish) changes nothing
    assert a.state_slot == NULL_STATE_SLOT and pool.num_free == 1
    assert pool.assign(c) and c.state_slot == slot
    pool.release(b)
    pool.release(c)
    assert pool.num_free == 2 and pool.usage == 0.0


def test_a_sequence_holding_a_slot_cannot_take_another() -> None:
    pool = StateSlotPool(2)
    a = _Owner("a")
    pool.assign(a)
    with pytest.raises(RuntimeError, match="already holds slot"):
        pool.assign(a)
    with pytest.raises(ValueError, match="num_slots"):
        StateSlotPool(0)
