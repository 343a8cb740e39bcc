"""The fixed-steps scheduler of generative recommendation.

Every request needs exactly one prefill and ``max_decode_rounds`` decode rounds, so its whole
KV footprint is known when it arrives: the blocks are reserved up front, at admission, and
held until its last round. Requests are grouped into batches (up to ``max_batch_size``); up to
``max_concurrency`` batches are in flight at once, each on a pipeline lane of its own, and no
more than ``capacity.running`` requests in all (``--max-num-seqs``).

When blocks run out, new work waits for in-flight batches to give theirs back; it never fails
for that. A request that could never fit (more blocks than the whole pool) fails at once.
Admission is first come, first served: a large request at the head is not overtaken by smaller
ones behind it, so none starves.

With ``--max-waiting-requests``, a request is refused (EngineOverloadedError) once the running
and the waiting places are full, counted here under the scheduler's lock, where requests are
added, admitted and finished.

Thread-safe: requests arrive from the server's threads while the engine loop schedules and
completes batches.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from tandem.core.admission import EngineCapacity
from tandem.core.config import EngineConfig
from tandem.core.errors import InvalidRequestError
from tandem.core.kv.block_manager import BlockManager
from tandem.core.rec.request import RecRequest
from tandem.device.sync import REAL_SYNC, Sync


def rec_capacity(config: EngineConfig) -> EngineCapacity:
    """Requests a recommender runs at once: a batch of ``--rec-max-batch-size`` on each of
    ``--max-concurrency`` lanes, and no more than ``--max-num-seqs`` in all; with the
    ``--max-waiting-requests`` that may wait beside them."""
    seqs = config.scheduler.max_seqs_per_batch
    lanes, size = config.pipeline.max_concurrency, config.rec.max_batch_size
    if seqs <= lanes * size:
        running, why = seqs, f"--max-num-seqs {seqs}"
    else:
        running = lanes * size
        why = f"--max-concurrency {lanes} batches of --rec-max-batch-size {size}"
    return EngineCapacity(running, why, config.scheduler.max_waiting_requests)


@dataclass(eq=False)
class RecBatch:
    batch_id: int
    lane: int
    requests: list[RecRequest]
    # The round in flight (0 = prefill).
    round: int = 0


class FixedStepsScheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_batch_size: int,
        max_concurrency: int,
        max_decode_rounds: int,
        sync: Sync = REAL_SYNC,
        capacity: EngineCapacity | None = None,
    ) -> None:
        """``capacity``: requests in flight at most, and that may wait (None: every lane's
        batch full, and no bound on the waiting)."""
        self.blocks = blocks
        self.capacity = capacity or EngineCapacity(
            max_concurrency * max_batch_size, "every lane's batch full"
        )
        self.max_batch_size = max_batch_size
        self.max_concurrency = max_concurrency
        self.max_decode_rounds = max_decode_rounds
        self._lock = sync.lock()
        self._waiting: deque[RecRequest] = deque()
        self._in_flight: dict[int, RecBatch] = {}
        # Requests in the in-flight batches (what capacity.running bounds).
        self._running = 0
        self._free_lanes = list(range(max_concurrency))
        self._ids = itertools.count()

    def blocks_needed(self, request: RecRequest) -> int:
        return self.blocks.blocks_for(request.history_len)

    def add(self, *requests: RecRequest) -> None:
        """Queue ``requests`` together (next to each other in the queue, so they batch the
        same way whatever else is running); raises InvalidRequestError, queueing none, if one
        could never fit, and EngineOverloadedError if the running and waiting places are
        full."""
        for request in requests:
            needed = self.blocks_needed(request)
            if needed > self.blocks.num_blocks:
                raise InvalidRequestError(
                    f"the history needs {needed} KV blocks and the cache has "
                    f"{self.blocks.num_blocks} in all; send a shorter history or start the "
                    "server with more --num-blocks",
                    "history",
                )
        with self._lock:
            self.capacity.admit(self._running + len(self._waiting))
            self._waiting.extend(requests)

    def next_batch(self) -> RecBatch | None:
        """The next batch to put in flight, its blocks reserved; None when no lane is free,
        nothing waits, or the head of the queue must wait for blocks."""
        with self._lock:
            if not self._free_lanes or not self._waiting:
                return None
            # A batch smaller than --rec-max-batch-size when --max-num-seqs leaves less room.
            size = min(self.max_batch_size, self.capacity.running - self._running)
            requests: list[RecRequest] = []
            while self._waiting and len(requests) < size:
                head = self._waiting[0]
                reserved = self.blocks.reserve(self.blocks_needed(head))
                if reserved is None:
                    break
                head.blocks = reserved
                requests.append(self._waiting.popleft())
            if not requests:
                return None
            batch = RecBatch(next(self._ids), self._free_lanes.pop(0), requests)
            self._in_flight[batch.batch_id] = batch
            self._running += len(requests)
            return batch

    def stuck(self) -> bool:
        """Whether the head of the queue can never be admitted: nothing in flight will give
        blocks back, and the free ones are too few for it (every request fits the whole pool,
        so only blocks that leaked make this true)."""
        with self._lock:
            if self._in_flight or not self._waiting:
                return False
            return self.blocks_needed(self._waiting[0]) > self.blocks.num_free_blocks

    def finish(self, batch: RecBatch) -> None:
        """The batch is done (or failed): its blocks and its lane are free again."""
        with self._lock:
            del self._in_flight[batch.batch_id]
            self._running -= len(batch.requests)
            for request in batch.requests:
                self.blocks.release(request.blocks)
                request.blocks = []
            self._free_lanes.append(batch.lane)
            self._free_lanes.sort()

    def remove_waiting(self) -> list[RecRequest]:
        """Take every waiting request out (the engine is stopping)."""
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
            return waiting

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests in the in-flight batches."""
        with self._lock:
            return self._running

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)
