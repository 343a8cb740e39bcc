"""Snapshots of the linear-attention state at the end of a prefix: what lets a hybrid model's
prompt skip a cached prefix in its Gated DeltaNet layers as its full-attention layers skip it
with cached KV blocks.

A snapshot is one row of every linear-attention layer's conv-state and recurrent-state pools
(the same pools as the running sequences' slots, rows of their own), holding the state after
the first ``num_tokens`` tokens of some sequence. A new sequence whose tokens begin with those
tokens may start from it when the prefix cache holds the KV of all of them too: the full blocks
through the chain hash of the last one (``parent``), and the tokens after it (``tail``, when
``num_tokens`` is not a multiple of the block size) in a block the snapshot keeps a reference
on. That block is copied into the new sequence's own block, never shared: the new sequence
writes its next tokens into it. A snapshot is never used without its KV, and KV blocks alone
never skip anything in a hybrid model, so each is useless without the other: a lookup considers
only snapshots whose blocks the prefix cache still holds, and an eviction takes those whose
blocks are gone first.

Where snapshots are taken is the scheduler's choice (scheduler.py); rows come from a bounded
pool, least recently used first. A snapshot being written or read by a step in flight is
pinned; one being written is found by no lookup until its step completed (``complete``).

Thread-safe: one lock. It calls into the block manager (releasing tail blocks, asking whether a
hash is cached) while holding it; the block manager never calls back, so the two locks are
always taken in that order.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.device.sync import REAL_SYNC, Sync


@dataclass(eq=False)
class Snapshot:
    # Its row in every linear-attention layer's state pools.
    row: int
    # Tokens whose state it holds.
    num_tokens: int
    # Chain hash of the last full KV block of those tokens (None: fewer than one block).
    parent: int | None
    # The tokens after that block, and the KV block holding them (a reference held); empty
    # and None when num_tokens is a multiple of the block size.
    tail: tuple[int, ...]
    tail_block: int | None
    # Steps in flight that read or write the row.
    pins: int = 0
    # Written (its step completed): lookups may find it.
    ready: bool = False


class StateSnapshotCache:
    def __init__(
        self,
        rows: Sequence[int],
        block_size: int,
        release_block: Callable[[int], None],
        is_cached: Callable[[int], bool],
        ref_count: Callable[[int], int],
        sync: Sync = REAL_SYNC,
    ) -> None:
        """``rows``: the pool rows that hold snapshots; ``release_block(block)`` drops the
        reference on a tail block; ``is_cached(h)``: whether the prefix cache still holds the
        block of chain hash ``h``; ``ref_count(block)``: the references a block has."""
        self.num_rows = len(rows)
        self.block_size = block_size
        self._release_block = release_block
        self._is_cached = is_cached
        self._ref_count = ref_count
        self._free: deque[int] = deque(rows)
        # Ready snapshots, least recently used first.
        self._lru: OrderedDict[Snapshot, None] = OrderedDict()
        # Every snapshot, ready or being written, by (parent, tail).
        self._by_key: dict[tuple[int | None, tuple[int, ...]], Snapshot] = {}
        self._by_parent: dict[int | None, list[Snapshot]] = {}
        self._lock = sync.lock()

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    @property
    def num_snapshots(self) -> int:
        return len(self._by_key)

    @property
    def num_tail_blocks(self) -> int:
        """KV blocks that only snapshots hold (partial last blocks of their prefixes whose
        sequences have ended): cache, taken back whenever a request needs blocks."""
        with self._lock:
            refs = Counter(s.tail_block for s in self._by_key.values() if s.tail_block is not None)
            return sum(1 for block, n in refs.items() if self._ref_count(block) == n)

    @property
    def num_pinned(self) -> int:
        with self._lock:
            return sum(1 for s in self._by_key.values() if s.pins)

    def holds(self, parent: int | None, tail: tuple[int, ...]) -> bool:
        """Whether the prefix ``(parent, tail)`` has a snapshot, ready or being written."""
        with self._lock:
            return (parent, tail) in self._by_key

    def lookup(
        self, token_ids: Sequence[int], cached_hashes: Sequence[int], limit: int
    ) -> Snapshot | None:
        """The snapshot holding the longest prefix of ``token_ids`` of at most ``limit``
        tokens whose full blocks are among ``cached_hashes`` (the chain hashes of the blocks the
        prefix cache holds for ``token_ids``, in order); pinned for the step that reads it.
        None when there is none."""
        bs = self.block_size
        with self._lock:
            for k in range(len(cached_hashes), -1, -1):
                parent = cached_hashes[k - 1] if k else None
                best: Snapshot | None = None
                for snap in self._by_parent.get(parent, ()):
                    n = snap.num_tokens
                    if not snap.ready or n > limit or (best is not None and n <= best.num_tokens):
                        continue
                    if tuple(token_ids[k * bs : n]) == snap.tail:
                        best = snap
                if best is not None:
                    best.pins += 1
                    self._lru.move_to_end(best)
                    return best
        return None

    def reserve(
        self, num_tokens: int, parent: int | None, tail: tuple[int, ...], tail_block: int | None
    ) -> Snapshot | None:
        """A row for a new snapshot of the state after ``num_tokens`` tokens, the prefix
        ``(parent, tail)``, pinned for the step that writes it and found by no lookup until
        ``complete``; it takes over the caller's reference on ``tail_block``. None (the
        reference dropped) when that prefix has a snapshot already or every row is pinned."""
        with self._lock:
            key = (parent, tail)
            row = None if key in self._by_key else self._take_row()
            if row is None:
                if tail_block is not None:
                    self._release_block(tail_block)
                return None
            return self._insert(Snapshot(row, num_tokens, parent, tail, tail_block, pins=1))

    def adopt(
        self, row: int, num_tokens: int, parent: int | None, tail: tuple[int, ...],
        tail_block: int | None,
    ) -> int | None:  # fmt: skip
        """Make ``row`` (a finished sequence's slot, holding the state after ``num_tokens``
        tokens) a ready snapshot without copying it, and hand back another row for the slot
        pool in exchange; None (nothing changed, the caller keeps its row and its reference on
        ``tail_block``) when that prefix has a snapshot already or every row is pinned."""
        with self._lock:
            key = (parent, tail)
            given = None if key in self._by_key else self._take_row()
            if given is None:
                return None
            snap = self._insert(Snapshot(row, num_tokens, parent, tail, tail_block, ready=True))
            self._lru[snap] = None
            return given

    def complete(self, snap: Snapshot, written: bool) -> None:
        """The step that wrote ``snap`` completed (``written``), or will never run, or its
        sequence ended before its blocks were published: then the snapshot goes."""
        with self._lock:
            snap.pins -= 1
            if written:
                snap.ready = True
                self._lru[snap] = None
            else:
                self._drop(snap)

    def demote(self, snap: Snapshot) -> None:
        """Make ``snap`` the first to go (a later snapshot of the same sequence supersedes it)."""
        with self._lock:
            if snap in self._lru:
                self._lru.move_to_end(snap, last=False)

    def unpin(self, snap: Snapshot) -> None:
        """The step that read ``snap`` completed or will never run."""
        with self._lock:
            snap.pins -= 1

    def freeable_blocks(self) -> int:
        """KV blocks that dropping unpinned snapshots would free: those only snapshots hold,
        none of them pinned."""
        with self._lock:
            return len(self._freeable())

    def free_blocks(self, wanted: int) -> int:
        """Drop snapshots, least recently used first, until ``wanted`` KV blocks are free or
        no more can be (sequences short of blocks come first); the blocks freed. Nothing is
        dropped when fewer than ``wanted`` can be freed: that would lose states for nothing."""
        with self._lock:
            freeable = self._freeable()
            if len(freeable) < wanted:
                return 0
            freed = 0
            for snap in list(self._lru):
                if freed == wanted:
                    break
                block = snap.tail_block
                if block is None or block not in freeable:
                    continue
                for holder in freeable.pop(block):
                    self._drop(holder)
                freed += 1
            return freed

    def _freeable(self) -> dict[int, list[Snapshot]]:
        """Per KV block only snapshots hold, all of them unpinned: those snapshots."""
        holders: dict[int, list[Snapshot]] = {}
        for snap in self._by_key.values():
            if snap.tail_block is not None:
                holders.setdefault(snap.tail_block, []).append(snap)
        return {
            block: snaps
            for block, snaps in holders.items()
            if self._ref_count(block) == len(snaps) and not any(s.pins for s in snaps)
        }

    def clear(self) -> None:
        """Drop every snapshot no step uses (their rows and tail blocks go back)."""
        with self._lock:
            for snap in [s for s in self._lru if s.pins == 0]:
                self._drop(snap)

    def _insert(self, snap: Snapshot) -> Snapshot:
        self._by_key[(snap.parent, snap.tail)] = snap
        self._by_parent.setdefault(snap.parent, []).append(snap)
        return snap

    def _take_row(self) -> int | None:
        if self._free:
            return self._free.popleft()
        victim = self._victim()
        if victim is None:
            return None
        self._drop(victim)
        return self._free.popleft()

    def _victim(self) -> Snapshot | None:
        """An unpinned ready snapshot: one whose KV blocks are gone, else the least recently
        used."""
        oldest = None
        for snap in self._lru:
            if snap.pins:
                continue
            if snap.parent is not None and not self._is_cached(snap.parent):
                return snap
            if oldest is None:
                oldest = snap
        return oldest

    def _drop(self, snap: Snapshot) -> None:
        del self._by_key[(snap.parent, snap.tail)]
        siblings = self._by_parent[snap.parent]
        siblings.remove(snap)
        if not siblings:
            del self._by_parent[snap.parent]
        self._lru.pop(snap, None)
        self._free.append(snap.row)
        if snap.tail_block is not None:
            self._release_block(snap.tail_block)
