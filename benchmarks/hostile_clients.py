"""Hostile clients against a live server: does one client's request freeze another's stream?

Starts ``tandem serve`` on a Qwen3-shaped demo model whose context is long enough that huge
prompts pass the length bound (or on ``--model``), then, for each attack class, runs one
streamed chat completion and probes ``/health`` while a few clients send the attack at once.
Per class it prints the stream's largest gap between two tokens (a stream that starts during
the attack counts its wait for the first token as a gap), the largest ``/health`` latency,
the attack requests' statuses and their wall time, and the RSS of the server (its own, and
with its child processes) before the attack and after it settled.

    python benchmarks/hostile_clients.py            # CI sizes, a few seconds per class
    python benchmarks/hostile_clients.py --full     # the sizes of issue 35 (6 MB, 150,000)

A benchmark prints figures; integration/test_hostile_clients.py runs the CI sizes and checks
the bounds. To add an attack class, add an ``Attack`` to ``attacks()``: a name, a request
(method, path, JSON body) and how many clients send it at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

MODEL_NAME = "tandem-demo"
# Long enough that a 6 MB prompt passes the server's byte bound (4 bytes per position and
# per byte of the longest token), so the attack reaches the tokenizer.
MAX_POSITIONS = 131_072


@dataclass(frozen=True)
class Sizes:
    prompt_bytes: int
    messages: int
    clients: int


CI_SIZES = Sizes(prompt_bytes=600_000, messages=15_000, clients=4)
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


def _text(size: int) -> str:
    words = "the quick brown fox jumps over the lazy dog 123 "
    return (words * (size // len(words) + 1))[:size]


def _messages(count: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "hello there friend"} for _ in range(count)]


def attacks(sizes: Sizes) -> list[Attack]:
    """Every attack class, at ``sizes``."""

    def dumps(body: dict[str, Any]) -> Callable[[], bytes]:
        return lambda: json.dumps(body).encode()

    n = sizes.clients
    return [
        Attack(
            "tokenize-huge-prompt",
            "POST",
            "/tokenize",
            dumps({"model": MODEL_NAME, "prompt": _text(sizes.prompt_bytes)}),
            n,
        ),
        Attack(
            "tokenize-many-messages",
            "POST",
            "/tokenize",
            dumps({"model": MODEL_NAME, "messages": _messages(sizes.messages)}),
            n,
        ),
        Attack(
            "chat-many-messages",
            "POST",
            "/v1/chat/completions",
            dumps({"model": MODEL_NAME, "messages": _messages(sizes.messages), "max_tokens": 4}),
            n,
        ),
        Attack(
            "unknown-model-huge-body",
            "POST",
            "/v1/chat/completions",
            dumps({"model": "no-such-model", "messages": _messages(sizes.messages)}),
            n,
        ),
    ]


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


# --- the server ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_model(folder: Path) -> Path:
    from tandem.core.demo.demo_model import tiny_spec, write_demo_model

    return write_demo_model(folder, replace(tiny_spec(), max_position_embeddings=MAX_POSITIONS))


def start_server(
    model: Path, log: Path, extra: list[str], nice: int = 0
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "tandem.server.cli.main", "serve", "--model", str(model),
               "--served-model-name", MODEL_NAME, "--port", str(port), "--num-blocks", "512",
               "--block-size", "16", "--shutdown-timeout", "5", *extra]  # fmt: skip
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            # Every thread of the server (and its children, relative to it) at this niceness.
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not become healthy:\n{log.read_text()[-4000:]}")


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
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        values = {
            line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }
        if (
            values.get("tandem:num_requests_running", 0) == 0
            and values.get("tandem:num_requests_waiting", 0) == 0
        ):
            return
        time.sleep(0.2)


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
        with httpx.Client(timeout=600) as client:
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
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.base}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - start)
                self.failures += not ok
                time.sleep(self.every_s)


def send(base: str, attack: Attack, body: bytes) -> str:
    headers = {"content-type": "application/json"}
    try:
        with httpx.Client(timeout=attack.timeout_s) as client:
            r = client.request(attack.method, base + attack.path, content=body, headers=headers)
        return str(r.status_code)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as exc:
        return type(exc).__name__


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


def run_attack(base: str, pid: int, attack: Attack, settle_s: float = 3.0) -> Result:
    body = attack.body()
    result = Result(attack.name, attack.clients, len(body))
    wait_idle(base)
    time.sleep(0.5)
    result.rss_before_mib = rss_mib(pid)
    result.total_rss_before_mib = total_rss_mib(pid)
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
            f"| {r.attack} | {r.clients} x {r.body_bytes / 1e6:.1f} MB | {statuses} "
            f"| {r.attack_wall_s:.1f} s | {r.max_gap_ms:.0f} ms ({r.rest_gap_ms:.0f} ms) "
            f"| {r.max_health_ms:.0f} ms | {r.rss_before_mib:.0f} -> {r.rss_after_mib:.0f} MiB "
            f"({r.rss_peak_mib:.0f}) | {r.total_rss_before_mib:.0f} -> "
            f"{r.total_rss_after_mib:.0f} MiB |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="issue 35's sizes (6 MB, 150,000)")
    parser.add_argument("--model", type=Path, help="a model folder (default: a demo model)")
    parser.add_argument("--only", nargs="*", help="run only these attack classes")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--clients", type=int, help="clients per attack (default 4)")
    parser.add_argument(
        "--server-nice",
        type=int,
        default=0,
        help="run the server at this niceness (negative: root; shields it from other load)",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="passed to serve")
    args = parser.parse_args(argv)
    sizes = FULL_SIZES if args.full else CI_SIZES
    if args.clients:
        sizes = replace(sizes, clients=args.clients)
    work = Path(tempfile.mkdtemp(prefix="tandem-hostile-"))
    model = args.model or write_model(work / "model")
    process, base = start_server(model, work / "server.log", args.server_arg, args.server_nice)
    results: list[Result] = []
    try:
        chosen = [a for a in attacks(sizes) if not args.only or a.name in args.only]
        warm_up(base, sizes.clients)
        for attack in chosen:
            print(f"attack {attack.name} ...", file=sys.stderr, flush=True)
            results.append(run_attack(base, process.pid, attack))
            print(table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown",
    )
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(
        f"CPU: {cpu}, {os.cpu_count()} CPUs; load average at the end {' '.join(load)}; "
        f"server niceness {args.server_nice}; sizes: {asdict(sizes)}"
    )
    print(table(results))
    if args.json is not None:
        record = {
            "cpu": cpu,
            "sizes": asdict(sizes),
            "server_nice": args.server_nice,
            "results": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
