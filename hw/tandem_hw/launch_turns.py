"""One collective launch at a time on a set of devices, in one order on all of them.

CANN's ``HcclCommInitAll`` reference (constraints): "One device cannot call multiple collective
operation APIs at a time." With ``--max-concurrency N`` every pipeline lane has a communicator
set of its own over the same devices, and each lane's rank threads launch on their own, so two
lanes could be inside ``HcclAllReduce`` on one card at once.

A lock per device is not enough. HCCL's first call on a communicator blocks until its peers
have called too (links are set up then; the same reference bounds the gap between ranks by
``HCCL_CONNECT_TIMEOUT``), and so does every call of the CPU stand-in: lane A holding card 0
while lane B holds card 1, each waiting inside a call for its peer on the other card, never
ends. So a turn belongs to one collective of one communicator set (its sequence number, equal
on every rank by concurrency rule 2): the set's ranks enter it on every device, and the other
sets wait until all of them have left the call. Every device sees the sets' collectives in the
same order. NCCL asks the same of communicators used concurrently (their operations must be
issued in one order on every device), so NCCL communicator sets take turns too.

A turn covers the host call only: on a card the call enqueues and returns, so turns cost a
hand-over between host threads per collective, not device time.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from tandem.collectives import CollectiveAborted, CollectiveTimeout

logger = logging.getLogger(__name__)

_owners = itertools.count(1)


def new_owner() -> int:
    """An id for a communicator set that takes turns."""
    return next(_owners)


class LaunchTurns:
    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        self._nranks = len(self.devices)
        self._cond = threading.Condition()
        # (owner, sequence) of the collective whose ranks may call now, and how many of them
        # have left the call.
        self._holder: tuple[int, int] | None = None
        self._left = 0

    @property
    def holder(self) -> tuple[int, int] | None:
        with self._cond:
            return self._holder

    @contextmanager
    def turn(
        self, owner: int, sequence: int, aborted: Callable[[], str | None], timeout_s: float
    ) -> Iterator[None]:
        """Held around one rank's library call of collective ``sequence`` of set ``owner``."""
        key = (owner, sequence)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                # Checked under the lock: an abort releases the turn and then no rank of the
                # aborted set may claim a new one.
                reason = aborted()
                if reason is not None:
                    raise CollectiveAborted(reason)
                if self._holder is None:
                    self._holder, self._left = key, 0
                    break
                if self._holder == key:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CollectiveTimeout(
                        f"waited {timeout_s} s to launch a collective on "
                        f"{','.join(self.devices)}: collective {self._holder[1]} of communicator "
                        f"set {self._holder[0]} still has ranks that have not called it"
                    )
                self._cond.wait(min(remaining, 1.0))
        try:
            yield
        finally:
            with self._cond:
                # A turn released by an abort may already belong to someone else.
                if self._holder == key:
                    self._left += 1
                    if self._left == self._nranks:
                        self._holder = None
                        self._cond.notify_all()

    def release(self, owner: int) -> None:
        """Give up ``owner``'s turn (its set is aborted or closed), so the others go on."""
        with self._cond:
            if self._holder is not None and self._holder[0] == owner:
                logger.warning(
                    "releasing collective %d of communicator set %d on %s before all its ranks "
                    "called it",
                    self._holder[1],
                    owner,
                    ",".join(self.devices),
                )
                self._holder = None
            self._cond.notify_all()


_shared: dict[tuple[str, ...], LaunchTurns] = {}
_shared_lock = threading.Lock()


def shared_turns(devices: Sequence[str]) -> LaunchTurns:
    """The turns every communicator set of this process over ``devices`` takes (the pipeline
    lanes' sets of one engine span the same devices). Sets over different device lists do not
    take turns with each other; the engine makes none that overlap."""
    key = tuple(sorted(devices))
    with _shared_lock:
        turns = _shared.get(key)
        if turns is None:
            turns = LaunchTurns(key)
            _shared[key] = turns
        return turns
