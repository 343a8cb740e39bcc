"""Drive an LLMEngine from one background thread, for callers on other threads or asyncio.

Requests are validated on the caller's thread (so errors come back at once), then queued;
the loop thread adds them, steps while there is work, and hands each output to the
request's callback. ``AsyncEngine`` wraps this in an async iterator per request; leaving
the iterator early aborts the request so its KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from tandem.core.admission import EngineCapacity
from tandem.core.errors import EngineDeadError
from tandem.core.llm.engine import LLMEngine
from tandem.core.llm.input_processor import Prompt
from tandem.core.llm.outputs import RequestOutput
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.sequence import TokenSequence
from tandem.device.sync import REAL_SYNC, Sync

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass
class _Add:
    seq: TokenSequence
    callback: OutputCallback


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    reason: str


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_finished: OutputCallback | None = None,
        sync: Sync = REAL_SYNC,
    ) -> None:
        """``on_finished`` sees every finished output (aborts and errors included), on the
        loop thread, whether or not anyone still reads the request's stream."""
        self.engine = engine
        self._on_finished = on_finished
        self._commands: deque[_Add | _Abort | _AbortAll] = deque()
        # Sequences admitted and not yet finished: queued here, waiting or running in the
        # engine. Counted here, under the lock, because the engine's stats lag a step behind
        # and a burst arrives between two steps.
        self._admitted = 0
        scheduler = engine.config.scheduler
        self._capacity = EngineCapacity(
            running=scheduler.max_seqs_per_batch,
            running_why=f"--max-num-seqs {scheduler.max_seqs_per_batch}",
            waiting=scheduler.max_waiting_requests,
        )
        self._callbacks: dict[str, OutputCallback] = {}
        self._wake = sync.condition()
        self._stopping = False
        # Set by abort_all (the server is shutting down): why new requests are refused.
        self._refusing: str | None = None
        self._thread = sync.start_thread(self._run, "tandem-engine-loop")

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.engine.dead is None

    def check_health(self) -> None:
        """Raise EngineDeadError once the loop or the engine is gone (a worker that died
        between requests shows here too)."""
        if not self._thread.is_alive():
            raise EngineDeadError(
                f"the engine loop is not running: {self.engine.dead or 'stopped'}"
            )
        self.engine.check_health()

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        callback: OutputCallback,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises InvalidRequestError / EngineDeadError /
        EngineOverloadedError on the caller's thread."""
        self._check_accepting()
        seq = self.engine.inputs.prepare(request_id, prompt, params)
        self.enqueue(seq, callback)
        return seq.request_id

    def enqueue(self, seq: TokenSequence, callback: OutputCallback) -> None:
        """Queue a request made by ``engine.inputs.prepare`` (on any thread)."""
        self.enqueue_together([(seq, callback)])

    def enqueue_together(self, requests: list[tuple[TokenSequence, OutputCallback]]) -> None:
        """Queue requests all or none (the choices of one API request). With
        ``--max-waiting-requests``, admitted while fewer sequences than ``--max-num-seqs``
        (they can run) plus ``--max-waiting-requests`` (they may wait) are in the engine,
        queued, waiting or running; refused together (EngineOverloadedError) beyond, so a
        request with more choices than the bound still gets in when the engine is short."""
        with self._wake:
            self._check_accepting()
            self._capacity.admit(self._admitted)
            for seq, callback in requests:
                self._commands.append(_Add(seq, callback))
            self._admitted += len(requests)
            self._wake.notify()

    def _release(self) -> None:
        """One admitted sequence finished (or never got into the engine)."""
        with self._wake:
            self._admitted -= 1

    def _check_accepting(self) -> None:
        if self._refusing is not None:
            raise EngineDeadError(self._refusing)
        if not self.is_alive:
            raise EngineDeadError(self.engine.dead or "the engine loop has stopped")

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._commands.append(_Abort(request_id))
            self._wake.notify()

    def abort_all(self, reason: str) -> None:
        """Finish every request now (finish reason "abort", error ``reason``) and refuse new
        ones: the server is shutting down, and each client gets its answer before the
        connections drain."""
        with self._wake:
            self._refusing = reason
            self._commands.append(_AbortAll(reason))
            self._wake.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        self.engine.shutdown()

    def _drain_commands(self) -> None:
        while True:
            with self._wake:
                if not self._commands:
                    return
                command = self._commands.popleft()
            if isinstance(command, _Add):
                try:
                    self.engine.add_sequence(command.seq)
                    self._callbacks[command.seq.request_id] = command.callback
                except Exception as exc:  # noqa: BLE001 - reported to the request
                    self._release()
                    command.callback(_error_output(command.seq, str(exc)))
            elif isinstance(command, _Abort):
                out = self.engine.abort(command.request_id)
                if out is not None:
                    self._deliver(out)
            else:
                for request_id in list(self._callbacks):
                    out = self.engine.abort(request_id)
                    if out is not None:
                        out.error = command.reason
                        self._deliver(out)

    def _wait_while_idle(self) -> None:
        """The engine has requests but nothing it can do: block until a command arrives (an
        abort or a new request changes what can run) instead of spinning, and past the stall
        timeout let the watchdog fail what is stuck."""
        limit = self.engine.config.scheduler.stall_timeout_s
        stalled = self.engine.watch.stalled_for()
        if stalled >= limit:
            for out in self.engine.fail_stalled():
                self._deliver(out)
            return
        with self._wake:
            if not self._commands and not self._stopping:
                self._wake.wait(limit - stalled)

    def _deliver(self, out: RequestOutput) -> None:
        callback = self._callbacks.get(out.request_id)
        if out.finished and self._callbacks.pop(out.request_id, None) is not None:
            self._release()
        if out.finished and self._on_finished is not None:
            try:
                self._on_finished(out)
            except Exception:
                logger.exception("on_finished hook failed for %s", out.request_id)
        if callback is not None:
            try:
                callback(out)
            except Exception:
                logger.exception("output callback of %s failed", out.request_id)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while (
                        not self._stopping
                        and not self._commands
                        and not (self.engine.has_unfinished() and self.engine.dead is None)
                    ):
                        self._wake.wait()
                    if self._stopping:
                        break
                self._drain_commands()
                for out in self.engine.step():
                    self._deliver(out)
                if self.engine.idle and self.engine.has_unfinished():
                    self._wait_while_idle()
        except BaseException as exc:
            logger.exception("engine loop crashed")
            self.engine.dead = f"engine loop crashed: {exc}"
        finally:
            for request_id in list(self._callbacks):
                aborted = self.engine.abort(request_id)
                if aborted is not None:
                    if self.engine.dead is not None:
                        aborted.finish_reason, aborted.error = "error", self.engine.dead
                    self._deliver(aborted)


def _error_output(seq: TokenSequence, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=[],
        text="",
        new_token_ids=[],
        delta_text="",
        finished=True,
        finish_reason="error",
        error=message,
    )


class RequestStream:
    """The outputs of one submitted request, as an async iterator; ``close()`` aborts it if
    it has not finished, so an abandoned request gives its KV blocks back."""

    def __init__(self, loop: EngineLoop, request_id: str, queue: asyncio.Queue[RequestOutput]):
        self.loop = loop
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._queue.get()
        self.finished = out.finished
        return out

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.loop.abort(self.request_id)


class _Mailbox:
    """Outputs crossing from the engine thread into one event loop. A step hands over an
    output per running request; waking the event loop once per output (a write to its
    self-pipe, a callback, and the GIL bounced between the threads each time) cost a
    millisecond or two per step at 48 streams, so outputs queue here and one callback
    delivers all that arrived before it runs."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = []

    def post(self, queue: asyncio.Queue[RequestOutput], out: RequestOutput) -> None:
        with self._lock:
            self._items.append((queue, out))
            first = len(self._items) == 1
        if first:
            # Raises RuntimeError once the event loop is closed, as a direct callback would.
            self._aio.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, out in items:
            queue.put_nowait(out)


class AsyncEngine:
    """asyncio face of an EngineLoop: one async stream of outputs per request."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine

    def submit(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request now (errors raise here); call from the running event loop. It
        tokenizes on the calling thread: servers prepare requests elsewhere and ``enqueue``."""
        return self.enqueue(self.engine.inputs.prepare(request_id, prompt, params))

    def enqueue(self, seq: TokenSequence) -> RequestStream:
        """Queue a request made by ``engine.inputs.prepare``; call from the running event
        loop (errors raise here)."""
        return self.enqueue_together([seq])[0]

    def enqueue_together(self, seqs: list[TokenSequence]) -> list[RequestStream]:
        """Queue requests all or none (``EngineLoop.enqueue_together``)."""
        aio = asyncio.get_running_loop()
        mailbox = self._mailboxes.get(aio)
        if mailbox is None:
            mailbox = self._mailboxes[aio] = _Mailbox(aio)
        streams: list[RequestStream] = []
        requests: list[tuple[TokenSequence, OutputCallback]] = []
        for seq in seqs:
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

            def on_output(out: RequestOutput, queue: asyncio.Queue[RequestOutput] = queue) -> None:
                mailbox.post(queue, out)

            requests.append((seq, on_output))
            streams.append(RequestStream(self.loop, seq.request_id, queue))
        self.loop.enqueue_together(requests)
        return streams

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        stream = self.submit(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()
