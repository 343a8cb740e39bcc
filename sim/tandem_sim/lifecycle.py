"""The whole engine under the simulator: the real LLMEngine and its loop, scheduler, block
manager and prefix cache, the single-process executor with two worker threads, the real
in-process communicator and kernel registry, on the fake NPU runtime; a client submits
requests while steps run, aborts some at points the schedule picks, and the KV cache is
small enough to force preemption. The recommender gets the same (``rec_lifecycle``).

Checked after every schedule (``LifecycleCheck``): every request ends exactly once
(finished, aborted, failed, or refused at submission); every KV block is free, and every
state slot (the hybrid variant: a Qwen3.5 model whose linear-attention layers hold a state
slot per sequence, fewer slots than requests) (for the recommender, every lane and every
lane's batch state); no thread is left blocked (every
worker, lane and loop thread has ended once the engine is stopped); the failure of a rank
reaches every request within a bound of virtual time; and the tokens of every request that
ran to its end equal a run of that request alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from tandem.collectives import ProcessGroup, create_inprocess_groups
from tandem.core.config import (
    CacheConfig,
    EngineConfig,
    ModelLoadConfig,
    ParallelConfig,
    PipelineConfig,
    RecConfig,
)
from tandem.core.errors import EngineDeadError
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.faults import Fault, FaultConfig
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.engine import LLMEngine
from tandem.core.llm.engine_loop import EngineLoop
from tandem.core.llm.model_runner import LLMRunnerFactory
from tandem.core.llm.outputs import RequestOutput
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.models.config_json import load_model_config
from tandem.core.models.rec_config import load_rec_config
from tandem.core.parallel.groups import Abortable
from tandem.core.parallel.topology import resolve_topology
from tandem.core.rec.engine import RecEngine
from tandem.core.rec.fixed_steps_scheduler import FixedStepsScheduler
from tandem.core.rec.request import make_rec_request
from tandem.core.rec.runner import RecRunnerFactory
from tandem.core.rec.service import RecService
from tandem.device import KernelRegistry
from tandem.device.sync import Promise
from tandem_sim.fake_runtime import FakeNpuRuntime
from tandem_sim.models import rec_model, tiny_hybrid, tiny_model
from tandem_sim.scheduler import DeterministicScheduler

# Four prompts (two share a two-block prefix, for the prefix cache), six new tokens each:
# 20 blocks of 2 tokens in all, in a pool of 10, so running requests are preempted.
LIFECYCLE_PROMPTS = (
    (5, 17, 300, 42, 9),
    (11, 3, 250, 8),
    (40, 41, 42, 43, 44, 45),
    (5, 17, 300, 42, 7),
)
# The hybrid's also has a prompt that continues r0's: it starts from r0's state snapshot
# when r0's prompt was done before it is admitted (the schedule decides), and the same tokens
# come out either way.
HYBRID_PROMPTS = (*LIFECYCLE_PROMPTS, (5, 17, 300, 42, 9, 13, 2))
LIFECYCLE_PARAMS = SamplingParams.greedy(max_tokens=6, ignore_eos=True)
LIFECYCLE_CACHE = CacheConfig(block_size=2, num_blocks=10)
# r1 is aborted once it has a token (it holds blocks then), r3 wherever the schedule has
# the client reach its abort.
ABORT_AFTER_A_TOKEN = "r1"
ABORT_ANYWHERE = "r3"
# A rank's failure mid-step: rank 1's third collective of its third step fails.
RANK_FAULT = FaultConfig((Fault("collective_fail", rank=1, step=2, collective=2),))
NO_FAULTS = FaultConfig()
# Virtual seconds within which every request must have ended. A run that waits out a
# timeout (300 s, for a rank nobody released from a collective) does not make it.
END_WITHIN_S = 60.0


# The hybrid variant's state slots: fewer than the requests, so some wait for one.
HYBRID_STATE_SLOTS = 3


def lifecycle_model(hybrid: bool = False) -> Path:
    return tiny_hybrid() if hybrid else tiny_model()


def _config(
    faults: FaultConfig, tp: int = 2, kind: str = "npu", hybrid: bool = False
) -> EngineConfig:
    slots = HYBRID_STATE_SLOTS if hybrid else None
    return EngineConfig(
        model=ModelLoadConfig(model=str(lifecycle_model(hybrid))),
        cache=replace(LIFECYCLE_CACHE, num_state_slots=slots),
        parallel=ParallelConfig(
            devices=",".join(f"{kind}:{i}" for i in range(tp)), single_process=tp > 1
        ),
        faults=faults,
    )


def lifecycle_prompts(hybrid: bool) -> tuple[tuple[int, ...], ...]:
    return HYBRID_PROMPTS if hybrid else LIFECYCLE_PROMPTS


@lru_cache(maxsize=2)
def solo_tokens(hybrid: bool = False) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each prompt's tokens run alone, TP=1, on real threads, without prefix caching (a
    prompt that continues another would start from its snapshot)."""
    config = _config(FaultConfig(), tp=1, kind="cpu", hybrid=hybrid)
    config = replace(config, cache=replace(config.cache, enable_prefix_cache=False))
    engine = LLMEngine(config)
    try:
        return {
            prompt: tuple(engine.generate([list(prompt)], LIFECYCLE_PARAMS)[0].token_ids)
            for prompt in lifecycle_prompts(hybrid)
        }
    finally:
        engine.shutdown()


def inprocess_groups(
    s: DeterministicScheduler, timeout_s: float
) -> Callable[[int], tuple[list[ProcessGroup], Abortable]]:
    """The real in-process communicator on the simulator's sync (the executor's own choice
    refuses it for NPU devices, whose tensors the fake runtime keeps in host memory)."""

    def make(size: int) -> tuple[list[ProcessGroup], Abortable]:
        groups = create_inprocess_groups(size, timeout_s=timeout_s, sync=s)
        return list(groups), groups[0].communicator

    return make


ExecutorClass = type[ThreadExecutor[Any, Any]]


def lifecycle_executor(
    s: DeterministicScheduler,
    config: EngineConfig,
    factory: Any,
    executor_class: ExecutorClass = ThreadExecutor,
    lanes: bool = False,
) -> ThreadExecutor[Any, Any]:
    return executor_class(
        config,
        factory,
        resolve_topology(config.parallel),
        lanes=lanes,
        sync=s,
        local_groups=inprocess_groups(s, config.parallel.timeout_s),
        runtime=FakeNpuRuntime(s),
        kernel_registry=KernelRegistry(s),
    )


@dataclass
class LifecycleCheck:
    """What a schedule's run leaves behind, and the invariants over it."""

    requests: list[str]
    ended: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def end(self, request_id: str, how: str) -> None:
        self.ended.setdefault(request_id, []).append(how)

    @property
    def all_ended(self) -> bool:
        return all(r in self.ended or r in self.refused for r in self.requests)

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def check_ended_once(self) -> None:
        for request in self.requests:
            ends = self.ended.get(request, [])
            if request in self.refused:
                self.expect(not ends, f"{request} was refused and still ended: {ends}")
            else:
                self.expect(len(ends) == 1, f"{request} ended {len(ends)} times: {ends}")

    def check_threads_ended(self, threads: list[Any], what: str) -> None:
        alive = [t.name for t in threads if t.is_alive()]
        self.expect(not alive, f"{what} still blocked after the engine stopped: {alive}")

    def raise_problems(self) -> None:
        if self.problems:
            raise AssertionError("; ".join(self.problems))


def engine_lifecycle(
    s: DeterministicScheduler,
    faults: FaultConfig = NO_FAULTS,
    engine_class: type[LLMEngine] = LLMEngine,
    executor_class: ExecutorClass = ThreadExecutor,
    hybrid: bool = False,
) -> None:
    config = _config(faults, hybrid=hybrid)
    factory = LLMRunnerFactory(load_model_config(lifecycle_model(hybrid)))
    executor = lifecycle_executor(s, config, factory, executor_class)
    engine = engine_class(config, executor=executor, sync=s)
    loop = EngineLoop(engine, sync=s)
    prompts = lifecycle_prompts(hybrid)
    ids = [f"r{i}" for i in range(len(prompts))]
    check = LifecycleCheck(ids)
    outputs: dict[str, RequestOutput] = {}
    tokens_seen: dict[str, int] = {}
    changed = s.condition()

    def on_output(out: RequestOutput) -> None:
        with changed:
            tokens_seen[out.request_id] = len(out.token_ids)
            if out.finished:
                outputs[out.request_id] = out
                check.end(out.request_id, f"{out.finish_reason}: {out.error}")
            changed.notify_all()

    deadline = s.monotonic() + END_WITHIN_S
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            try:
                loop.submit(list(prompt), LIFECYCLE_PARAMS, on_output, request_id=rid)
            except EngineDeadError as exc:
                check.refused[rid] = str(exc)
            s.yield_point(f"client submitted {rid}")
        with changed:
            while not tokens_seen.get(ABORT_AFTER_A_TOKEN) and not check.all_ended:
                if s.monotonic() >= deadline or not changed.wait(deadline - s.monotonic()):
                    break
        loop.abort(ABORT_AFTER_A_TOKEN)
        s.yield_point(f"client aborts {ABORT_ANYWHERE}")
        loop.abort(ABORT_ANYWHERE)
        with changed:
            while not check.all_ended and s.monotonic() < deadline:
                changed.wait(deadline - s.monotonic())
        ended_at = s.monotonic()
    finally:
        loop.stop()
    check.expect(
        check.all_ended,
        f"requests still pending after {END_WITHIN_S:g} virtual s: "
        f"{[r for r in ids if r not in check.ended and r not in check.refused]}",
    )
    check.expect(ended_at < END_WITHIN_S, f"the requests took {ended_at:g} virtual s to end")
    check.check_ended_once()
    blocks = engine.block_manager
    snapshots = engine.snapshots
    if snapshots is not None:
        # The prefix cache's state snapshots may keep blocks (their prefixes' partial last
        # ones), nothing else; none is still pinned, and dropping them frees those blocks.
        held = snapshots.num_tail_blocks
        check.expect(snapshots.num_pinned == 0, f"{snapshots.num_pinned} snapshots still pinned")
        check.expect(
            blocks.num_free_blocks + held == blocks.num_blocks,
            f"{blocks.num_blocks - blocks.num_free_blocks - held} KV blocks still held beside "
            f"the {held} of state snapshots",
        )
        snapshots.clear()
    check.expect(
        blocks.num_free_blocks == blocks.num_blocks,
        f"{blocks.num_blocks - blocks.num_free_blocks} KV blocks still held",
    )
    slots = engine.state_slots
    if hybrid:
        check.expect(slots is not None, "the hybrid model got no state slots")
    if slots is not None:
        check.expect(
            slots.num_free == slots.num_slots,
            f"{slots.num_slots - slots.num_free} state slots still held",
        )
    check.check_threads_ended([*executor._threads, loop._thread], "a thread")
    solo = solo_tokens(hybrid)
    for rid, prompt in zip(ids, prompts, strict=True):
        out = outputs.get(rid)
        if out is None:
            continue
        if out.finish_reason == "length":
            check.expect(
                tuple(out.token_ids) == solo[prompt],
                f"{rid} generated {out.token_ids}, alone {list(solo[prompt])}",
            )
        elif out.finish_reason == "error":
            check.expect(faults.active, f"{rid} failed without a fault: {out.error}")
            check.expect(
                "rank 1 (npu:1) failed" in (out.error or ""),
                f"{rid}'s error does not name the failed rank: {out.error}",
            )
        else:
            check.expect(
                out.finish_reason == "abort" and rid in (ABORT_AFTER_A_TOKEN, ABORT_ANYWHERE),
                f"{rid} ended with {out.finish_reason}",
            )
    check.raise_problems()


# -- the recommender ---------------------------------------------------------------------

# Histories of 3, 5, 2 and 7 items in blocks of 2: 2, 3, 1 and 4 blocks, in a pool of 6 with
# two lanes, so requests wait for blocks; batches of one request (results of a request alone).
REC_HISTORIES = (3, 5, 2, 7)
REC_CANDIDATES = 3
REC_CACHE = CacheConfig(block_size=2, num_blocks=6, enable_prefix_cache=False)
REC_FAULT = FaultConfig((Fault("collective_fail", rank=1, step=3, collective=1),))


def _rec_config(faults: FaultConfig, tp: int = 2, kind: str = "npu") -> EngineConfig:
    return EngineConfig(
        model=ModelLoadConfig(model=str(rec_model())),
        cache=REC_CACHE,
        parallel=ParallelConfig(
            devices=",".join(f"{kind}:{i}" for i in range(tp)), single_process=tp > 1
        ),
        pipeline=PipelineConfig(max_concurrency=2),
        rec=RecConfig(max_batch_size=1),
        faults=faults,
    )


def _history(length: int, index: int) -> list[list[int]]:
    return [[(index * 5 + i * 3 + c) % 8 for c in range(3)] for i in range(length)]


@lru_cache(maxsize=1)
def rec_solo() -> dict[int, tuple[tuple[tuple[int, ...], ...], tuple[float, ...]]]:
    """Each history's candidates and scores, the request alone, TP=1, on real threads."""
    service = RecService(_rec_config(FaultConfig(), tp=1, kind="cpu"))
    try:
        solo = {}
        for index, length in enumerate(REC_HISTORIES):
            result = service.submit(_history(length, index), REC_CANDIDATES).result(timeout=60)
            solo[index] = (tuple(result.candidates), tuple(result.scores))
        return solo
    finally:
        service.shutdown()


def rec_lifecycle(
    s: DeterministicScheduler,
    faults: FaultConfig = NO_FAULTS,
    engine_class: type[RecEngine] = RecEngine,
) -> None:
    config = _rec_config(faults)
    model = load_rec_config(rec_model())
    executor = lifecycle_executor(s, config, RecRunnerFactory(model), lanes=True)
    blocks = BlockManager(executor.num_blocks, REC_CACHE.block_size, False, sync=s)
    scheduler = FixedStepsScheduler(
        blocks, max_batch_size=1, max_concurrency=2, max_decode_rounds=model.max_decode_rounds,
        sync=s,
    )  # fmt: skip
    engine = engine_class(executor, scheduler, sync=s, step_timeout_s=config.parallel.timeout_s)
    ids = [f"q{i}" for i in range(len(REC_HISTORIES))]
    check = LifecycleCheck(ids)
    results: dict[str, Promise[Any]] = {}
    settled = s.condition()
    deadline = s.monotonic() + END_WITHIN_S

    def on_settled(request_id: str, promise: Promise[Any]) -> None:
        with settled:
            error = promise.exception()
            check.end(request_id, f"error: {error}" if error is not None else "ok")
            settled.notify_all()

    try:
        for index, (rid, length) in enumerate(zip(ids, REC_HISTORIES, strict=True)):
            request = make_rec_request(
                _history(length, index), REC_CANDIDATES, model, model.beam_width, rid, sync=s
            )
            try:
                (results[rid],) = engine.submit(request)
            except EngineDeadError as exc:
                check.refused[rid] = str(exc)
                continue
            results[rid].add_done_callback(partial(on_settled, rid))
            s.yield_point(f"client submitted {rid}")
        with settled:
            while not check.all_ended and s.monotonic() < deadline:
                settled.wait(deadline - s.monotonic())
        ended_at = s.monotonic()
    finally:
        engine.stop()
        executor.shutdown()
    check.expect(check.all_ended, f"requests still pending after {END_WITHIN_S:g} virtual s")
    check.expect(ended_at < END_WITHIN_S, f"the requests took {ended_at:g} virtual s to end")
    check.check_ended_once()
    check.expect(
        blocks.num_free_blocks == blocks.num_blocks,
        f"{blocks.num_blocks - blocks.num_free_blocks} KV blocks still held",
    )
    check.expect(scheduler.num_in_flight == 0, f"{scheduler.num_in_flight} batches in flight")
    check.expect(
        sorted(scheduler._free_lanes) == [0, 1], f"lanes free at the end: {scheduler._free_lanes}"
    )
    lanes = [lane for worker in executor.workers for lane in worker.lanes]
    check.check_threads_ended(
        [
            *executor._threads,
            engine._thread,
            *(t for lane in lanes for t in (lane.host, lane.stream)),
        ],
        "a thread",
    )
    if not faults.active:
        # A batch's beams live in its lane's state until its last round: all gone now.
        held = {lane.host.name: list(lane.state) for lane in lanes if lane.state}
        check.expect(not held, f"lane state of finished batches still held: {held}")
    solo = rec_solo()
    for index, rid in enumerate(ids):
        promise = results.get(rid)
        if promise is None or not promise.done():
            continue
        error = promise.exception()
        if error is None:
            result = promise.result()
            candidates, scores = solo[index]
            # Scores are sums over two ranks here, in another order than alone.
            check.expect(
                tuple(result.candidates) == candidates
                and all(abs(a - b) < 1e-4 for a, b in zip(result.scores, scores, strict=True)),
                f"{rid} answered {result.candidates} {result.scores}, alone {solo[index]}",
            )
        else:
            check.expect(faults.active, f"{rid} failed without a fault: {error}")
            check.expect(
                "rank 1 (npu:1) failed" in str(error),
                f"{rid}'s error does not name the failed rank: {error}",
            )
    check.raise_problems()
