"""``tandem bench rec``: requests/s and latency of the recommendation engine for several
pipeline settings, each run in a fresh process (so its peak RSS is its own), interleaved
round by round (A B C A B C) so drift on the machine hits every setting alike."""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tandem.core import CacheConfig, EngineConfig, ModelLoadConfig
from tandem.core.config import ParallelConfig, PipelineConfig, RecConfig
from tandem.core.models.rec_config import load_rec_config
from tandem.core.rec.catalog import load_catalog
from tandem.core.rec.service import RecService

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setting:
    name: str
    max_concurrency: int
    serialize_prepare: bool = False
    serialize_forward: bool = False

    def flags(self) -> list[str]:
        out = ["--max-concurrency", str(self.max_concurrency)]
        if self.serialize_prepare:
            out.append("--serialize-prepare")
        if self.serialize_forward:
            out.append("--serialize-forward")
        return out


SETTINGS = {
    "c1": Setting("c1", 1),
    "c2": Setting("c2", 2),
    "c4": Setting("c4", 4),
    "c4-serialize-prepare": Setting("c4-serialize-prepare", 4, serialize_prepare=True),
    "c4-serialize-forward": Setting("c4-serialize-forward", 4, serialize_forward=True),
}


@dataclass(frozen=True)
class Workload:
    num_requests: int
    history_len: int
    num_candidates: int
    client_concurrency: int
    batch_size: int
    devices: str
    num_blocks: int = 1024
    warmups: int = 8
    seed: int = 0


def _histories(model: Path, workload: Workload) -> list[list[list[int]]]:
    config = load_rec_config(model)
    items = load_catalog(model, config.codebook_size).items
    gen = torch.Generator().manual_seed(workload.seed)
    picks = torch.randint(0, items.shape[0], (workload.num_requests, workload.history_len),
                          generator=gen)  # fmt: skip
    return [items[row].tolist() for row in picks]


def run_one(model: Path, setting: Setting, workload: Workload) -> dict[str, Any]:
    """One setting in this process: warm up, then keep ``client_concurrency`` requests
    outstanding until all are answered."""
    config = EngineConfig(
        model=ModelLoadConfig(model=str(model)),
        cache=CacheConfig(num_blocks=workload.num_blocks),
        pipeline=PipelineConfig(
            max_concurrency=setting.max_concurrency,
            serialize_prepare=setting.serialize_prepare,
            serialize_forward=setting.serialize_forward,
        ),
        parallel=ParallelConfig(devices=workload.devices, single_process=True),
        rec=RecConfig(max_batch_size=workload.batch_size),
    )
    service = RecService(config)
    try:
        histories = _histories(model, workload)
        for h in histories[: workload.warmups]:
            service.submit(h, workload.num_candidates).result(timeout=300)
        latencies: list[float] = []
        lock = threading.Lock()
        slots = threading.Semaphore(workload.client_concurrency)
        done = threading.Event()
        remaining = [len(histories)]
        start = time.perf_counter()
        for history in histories:
            slots.acquire()
            sent = time.perf_counter()

            def finished(_: object, sent: float = sent) -> None:
                with lock:
                    latencies.append(time.perf_counter() - sent)
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()
                slots.release()

            service.submit(history, workload.num_candidates).add_done_callback(finished)
        done.wait(timeout=3600)
        duration = time.perf_counter() - start
        memory = service.stats().memory
        weights, kv = memory.weight_bytes, memory.kv_cache_bytes
    finally:
        service.shutdown()
    ordered = sorted(latencies)
    return {
        "setting": setting.name,
        "requests": len(latencies),
        "duration_s": duration,
        "requests_per_s": len(latencies) / duration,
        "latency_mean_ms": 1000 * statistics.fmean(ordered),
        "latency_p50_ms": 1000 * ordered[len(ordered) // 2],
        "latency_p99_ms": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "weights_mb_per_rank": weights / (1 << 20),
        "kv_cache_mb_per_rank": kv / (1 << 20),
    }


def run_interleaved(
    model: Path, settings: list[Setting], workload: Workload, rounds: int
) -> list[dict[str, Any]]:
    """Every setting once per round, each in a child process; results in run order."""
    results = []
    runs = [(r, s) for r in range(rounds) for s in settings]
    for round_index, setting in tqdm(runs, desc="bench rec", unit="run", disable=None):
        command = [
            sys.executable, "-m", "tandem.server.cli.main", "--log-level", "WARNING", "bench",
            "rec", "--model", str(model), "--child", "--settings", setting.name,
            "--num-requests", str(workload.num_requests), "--history-len",
            str(workload.history_len), "--num-candidates", str(workload.num_candidates),
            "--client-concurrency", str(workload.client_concurrency), "--batch-size",
            str(workload.batch_size), "--devices", workload.devices, "--num-blocks",
            str(workload.num_blocks),
        ]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, env={**os.environ}
        )
        if done.returncode != 0:
            raise RuntimeError(f"{setting.name} failed:\n{done.stderr[-3000:]}")
        record = json.loads(done.stdout.strip().splitlines()[-1])
        record["round"] = round_index + 1
        results.append(record)
    return results


def format_rec_table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'round':>5}  {'setting':<22}{'req/s':>9}{'mean ms':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'peak RSS MB':>13}{'weights MB':>12}{'KV MB':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r['round']:>5}  {r['setting']:<22}{r['requests_per_s']:>9.2f}"
            f"{r['latency_mean_ms']:>10.1f}{r['latency_p50_ms']:>9.1f}{r['latency_p99_ms']:>9.1f}"
            f"{r['peak_rss_mb']:>13.0f}{r['weights_mb_per_rank']:>12.1f}"
            f"{r['kv_cache_mb_per_rank']:>8.0f}"
        )
    return "\n".join(lines)
