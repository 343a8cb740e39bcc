"""Hostile clients against a live server: does one client's request freeze another's stream,
keep memory it took, or get work done without the key? Every attack class of issue 35.

Starts ``tandem serve`` with ``--api-key`` on a Qwen3-shaped demo model whose context is
long enough that huge prompts pass the length bound (or on ``--model``), then, for each
attack class, runs one streamed chat completion and probes ``/health`` while a few clients
send the attack at once. Per class it prints the stream's largest gap between two tokens (a
stream that starts during the attack counts its wait for the first token as a gap) and the
same at rest before the attack, the largest ``/health`` latency, the attack requests'
statuses and their wall time, what the class adds (``notes``), and the RSS of the server
(its own, and with its child processes) before the attack and after it settled.

Most classes run against one server; the request-timeout class against one started with
``--request-timeout-s 3``, the connection class against one whose open-file limit is 64
(with ``--request-header-timeout-s 2`` where the server has that flag). Only the HTTP API
and flags that older servers have are required, so ``--repo`` can point the server at
another checkout (the benchmark's own code still writes the model and runs the clients):

    python benchmarks/hostile_clients.py                      # CI sizes, a few seconds per class
    python benchmarks/hostile_clients.py --full               # the sizes of issue 35
    python benchmarks/hostile_clients.py --full --repo /tmp/old   # the same against old code

A benchmark prints figures; integration/test_hostile_clients.py runs the CI sizes and checks
the bounds. To add an attack class, add an ``Attack`` to ``attacks()``: a name, a request
(method, path, JSON body) and how many clients send it at once, or a ``custom`` function
that runs the class and returns its statuses and notes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import multiprocessing
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tandem.server.bench.ports import free_port, listens_on

MODEL_NAME = "tandem-demo"
# Long enough that a 6 MB prompt passes the server's byte bound (4 bytes per position and
# per byte of the longest token), so the attack reaches the tokenizer.
MAX_POSITIONS = 131_072
API_KEY = "hostile-benchmark-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
# The defaults of the servers' budgets (--max-tokenize-tokens: the larger of 131,072 and
# the context; --max-chat-messages): the largest requests they admit.
TOKENIZE_TOKENS = 131_072
CHAT_MESSAGES = 10_000
# The servers' preparation processes (--prepare-processes, its default).
PREPARE_PROCESSES = 2
# The request-timeout class's server (the issue's --request-timeout-s 3).
REQUEST_TIMEOUT_S = 3.0
# The connection class's server: the open-file limit, and its timeouts.
NOFILE = 64
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
# Six regexes that compile in milliseconds but need more lexer work per token than the
# grammar engine allows ("too many expressions constructed"), each different so that no
# cache answers for another.
UNBUILDABLE_REGEXES = tuple(
    f"([{chars}]{{1,5}}){{300,1000}}" for chars in ("a-z", "a-y", "b-z", "a-x", "c-z", "a-w")
)


@dataclass(frozen=True)
class Sizes:
    prompt_bytes: int
    messages: int
    clients: int
    # many-sequences: prompts x n in one completion request.
    prompts: int = 20_000
    n: int = 16
    # detokenize-many-ids.
    detokenize_ids: int = TOKENIZE_TOKENS
    # idle-and-slow-connections: connections that send nothing, and how long a client
    # trickling its headers or body keeps at it before the benchmark gives up.
    idle_connections: int = 60
    trickle_s: float = 30.0
    # tokenize-largest-prompt: this fraction of the largest prompt the token budget admits.
    largest_fraction: float = 1.0
    # tokenize-most-messages: messages whose prompt fits the token budget (9,000 of the
    # demo's: 126,000 tokens; 10,000, the message budget, make 140,000).
    most_messages: int = 9_000


# CI: small enough to run in a minute or two on a loaded 2-core box, large enough that
# every body goes to a preparation process and every prompt past the budget is tokenized.
CI_SIZES = Sizes(
    prompt_bytes=250_000,
    messages=15_000,
    clients=4,
    detokenize_ids=50_000,
    trickle_s=8.0,
    largest_fraction=0.5,
    most_messages=3_000,
)
FULL_SIZES = Sizes(prompt_bytes=6_000_000, messages=150_000, clients=4)


@dataclass(frozen=True)
class Attack:
    name: str
    method: str
    path: str
    # Built once, sent by every client: the JSON body's bytes.
    body: Callable[[], bytes]
    clients: int
    # Seconds each request may take before the client gives up (its status is then "timeout").
    timeout_s: float = 300.0
    # Whether the attack's requests carry the API key.
    key: bool = True
    # The server it runs against (``SERVERS``).
    server: str = "main"
    # Runs the class instead of ``clients`` senders of ``body``: its statuses and notes.
    # (base URL, sizes, the sender processes when there are some)
    custom: Callable[[str, Sizes, ProcessPoolExecutor | None], tuple[list[str], str]] | None = None


def _text(size: int) -> str:
    words = "the quick brown fox jumps over the lazy dog 123 "
    return (words * (size // len(words) + 1))[:size]


def _messages(count: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "hello there friend"} for _ in range(count)]


def _largest_prompt(tokenizer_folder: Path | None) -> int:
    """The size of the longest ``_text`` the default --max-tokenize-tokens admits (3% under
    it), measured with the model's tokenizer; a rough figure without one."""
    sample = _text(200_000)
    if tokenizer_folder is None:
        return int(TOKENIZE_TOKENS * 1.4)
    from tandem.core.llm.tokenizer import Tokenizer

    count = len(Tokenizer(tokenizer_folder).encode(sample))
    return int(0.97 * TOKENIZE_TOKENS * len(sample) / count)


def attacks(sizes: Sizes, tokenizer_folder: Path | None = None) -> list[Attack]:
    """Every attack class, at ``sizes``."""

    def dumps(body: dict[str, Any]) -> Callable[[], bytes]:
        return lambda: json.dumps(body).encode()

    def huge_prompt() -> bytes:
        return json.dumps({"model": MODEL_NAME, "prompt": _text(sizes.prompt_bytes)}).encode()

    def largest_prompt() -> bytes:
        text = _text(int(sizes.largest_fraction * _largest_prompt(tokenizer_folder)))
        return json.dumps({"model": MODEL_NAME, "prompt": text}).encode()

    def deep_schema() -> bytes:
        schema: dict[str, Any] = {"type": "integer"}
        for _ in range(400):
            schema = {"allOf": [schema]}
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 8, "guided_json": schema}
        return json.dumps(body).encode()

    n = sizes.clients
    return [
        # 1. Tokenizer: a prompt that passes the byte bound, without the key, then with it;
        # and the largest one the default token budget admits.
        Attack("tokenize-huge-prompt-no-key", "POST", "/tokenize", huge_prompt, n, key=False),
        Attack("tokenize-largest-prompt", "POST", "/tokenize", largest_prompt, n),
        Attack("tokenize-huge-prompt", "POST", "/tokenize", huge_prompt, n),
        Attack(
            "completions-huge-prompt",
            "POST",
            "/v1/completions",
            lambda: json.dumps(
                {"model": MODEL_NAME, "prompt": _text(sizes.prompt_bytes), "max_tokens": 4}
            ).encode(),
            n,
        ),
        Attack(
            "detokenize-many-ids",
            "POST",
            "/detokenize",
            dumps(
                {"model": MODEL_NAME, "tokens": [1 + i % 200 for i in range(sizes.detokenize_ids)]}
            ),
            n,
        ),
        # 2. Chat templates: more messages than the budget, and the most it admits.
        Attack(
            "tokenize-many-messages",
            "POST",
            "/tokenize",
            dumps({"model": MODEL_NAME, "messages": _messages(sizes.messages)}),
            n,
        ),
        Attack(
            "tokenize-most-messages",
            "POST",
            "/tokenize",
            dumps({"model": MODEL_NAME, "messages": _messages(sizes.most_messages)}),
            n,
        ),
        Attack(
            "chat-many-messages",
            "POST",
            "/v1/chat/completions",
            dumps({"model": MODEL_NAME, "messages": _messages(sizes.messages), "max_tokens": 4}),
            n,
        ),
        # 3. Body parsing.
        Attack(
            "unknown-model-huge-body",
            "POST",
            "/v1/chat/completions",
            dumps({"model": "no-such-model", "messages": _messages(sizes.messages)}),
            n,
        ),
        # 4. Grammar compiles: six different regexes the lexer cannot serve, at once.
        Attack(
            "grammar-unbuildable-regex",
            "POST",
            "/v1/completions",
            lambda: b"",
            len(UNBUILDABLE_REGEXES),
            custom=_unbuildable_regexes,
        ),
        # 5. A JSON schema of 400 nested allOf.
        Attack("deep-schema", "POST", "/v1/completions", deep_schema, n),
        # 7. One completion request for prompts x n sequences.
        Attack(
            "many-sequences",
            "POST",
            "/v1/completions",
            dumps(
                {
                    "model": MODEL_NAME,
                    "prompt": ["a"] * sizes.prompts,
                    "n": sizes.n,
                    "max_tokens": 16,
                    "temperature": 1.0,
                }
            ),
            1,
        ),
        # 6. --request-timeout-s 3: a short request behind heavy preparation.
        Attack(
            "request-timeout",
            "POST",
            "/tokenize",
            lambda: _heavy_bodies(sizes.messages)[1],
            n,
            server="timeout",
            custom=_short_behind_heavy,
        ),
        # 8. Idle connections with the open-file limit at 64; trickled headers and body.
        Attack(
            "idle-and-slow-connections",
            "GET",
            "/health",
            lambda: b"",
            sizes.idle_connections,
            server="connections",
            custom=_idle_and_slow_connections,
        ),
    ]


def _unbuildable_regexes(
    base: str, sizes: Sizes, senders: ProcessPoolExecutor | None
) -> tuple[list[str], str]:
    """Six different unbuildable regexes at once, then the first again (answered from the
    grammar cache on the old code, which then said 200 where it had said 500)."""
    statuses: list[str] = []
    started = time.perf_counter()
    walls: list[float] = []

    def one(regex: str) -> None:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 300,
                "structured_outputs": {"regex": regex}}  # fmt: skip
        begin = time.perf_counter()
        statuses.append(send_json(base, "/v1/completions", body))
        walls.append(time.perf_counter() - begin)

    threads = [threading.Thread(target=one, args=(r,)) for r in UNBUILDABLE_REGEXES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = send_json(
        base, "/v1/completions",
        {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 300,
         "structured_outputs": {"regex": UNBUILDABLE_REGEXES[0]}},
    )  # fmt: skip
    note = (
        f"answers after {min(walls):.1f}-{max(walls):.1f} s; the first again: {again}; "
        f"all in {time.perf_counter() - started:.1f} s"
    )
    return statuses, note


@functools.cache
def _heavy_bodies(messages: int) -> tuple[bytes, bytes]:
    """The request-timeout class's two bodies, made before its measurement starts (by the
    attack's ``body``): JSON-encoding megabytes here holds this process's GIL, which the
    probes' threads would wait for and count as the server's stall."""
    return tuple(  # type: ignore[return-value]
        json.dumps({"model": MODEL_NAME, "messages": _messages(count)}).encode()
        for count in (messages, CHAT_MESSAGES)
    )


def _short_behind_heavy(
    base: str, sizes: Sizes, senders: ProcessPoolExecutor | None
) -> tuple[list[str], str]:
    """Heavy preparation from ``sizes.clients`` clients (half send ``sizes.messages`` chat
    messages, the issue's case, which the old code rendered up to the template's time
    limit; half the most messages the budget admits, rendered and tokenized), and 0.5 s
    later a short chat request: when is it answered? The issue's old code: 504 after
    11.6 s for a 3 s limit."""
    statuses: list[str] = []
    bodies = _heavy_bodies(sizes.messages)
    heavy: list[Future[tuple[str, float]]] = []
    if senders is not None:
        # From processes of their own, as the plain attacks send (run_attack says why).
        heavy = [
            senders.submit(_send_from_pool, base, "POST", "/tokenize", bodies[i % 2], 300.0, True)
            for i in range(sizes.clients)
        ]

    def one(i: int) -> None:
        statuses.append(_send(base, "POST", "/tokenize", bodies[i % 2], 300.0, key=True))

    clients = 0 if senders is not None else sizes.clients
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    short = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 4}  # fmt: skip
    begin = time.perf_counter()
    status = send_json(base, "/v1/chat/completions", short)
    took = time.perf_counter() - begin
    for t in threads:
        t.join()
    statuses += [future.result()[0] for future in heavy]
    statuses.append(f"short {status}")
    return (
        statuses,
        f"the short request: {status} after {took:.2f} s (limit {REQUEST_TIMEOUT_S:g} s)",
    )


def _idle_and_slow_connections(
    base: str, sizes: Sizes, senders: ProcessPoolExecutor | None
) -> tuple[list[str], str]:
    """A client trickling its headers and one trickling its body, one byte per 0.1 s (how
    does each end?); then ``sizes.idle_connections`` connections that send nothing: is a
    request on a new connection answered while they are open, and once they have been
    open for longer than the header timeout?"""
    parts = urlsplit(base)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    statuses: list[str] = []
    notes: list[str] = []
    outcomes: dict[str, tuple[str, float]] = {}

    def trickle(kind: str) -> None:
        if kind == "headers":
            head = b""
            data = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000 + b"\r\n\r\n"
        else:
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nauthorization: Bearer {API_KEY}"
                "\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n"
            ).encode()
            data = b" " * 100_000
        outcomes[kind] = _trickle(address, head, data, sizes.trickle_s)

    trickles = [threading.Thread(target=trickle, args=(k,)) for k in ("headers", "body")]
    for t in trickles:
        t.start()
    for t in trickles:
        t.join()
    for kind in ("headers", "body"):
        outcome, took = outcomes[kind]
        statuses.append(f"{kind}-trickle {outcome}")
        notes.append(f"{kind} trickle: {outcome} after {took:.1f} s")
    idle: list[socket.socket] = []
    try:
        for _ in range(sizes.idle_connections):
            try:
                idle.append(socket.create_connection(address, timeout=5))
            except OSError as exc:
                notes.append(f"connection {len(idle) + 1} not opened: {exc!r}")
                break
        time.sleep(1.0)
        for when, wait in (("during", 0.0), ("after", HEADER_TIMEOUT_S + 1.5)):
            time.sleep(wait)
            begin = time.perf_counter()
            status = _send(base, "GET", "/health", b"", 10.0, key=True)
            statuses.append(f"{when}-idle {status}")
            notes.append(
                f"a request {when} the idle ones: {status} in {time.perf_counter() - begin:.2f} s"
            )
    finally:
        for sock in idle:
            sock.close()
    return statuses, "; ".join(notes)


def _trickle(
    address: tuple[str, int], head: bytes, data: bytes, limit_s: float
) -> tuple[str, float]:
    """Send ``head``, then ``data`` one byte per 0.1 s until the server answers or closes
    (its status, or "closed") or ``limit_s`` passes ("open")."""
    started = time.perf_counter()
    with socket.create_connection(address, timeout=10) as sock:
        try:
            sock.sendall(head)
            for byte in data:
                if time.perf_counter() - started > limit_s:
                    return "open", time.perf_counter() - started
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    break
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass
        took = time.perf_counter() - started
        try:
            sock.settimeout(2)
            answer = sock.recv(65536)
        except OSError:
            answer = b""
    if answer.startswith(b"HTTP/1.1 "):
        return answer[9:12].decode(), took
    return "closed", took


@dataclass
class Result:
    attack: str
    clients: int
    body_bytes: int
    statuses: dict[str, int] = field(default_factory=dict)
    attack_wall_s: float = 0.0
    stream_tokens: int = 0
    max_gap_ms: float = 0.0
    rest_gap_ms: float = 0.0
    max_health_ms: float = 0.0
    health_probes: int = 0
    rss_before_mib: float = 0.0
    rss_after_mib: float = 0.0
    rss_peak_mib: float = 0.0
    total_rss_before_mib: float = 0.0
    total_rss_after_mib: float = 0.0
    # The server's child processes (its preparation processes) before and after.
    processes_before: int = 0
    processes_after: int = 0
    server: str = "main"
    notes: str = ""


# --- the server ------------------------------------------------------------------------------


def write_model(folder: Path) -> Path:
    from tandem.core.demo.demo_model import tiny_spec, write_demo_model

    return write_demo_model(folder, replace(tiny_spec(), max_position_embeddings=MAX_POSITIONS))


# The servers the classes run against: their flags (those an older server lacks are left
# out, see ``server_flags``) and open-file limit.
SERVERS: dict[str, tuple[list[str], int | None]] = {
    "main": (["--api-key", API_KEY], None),
    "timeout": (["--api-key", API_KEY, "--request-timeout-s", f"{REQUEST_TIMEOUT_S:g}"], None),
    "connections": (
        [
            "--api-key",
            API_KEY,
            "--request-body-timeout-s",
            f"{BODY_TIMEOUT_S:g}",
            "--request-header-timeout-s",
            f"{HEADER_TIMEOUT_S:g}",
        ],
        NOFILE,
    ),
}


def server_env(repo: Path | None) -> dict[str, str]:
    """The server's environment: with ``repo``, that checkout's packages on its path."""
    env = dict(os.environ)
    if repo is not None:
        folders = ["packages/core", "packages/device", "packages/collectives",
                   "packages/server", "sim", "hw"]  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(str(repo / f) for f in folders)
    return env


def server_flags(env: dict[str, str]) -> set[str]:
    """The flags ``tandem serve`` has in this environment."""
    done = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "serve", "--help"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return {word.strip(",[]") for word in done.stdout.split() if word.startswith("--")}


def supported_args(args: list[str], flags: set[str]) -> tuple[list[str], list[str]]:
    """``args`` without the flags (and their values) the server lacks, and those flags."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        width = 2 if takes_value else 1
        if flag in flags:
            kept += args[i : i + width]
        else:
            dropped.append(flag)
        i += width
    return kept, dropped


def prepare_processes(args: list[str]) -> int:
    """How many preparation processes a server started with ``args`` runs."""
    if "--prepare-processes" in args:
        return int(args[args.index("--prepare-processes") + 1])
    return PREPARE_PROCESSES


def start_server(
    model: Path,
    log: Path,
    extra: list[str],
    nice: int = 0,
    env: dict[str, str] | None = None,
    nofile: int | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "tandem.server.cli.main", "serve", "--model", str(model),
               "--served-model-name", MODEL_NAME, "--port", str(port), "--num-blocks", "512",
               "--block-size", "16", "--shutdown-timeout", "5", *extra]  # fmt: skip

    def limits() -> None:
        # Every thread of the server (and its children, relative to it) at this niceness.
        if nice:
            os.nice(nice)
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=limits if nice or nofile is not None else None,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log.read_text()[-4000:]}")
        try:
            # Its own /health: another server may hold the port until ours fails to bind.
            healthy = httpx.get(f"{base}/health", timeout=2).status_code == 200
            if healthy and listens_on(process.pid, port):
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not become healthy:\n{log.read_text()[-4000:]}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes, and theirs."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def total_rss_mib(pid: int) -> float:
    return rss_mib(pid) + sum(rss_mib(c) for c in descendants(pid))


def wait_idle(base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    values: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", headers=AUTH, timeout=10).text
        values = {
            line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        # Preparation too: a request that got its 504 leaves its job running, whose heap a
        # measurement of the memory given back would otherwise read.
        if (
            values.get("tandem:num_requests_running", 0) == 0
            and values.get("tandem:num_requests_waiting", 0) == 0
            and values.get("tandem:preparation_jobs_running", 0) == 0
        ):
            return
        time.sleep(0.2)
    # Measuring memory beside work still running would blame the server for it.
    raise RuntimeError(f"the server was still busy after {timeout:g} s: {values}")


# --- the probes ------------------------------------------------------------------------------


class StreamProbe(threading.Thread):
    """Streamed chat completions one after another until stopped; records when each token
    arrived (and, for a stream started while measuring, how long its first token took)."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.stop = threading.Event()
        self.measuring = False
        self.gaps: list[float] = []
        self.rest_gaps: list[float] = []
        self.tokens = 0
        self.error: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(timeout=600, headers=AUTH) as client:
            while not self.stop.is_set():
                sent = time.perf_counter()
                last = sent
                try:
                    with client.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
                        for line in r.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            now = time.perf_counter()
                            # The first event (the role) and each token after it.
                            (self.gaps if self.measuring else self.rest_gaps).append(now - last)
                            last = now
                            self.tokens += 1
                            self.started.set()
                            if self.stop.is_set():
                                break
                except httpx.HTTPError as exc:
                    self.error = repr(exc)
                    return


class HealthProbe(threading.Thread):
    def __init__(self, base: str, every_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.every_s = every_s
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.failures = 0

    def run(self) -> None:
        with httpx.Client(timeout=60, headers=AUTH) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.base}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - start)
                self.failures += not ok
                time.sleep(self.every_s)


def _send(base: str, method: str, path: str, body: bytes, timeout_s: float, key: bool) -> str:
    """The answer's status, "timeout", or the name of the error the client met (a request
    dropped without an answer)."""
    headers = {"content-type": "application/json", **(AUTH if key else {})}
    try:
        with httpx.Client(timeout=timeout_s) as client:
            r = client.request(method, base + path, content=body or None, headers=headers)
        return str(r.status_code)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def send(base: str, attack: Attack, body: bytes) -> str:
    return _send(base, attack.method, attack.path, body, attack.timeout_s, attack.key)


def send_json(base: str, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> str:
    return _send(base, "POST", path, json.dumps(body).encode(), timeout_s, key=True)


def warm_up(base: str, clients: int) -> None:
    """A few large (100 kB) requests first, as many at once as the attacks send: the
    measurements are of a server that has served large requests before."""
    warm = [
        Attack(
            "warm",
            "POST",
            "/tokenize",
            lambda: json.dumps({"prompt": _text(100_000)}).encode(),
            clients,
        ),
        Attack(
            "warm",
            "POST",
            "/v1/chat/completions",
            lambda: json.dumps(
                {"model": MODEL_NAME, "messages": _messages(3000), "max_tokens": 1}
            ).encode(),
            clients,
        ),
    ]
    for attack in warm:
        body = attack.body()
        threads = [threading.Thread(target=send, args=(base, attack, body)) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def fill_preparation_pool(base: str, pid: int, count: int, timeout_s: float = 120.0) -> int:
    """Large (just over ``PROCESS_BODY_BYTES``) /tokenize bodies, ``count`` at once, until the
    server runs ``count`` preparation processes that have each answered one: the memory
    before a class is then that of a full pool. A process retires after a job it grew by,
    and the next large body starts its replacement (preparer.py), so without this the
    memory after a class can count a process the memory before it did not (one CI run:
    one process before, two after, 300 MiB more). Returns how many run; an older server
    without them is left as it is."""
    if count < 1:
        return len(descendants(pid))
    body = json.dumps({"prompt": _text(80_000)}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        with ThreadPoolExecutor(count) as clients:
            statuses = list(
                clients.map(lambda _: _send(base, "POST", "/tokenize", body, 300.0, True),
                            range(count))
            )  # fmt: skip
        running = len(descendants(pid))
        full = running >= count and statuses == ["200"] * count
        if full or running == 0 or time.monotonic() > deadline:
            return running


def _send_from_pool(
    base: str, method: str, path: str, body: bytes, timeout_s: float, key: bool
) -> tuple[str, float]:
    started = time.perf_counter()
    return _send(base, method, path, body, timeout_s, key), time.perf_counter() - started


@contextmanager
def no_collections() -> Iterator[None]:
    """The probes measure the server but run in this process: a garbage collection here stops
    their threads and shows as the server's stall (full collections took up to 122 ms with a
    class's bodies and answers alive). So everything is collected before the probes start,
    and nothing until they stop."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def run_attack(
    base: str,
    pid: int,
    attack: Attack,
    sizes: Sizes,
    settle_s: float = 3.0,
    senders: ProcessPoolExecutor | None = None,
    prepare_processes: int = PREPARE_PROCESSES,
) -> Result:
    body = attack.body()
    result = Result(attack.name, attack.clients, len(body), server=attack.server)
    wait_idle(base)
    fill_preparation_pool(base, pid, prepare_processes)
    time.sleep(0.2)
    result.rss_before_mib = rss_mib(pid)
    result.total_rss_before_mib = total_rss_mib(pid)
    result.processes_before = len(descendants(pid))
    with no_collections():
        stream = StreamProbe(base)
        health = HealthProbe(base)
        stream.start()
        stream.started.wait(60)
        time.sleep(1.0)  # the stream at rest, for comparison
        health.start()
        stream.measuring = True
        peak = [0.0]
        done = threading.Event()

        def watch_rss() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], total_rss_mib(pid))
                time.sleep(0.1)

        watcher = threading.Thread(target=watch_rss, daemon=True)
        watcher.start()
        statuses: list[str] = []
        start = time.perf_counter()
        if attack.custom is not None:
            statuses, result.notes = attack.custom(base, sizes, senders)
        elif senders is not None:
            # From processes of their own: a client reading a large answer holds its GIL, which
            # the probes' threads here would otherwise wait for (and count as the server's).
            futures = [
                senders.submit(
                    _send_from_pool,
                    base,
                    attack.method,
                    attack.path,
                    body,
                    attack.timeout_s,
                    attack.key,
                )
                for _ in range(attack.clients)
            ]
            walls = []
            for future in futures:
                status, wall = future.result()
                statuses.append(status)
                walls.append(wall)
            result.notes = f"each request took {min(walls):.1f}-{max(walls):.1f} s"
        else:
            clients = [
                threading.Thread(target=lambda: statuses.append(send(base, attack, body)))
                for _ in range(attack.clients)
            ]
            for c in clients:
                c.start()
            for c in clients:
                c.join()
        result.attack_wall_s = time.perf_counter() - start
        time.sleep(0.3)
        stream.measuring = False
        health.stop.set()
        stream.stop.set()
        done.set()
        health.join()
        stream.join(60)
        watcher.join()
    for s in statuses:
        result.statuses[s] = result.statuses.get(s, 0) + 1
    result.stream_tokens = stream.tokens
    result.max_gap_ms = 1000 * max(stream.gaps, default=float("nan"))
    result.rest_gap_ms = 1000 * max(stream.rest_gaps[2:], default=float("nan"))
    result.max_health_ms = 1000 * max(health.latencies, default=float("nan"))
    result.health_probes = len(health.latencies)
    result.rss_peak_mib = peak[0]
    wait_idle(base)
    time.sleep(settle_s)
    result.rss_after_mib = rss_mib(pid)
    result.total_rss_after_mib = total_rss_mib(pid)
    result.processes_after = len(descendants(pid))
    if stream.error is not None:
        result.statuses[f"stream: {stream.error}"] = 1
    return result


def table(results: list[Result]) -> str:
    rows = [
        "| attack | clients x body | statuses | attack wall | stream max gap (at rest) "
        "| /health max | server RSS before -> after (peak, all procs) "
        "| with children before -> after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        statuses = ", ".join(f"{k} x{v}" for k, v in sorted(r.statuses.items()))
        rows.append(
            f"| {r.attack} | {r.clients} x {r.body_bytes / 1e6:.2f} MB | {statuses} "
            f"| {r.attack_wall_s:.1f} s | {r.max_gap_ms:.0f} ms ({r.rest_gap_ms:.0f} ms) "
            f"| {r.max_health_ms:.0f} ms | {r.rss_before_mib:.0f} -> {r.rss_after_mib:.0f} MiB "
            f"({r.rss_peak_mib:.0f}) | {r.total_rss_before_mib:.0f} -> "
            f"{r.total_rss_after_mib:.0f} MiB |"
        )
    notes = [f"- {r.attack}: {r.notes}" for r in results if r.notes]
    return "\n".join(rows + (["", *notes] if notes else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="issue 35's sizes (6 MB, 150,000)")
    parser.add_argument("--model", type=Path, help="a model folder (default: a demo model)")
    parser.add_argument("--only", nargs="*", help="run only these attack classes")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--clients", type=int, help="clients per attack (default 4)")
    parser.add_argument(
        "--repo", type=Path, help="serve from this checkout's packages (e.g. the old code)"
    )
    parser.add_argument(
        "--server-nice",
        type=int,
        default=0,
        help="run the server at this niceness (negative: root; shields it from other load)",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="passed to serve")
    parser.add_argument(
        "--settle-s", type=float, default=3.0, help="wait before the RSS after each class"
    )
    args = parser.parse_args(argv)
    sizes = FULL_SIZES if args.full else CI_SIZES
    if args.clients:
        sizes = replace(sizes, clients=args.clients)
    work = Path(tempfile.mkdtemp(prefix="tandem-hostile-"))
    model = args.model or write_model(work / "model")
    env = server_env(args.repo)
    # This checkout's server has every flag; another's is asked.
    flags = (
        server_flags(env) if args.repo is not None else {a for v in SERVERS.values() for a in v[0]}
    )
    chosen = [a for a in attacks(sizes, model) if not args.only or a.name in args.only]
    results: list[Result] = []
    dropped_flags: set[str] = set()
    spawn = multiprocessing.get_context("spawn")
    senders = ProcessPoolExecutor(max(sizes.clients, 1), mp_context=spawn)
    # Started now, before any probe runs.
    list(senders.map(time.sleep, [0.0] * max(sizes.clients, 1)))
    for kind, (server_args, nofile) in SERVERS.items():
        group = [a for a in chosen if a.server == kind]
        if not group:
            continue
        extra, dropped = supported_args(server_args + args.server_arg, flags)
        dropped_flags.update(dropped)
        log = work / f"server-{kind}.log"
        process, base = start_server(model, log, extra, args.server_nice, env, nofile)
        try:
            warm_up(base, sizes.clients)
            for attack in group:
                print(f"attack {attack.name} ...", file=sys.stderr, flush=True)
                results.append(
                    run_attack(
                        base, process.pid, attack, sizes, args.settle_s, senders,
                        prepare_processes=prepare_processes(extra),
                    )
                )  # fmt: skip
                print("\n".join(table(results[-1:]).splitlines()[2:]), file=sys.stderr, flush=True)
        finally:
            stop_server(process)
    senders.shutdown()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    load = Path("/proc/loadavg").read_text().split()[:3]
    repo = f"; server from {args.repo}" if args.repo else ""
    missing = (
        f"; flags this server lacks: {' '.join(sorted(dropped_flags))}" if dropped_flags else ""
    )
    print(
        f"CPU: {cpu}, {os.cpu_count()} CPUs; load average at the end {' '.join(load)}; "
        f"server niceness {args.server_nice}; sizes: {asdict(sizes)}{repo}{missing}"
    )
    print(table(results))
    if args.json is not None:
        record = {
            "cpu": cpu,
            "sizes": asdict(sizes),
            "server_nice": args.server_nice,
            "repo": str(args.repo) if args.repo else None,
            "flags_lacking": sorted(dropped_flags),
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
