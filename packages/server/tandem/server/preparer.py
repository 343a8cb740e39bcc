"""Where the slow, CPU-bound part of a request runs (parsing a large body, rendering a chat
template, tokenizing, decoding an echoed prompt), so that no request freezes another's
stream or /health.

Small requests are prepared on a few threads of the server (never the event loop). A
large body (``PROCESS_BODY_BYTES``) to /tokenize, /detokenize, /v1/completions or
/v1/chat/completions is parsed, checked, rendered and tokenized in a preparation process
instead (prepare_worker.py, which says what each step held on the server's own threads):
``PreparationMiddleware`` hands it the body's bytes and either sends the answer it gets back
(/tokenize, /detokenize, every error) or passes the request on with its messages or prompts
replaced by a stand-in and what was prepared in the request's scope (``PREPARED_SCOPE_KEY``).
Those processes run at a lower priority than the server, with a tokenizer of their own (the
engine's, whose lock its detokenizer takes every step, is never held by a large encode);
each gives its heap back after every job (``malloc_trim``), and one that still grew by a job
is replaced. The server itself never holds a large body or answer in its heap: the body
limits spill it into a mapping of its own, which goes to the process through its pipe as a
view, and a large answer comes back into another, sent to the client in pieces
(body_buffer.py; the server does not trim its heap: glibc's trim holds the arena locks every
thread allocates through, which stalled /health for a second in a measurement)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.server.body_buffer import SPILL_BYTES, Payload, Spilled, payload_pieces
from tandem.server.deadline import RequestTimedOut, before_deadline
from tandem.server.prepare_worker import (
    CHAT,
    COMPLETION,
    DETOKENIZE,
    TOKENIZE,
    Answer,
    Prepared,
    Reply,
    WorkerSpec,
    read_exactly,
    read_frame,
    write_frame,
    write_job,
)
from tandem.server.replayed_body import SPILLED_SCOPE_KEY, replayed_body

if TYPE_CHECKING:
    from tandem.server.state import ServerState

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Where a request's prepared prompt waits for chat.py: (RenderedPrompt, token ids).
PREPARED_SCOPE_KEY = "tandem.prepared"
# Bodies larger than this go to a preparation process (the body limits have spilled them
# out of the heap, body_buffer.py). Below it, the server's own threads are quick enough
# (2,000 chat messages validate and render in ~20 ms).
PROCESS_BODY_BYTES = SPILL_BYTES
# The routes whose large bodies are prepared in a process, and the job each one is.
_JOBS = {
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
}


_WORKER_MAIN = "import os; os.nice({nice}); from tandem.server.prepare_worker import main; main()"


class PreparationFailed(Exception):
    """A preparation process ended before it answered."""


class _Process:
    """One preparation process and the pipes to it; used by one thread at a time."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.process = subprocess.Popen(
            # Lower priority before the imports (seconds of CPU). Not ``-m``: its classes must
            # unpickle here as tandem.server.prepare_worker's.
            [sys.executable, "-c", _WORKER_MAIN.format(nice=spec.nice)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin = self.process.stdin
        self.stdout = self.process.stdout
        write_frame(self.stdin, spec)
        self.ready = False

    def call(self, job: str, raw: bytes | memoryview) -> tuple[Reply, Payload]:
        """The reply to ``job`` and, for an answer, its body (a large one in a mapping of
        its own, body_buffer.py)."""
        try:
            if not self.ready:
                if read_frame(self.stdout) != "ready":
                    raise PreparationFailed("a preparation process did not start")
                self.ready = True
            write_job(self.stdin, job, raw)
            reply = read_frame(self.stdout)
            body: Payload = b""
            if isinstance(reply, Answer):
                size = reply.body_size
                if size > SPILL_BYTES:
                    body = Spilled.read_from(self.stdout, size)
                else:
                    body = read_exactly(self.stdout, size)
        except Exception as exc:  # noqa: BLE001 - the process is replaced whatever went wrong
            raise PreparationFailed(f"a preparation process failed ({exc!r})") from None
        if not isinstance(reply, Answer | Prepared):
            raise PreparationFailed(f"a preparation process answered {type(reply).__name__}")
        return reply, body

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.stdin.close()
        try:
            self.process.wait(2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class PreparationProcesses:
    """``count`` preparation processes; ``call`` hands one of them a job (on a thread of
    its own: the pipes' reads and writes wait without the GIL)."""

    def __init__(self, spec: WorkerSpec, count: int) -> None:
        self._spec = spec
        self._count = count
        # Started lazily, by the first large bodies: a server that never gets one never pays
        # for the processes (a tokenizer each, ~270 MiB).
        self._started = 0
        self._idle: queue.SimpleQueue[_Process] = queue.SimpleQueue()
        self._all: set[_Process] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.threads = ThreadPoolExecutor(max_workers=count, thread_name_prefix="tandem-prep-io")

    def _take(self) -> _Process:
        """An idle process, or a new one while fewer than ``count`` run."""
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if self._closed:
                    raise PreparationFailed("the server is shutting down")
                start = self._started < self._count
                if start:
                    self._started += 1
            if start:
                try:
                    return self._start()
                except OSError as exc:
                    with self._lock:
                        self._started -= 1
                    raise PreparationFailed(f"a preparation process did not start: {exc}") from None
            # Wait for one to come back; a retired one frees its place for a new start.
            try:
                return self._idle.get(timeout=0.2)
            except queue.Empty:
                continue

    def _start(self) -> _Process:
        process = _Process(self._spec)
        with self._lock:
            self._all.add(process)
        return process

    def _retire(self, process: _Process) -> None:
        with self._lock:
            self._all.discard(process)
            self._started -= 1
        process.close()

    def call(self, job: str, raw: bytes | memoryview) -> tuple[Reply, Payload]:
        process = self._take()
        try:
            reply, body = process.call(job, raw)
        except PreparationFailed:
            self._retire(process)
            raise
        if reply.retire:
            logger.info("a preparation process grew by a %d-byte %s job; retiring it",
                        len(raw), job)  # fmt: skip
            self._retire(process)
        elif self._closed:
            self._retire(process)
        else:
            self._idle.put(process)
        return reply, body

    def close(self) -> None:
        self._closed = True
        self.threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            everyone = list(self._all)
            self._all.clear()
        for process in everyone:
            process.close()


class RequestPreparer:
    def __init__(self, threads: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tandem-prepare")
        self.processes: PreparationProcesses | None = None
        self._running = 0
        self._running_lock = threading.Lock()

    @property
    def jobs_running(self) -> int:
        """Jobs started on the threads or in the processes and not yet ended, those of
        requests that timed out or went away included: they still hold CPU and memory, which
        an operator (or a measurement of memory given back) must be able to see."""
        return self._running

    async def _on(self, pool: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
        """``fn()`` on one of ``pool``'s threads, counted while it runs, waited for until the
        request's deadline (a job still queued when it passes never runs)."""

        def counted() -> T:
            with self._running_lock:
                self._running += 1
            try:
                return fn()
            finally:
                with self._running_lock:
                    self._running -= 1

        return await before_deadline(asyncio.get_running_loop().run_in_executor(pool, counted))

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on one of the threads. A caller that goes away, or whose request's
        deadline passes (RequestTimedOut), stops waiting, and ``fn`` never runs if it had
        not started; once started it runs to its end (each job is bounded: by the input
        size limits, and templates by their time limit)."""
        return await self._on(self._pool, fn)

    def start_processes(self, spec: WorkerSpec, count: int) -> None:
        """Prepare large bodies in up to ``count`` processes from now on (--prepare-processes;
        0: everything in the server). Each starts with the first job that finds none idle,
        and that job waits for it to load the tokenizer."""
        if count > 0 and self.processes is None:
            self.processes = PreparationProcesses(spec, count)

    async def run_in_process(self, job: str, body: Spilled) -> tuple[Reply, Payload]:
        assert self.processes is not None
        processes = self.processes

        def call() -> tuple[Reply, Payload]:
            # The view goes with the call: the mapping outlives a request that timed out
            # while its body was still being written to the pipe.
            with body.view() as raw:
                return processes.call(job, raw)

        return await self._on(processes.threads, call)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.close()
            self.processes = None


def worker_spec(state: ServerState) -> WorkerSpec:
    engine = state.engine
    return WorkerSpec(
        tokenizer_folder=str(engine.config.model.model),
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        served_model_name=state.served_model_name,
        model_aliases=state.model_aliases,
        chat=state.chat,
        limits=state.limits,
    )


class PreparationMiddleware:
    """Large bodies to the routes of ``_JOBS`` are prepared in a preparation process (see
    the module's text); everything else passes through. Runs inside the body-size limit,
    which has read the body already."""

    def __init__(self, app: ASGIApp, preparer: RequestPreparer) -> None:
        self.app = app
        self.preparer = preparer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job = _JOBS.get(str(scope.get("path", "")))
        spilled = scope.get(SPILLED_SCOPE_KEY)
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or job is None
            or self.preparer.processes is None
            or not isinstance(spilled, Spilled)
        ):
            await self.app(scope, receive, send)
            return
        await self._prepare(job, spilled, scope, receive, send)

    async def _prepare(
        self, job: str, body: Spilled, scope: Scope, receive: Receive, send: Send
    ) -> None:
        from tandem.server.errors import error_response

        try:
            reply, answer = await self.preparer.run_in_process(job, body)
        except RequestTimedOut as exc:
            await error_response(504, str(exc), code="timeout")(scope, receive, send)
            return
        except PreparationFailed as exc:
            logger.error("preparing a request failed: %s", exc)
            await error_response(500, "Internal server error: the request's preparation "
                                 "process ended")(scope, receive, send)  # fmt: skip
            return
        if isinstance(reply, Answer):
            try:
                await _send_json(send, reply.status, answer)
            finally:
                if isinstance(answer, Spilled):
                    answer.close()
            return
        headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-length"]
        headers.append((b"content-length", str(len(reply.body)).encode()))
        inner = {k: v for k, v in scope.items() if k != SPILLED_SCOPE_KEY}
        inner.update({"headers": headers, PREPARED_SCOPE_KEY: reply.value})
        await self.app(inner, replayed_body(reply.body, receive), send)


async def _send_json(send: Send, status: int, body: Payload) -> None:
    """The answer, a large one in pieces: the connection's write buffer, not the heap,
    holds the rest, and the event loop never copies megabytes at once."""
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    for piece in payload_pieces(body):
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
