"""Named scenarios: each a function run as the main task of one schedule. A scenario raises
(or deadlocks) when its bug shows; the correct variant of each must pass every schedule."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, cast

import torch

from tandem.collectives import ProcessGroup
from tandem.core.config import (
    CacheConfig,
    EngineConfig,
    ModelLoadConfig,
    ParallelConfig,
    PipelineConfig,
)
from tandem.core.errors import EngineDeadError
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.kernels.triton.loading import triton_usable
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.engine import LLMEngine
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.input_builder import build_forward_input
from tandem.core.llm.model_runner import LLMRunnerFactory, ModelRunner
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.scheduler import ScheduledSequence, SchedulerOutput
from tandem.core.llm.sequence import TokenSequence
from tandem.core.models.config_json import load_model_config
from tandem.core.models.decoder import DecoderForCausalLM
from tandem.core.parallel.topology import resolve_topology
from tandem.core.worker.lane_stager import LaneStager, Staged
from tandem.core.worker.worker import Worker
from tandem.device import Device, KernelKey, KernelRegistry
from tandem.device.scratch_allocator import ScratchAllocator
from tandem.device.sync import REAL_SYNC, Promise
from tandem.device.task_thread import TaskThread
from tandem_sim.broken import (
    DecodeOnlyEngine,
    FailureForgetsBatchesEngine,
    LeakyAbortEngine,
    NoAbortExecutor,
    UnrecordedStager,
    UnsynchronizedRegistry,
)
from tandem_sim.fake_collectives import FakeBackend
from tandem_sim.fake_runtime import FakeNpuRuntime
from tandem_sim.lifecycle import RANK_FAULT, REC_FAULT, engine_lifecycle, rec_lifecycle
from tandem_sim.models import tiny_hybrid, tiny_model
from tandem_sim.scheduler import DeterministicScheduler

Scenario = Callable[[DeterministicScheduler], None]


@dataclass(frozen=True)
class ScenarioSpec:
    name: str
    run: Scenario
    bug: str
    # True for the deliberately broken variants: exploring them must find a failure.
    broken: bool


KEY = KernelKey("layer_norm_fwd_kernel", Device("npu", 0), "bfloat16")


def registry_race(s: DeterministicScheduler, broken: bool) -> None:
    runtime = FakeNpuRuntime(s)
    registry = UnsynchronizedRegistry(s) if broken else KernelRegistry[str](s)

    def first_forward() -> None:
        runtime.launch(registry.get(KEY, lambda: runtime.register_function(KEY.kernel, 0)))

    threads = [s.start_thread(first_forward, f"worker{i}") for i in range(2)]
    for t in threads:
        t.join()
    if runtime.registrations != 1:
        raise AssertionError(f"kernel registered {runtime.registrations} times")


def two_groups(s: DeterministicScheduler, mismatched: bool) -> None:
    """Two process groups in one process (tensor- and data-parallel, say) on two ranks."""
    tp = FakeBackend(s, "tp", 2).groups()
    dp = FakeBackend(s, "dp", 2).groups()

    def rank(r: int) -> None:
        order = [dp[r], tp[r]] if (mismatched and r == 1) else [tp[r], dp[r]]
        for group in order:
            group.all_reduce(torch.ones(2))

    threads = [s.start_thread(partial(rank, r), f"rank{r}") for r in range(2)]
    for t in threads:
        t.join()


def set_device(s: DeterministicScheduler, raw: bool) -> None:
    runtime = FakeNpuRuntime(s)

    def worker(device: int) -> None:
        if raw:
            runtime.raw_set_device(device)
        else:
            runtime.framework_set_device(device)
        runtime.launch_on_stream(runtime.current_stream())

    threads = [s.start_thread(partial(worker, d), f"npu{d}") for d in range(2)]
    for t in threads:
        t.join()


def _config(
    tp: int, model: Path, kind: str, lanes: int, cache: CacheConfig | None = None
) -> EngineConfig:
    return EngineConfig(
        model=ModelLoadConfig(model=str(model)),
        cache=cache or CacheConfig(num_blocks=16),
        parallel=ParallelConfig(
            devices=",".join(f"{kind}:{i}" for i in range(tp)), single_process=tp > 1
        ),
        pipeline=PipelineConfig(max_concurrency=lanes),
    )


def _executor(
    s: DeterministicScheduler,
    tp: int,
    model: Path,
    runtime: FakeNpuRuntime | None = None,
    lanes: int = 1,
    share_communicator: bool = False,
    config: EngineConfig | None = None,
    registry: KernelRegistry[Any] | None = None,
) -> ThreadExecutor[ForwardInput, SamplerOutput]:
    kind = "npu" if runtime is not None else "cpu"
    config = config or _config(tp, model, kind, lanes)
    made: list[tuple[list[ProcessGroup], FakeBackend]] = []

    def fake_groups(size: int) -> tuple[list[ProcessGroup], FakeBackend]:
        if share_communicator and made:
            # The bug: every pipeline lane gets the same communicator.
            return made[0]
        backend = FakeBackend(s, f"tp{size}-set{len(made)}", size)
        made.append((list(backend.groups()), backend))
        return made[-1]

    return ThreadExecutor(
        config,
        LLMRunnerFactory(load_model_config(model)),
        resolve_topology(config.parallel),
        lanes=lanes > 1,
        sync=s,
        local_groups=fake_groups,
        runtime=runtime,
        # Not `or`: an empty registry is falsy (it has a length).
        kernel_registry=(
            registry
            if registry is not None
            else (KernelRegistry(s) if runtime is not None else None)
        ),
    )


def _real_executor(config: EngineConfig) -> ThreadExecutor[ForwardInput, SamplerOutput]:
    factory = LLMRunnerFactory(load_model_config(Path(config.model.model)))
    return ThreadExecutor(config, factory, resolve_topology(config.parallel), sync=REAL_SYNC)


def _model_runner(worker: Worker[ForwardInput, SamplerOutput]) -> ModelRunner:
    runner = worker.runner
    assert isinstance(runner, ModelRunner)
    return runner


def _step_input(
    prompt: tuple[int, ...] = (5, 17, 300, 42, 9, 100, 7), first_block: int = 0
) -> ForwardInput:
    seq = TokenSequence(
        "probe", list(prompt), SamplingParams.greedy(max_tokens=1), frozenset(), 512
    )
    manager = BlockManager(num_blocks=16, block_size=16, enable_prefix_cache=False)
    # Steps of different lanes write different blocks, as the scheduler guarantees.
    manager.reserve(first_block)
    manager.allocate(seq, len(prompt), cached=[])
    out = SchedulerOutput(scheduled=[ScheduledSequence(seq, len(prompt), samples=True)])
    return build_forward_input(out, block_size=16)


LANE_PROMPTS = ((5, 17, 300, 42, 9, 100, 7), (11, 3, 250, 8, 61))


@lru_cache(maxsize=1)
def _reference_tokens() -> tuple[int, ...]:
    model = tiny_model()
    config = EngineConfig(model=ModelLoadConfig(model=str(model)), cache=CacheConfig(num_blocks=16))
    executor = _real_executor(config)
    try:
        return tuple(
            executor.execute(_step_input(p, first_block=i)).token_ids[0]
            for i, p in enumerate(LANE_PROMPTS)
        )
    finally:
        executor.shutdown()


def tp_lanes(s: DeterministicScheduler, share_communicator: bool) -> None:
    """TP=2 with two pipeline lanes, one step on each at once. Each lane must have its own
    communicator set: with one shared, the lanes' collectives interleave in different orders
    on the two ranks (a mismatch or a deadlock the fake backend reports)."""
    runtime = FakeNpuRuntime(s)
    executor = _executor(
        s, 2, tiny_model(), runtime, lanes=2, share_communicator=share_communicator
    )
    try:
        steps = [
            executor.submit(i, _step_input(p, first_block=i)) for i, p in enumerate(LANE_PROMPTS)
        ]
        tokens = tuple(step.result().token_ids[0] for step in steps)
    finally:
        executor.shutdown()
    if tokens != _reference_tokens():
        raise AssertionError(
            f"lane steps sampled {tokens}, TP=1 one at a time {_reference_tokens()}"
        )


@lru_cache(maxsize=1)
def _reference_logits() -> torch.Tensor:
    model = tiny_model()
    config = EngineConfig(model=ModelLoadConfig(model=str(model)), cache=CacheConfig(num_blocks=16))
    executor = _real_executor(config)
    fi = _step_input()
    try:
        logits: torch.Tensor = executor.call(0, lambda w: _model_runner(w).prompt_logits(fi))
    finally:
        executor.shutdown()
    return logits


def tp_forward(s: DeterministicScheduler, tp: int) -> None:
    """The real single-process executor, its workers bound to the fake NPU runtime, runs one
    TP step on the fake collective backend; every kernel is registered once per device."""
    runtime = FakeNpuRuntime(s)
    executor = _executor(s, tp, tiny_model(), runtime)
    fi = _step_input()
    try:
        logits = executor.on_all(lambda w: _model_runner(w).prompt_logits(fi))
    finally:
        executor.shutdown()
    reference = _reference_logits()
    if not torch.allclose(logits[0], reference, atol=1e-5):
        raise AssertionError("TP logits differ from the TP=1 run")
    for device, launched in runtime.stream_log.items():
        # Both ranks run the same layers in the same order: their streams must agree.
        if launched != runtime.stream_log[0]:
            raise AssertionError(f"stream of npu:{device} ran kernels in another order")
    kernels = {name for name, _ in runtime.registered}
    if runtime.registrations != len(kernels) * tp:
        raise AssertionError(
            f"{runtime.registrations} registrations for {len(kernels)} kernels on {tp} devices"
        )


def rank_dies_mid_collective(s: DeterministicScheduler) -> None:
    """Rank 1 raises between two collectives of a step: every rank and the executor must end
    with an error; nothing may wait forever."""

    executor = _executor(s, 2, tiny_model())
    fi = _step_input()
    workers = executor.workers
    model = _model_runner(workers[1]).model
    assert isinstance(model, DecoderForCausalLM)
    layer = model.layers[1]
    real_forward = layer.forward

    def failing(*args: object, **kwargs: object) -> object:
        raise RuntimeError("rank 1 device fault")

    layer.forward = failing
    try:
        executor.on_all(lambda w: _model_runner(w).prompt_logits(fi))
    except EngineDeadError as exc:
        if "rank 1 device fault" not in str(exc) and "aborted" not in str(exc):
            raise AssertionError(f"the engine reported the wrong failure: {exc}") from exc
    else:
        raise AssertionError("a rank failed but the step succeeded")
    finally:
        layer.forward = real_forward
        executor.shutdown()


# KV pressure: three requests of 6 + 10 tokens need 4 blocks of 4 tokens each; the pool
# holds 8, so the running ones keep running out of room and must be preempted.
PRESSURE_PROMPTS = ((5, 17, 300, 42, 9, 100), (11, 3, 250, 8, 61, 7), (40, 41, 42, 43, 44, 45))
PRESSURE_PARAMS = SamplingParams.greedy(max_tokens=10, ignore_eos=True)
PRESSURE_CACHE = CacheConfig(block_size=4, num_blocks=8, enable_prefix_cache=False)


def _pressure_run(engine: LLMEngine, bound: int) -> dict[str, tuple[int, ...]]:
    """Every request to its end within ``bound`` steps; the tokens of each."""
    for i, prompt in enumerate(PRESSURE_PROMPTS):
        engine.add_request(f"p{i}", list(prompt), PRESSURE_PARAMS)
    ended: dict[str, tuple[int, ...]] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps > bound:
            raise AssertionError(
                f"livelock: no end after {bound} engine steps ({engine.watch.scheduler_state()})"
            )
        for out in engine.step():
            if out.finished:
                if out.request_id in ended:
                    raise AssertionError(f"{out.request_id} ended twice")
                if out.finish_reason != "length":
                    raise AssertionError(f"{out.request_id} ended with {out.error}")
                ended[out.request_id] = tuple(out.token_ids)
    return ended


@lru_cache(maxsize=1)
def _pressure_reference() -> dict[str, tuple[int, ...]]:
    engine = LLMEngine(_config(1, tiny_model(), "cpu", lanes=1, cache=PRESSURE_CACHE))
    try:
        return _pressure_run(engine, bound=10_000)
    finally:
        engine.shutdown()


def llm_lanes_kv_pressure(s: DeterministicScheduler, broken: bool) -> None:
    """The real LLM engine with two pipeline lanes under KV pressure: every request ends
    (each exactly once, within a bound on engine steps), tokens equal one step at a time,
    every block free at the end. The broken variant keeps the launch rule that livelocked."""
    config = _config(1, tiny_model(), "cpu", lanes=2, cache=PRESSURE_CACHE)
    executor = _executor(s, 1, tiny_model(), lanes=2, config=config)
    engine_class = DecodeOnlyEngine if broken else LLMEngine
    engine = engine_class(config, executor=executor, sync=s)
    try:
        tokens = _pressure_run(engine, bound=400)
        while engine.step() or engine.in_flight:
            pass
    finally:
        engine.shutdown()
    if engine.scheduler.num_preemptions == 0:
        raise AssertionError("nothing was preempted: the scenario lost its KV pressure")
    if tokens != _pressure_reference():
        raise AssertionError(f"tokens {tokens} differ from one step at a time")
    if engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
        raise AssertionError(f"{engine.block_manager.num_free_blocks} blocks free at the end")


# Two first requests prefilled in one step, then decoded on two pipeline lanes at once.
HYBRID_PROMPTS = ((5, 17, 300, 42, 9), (11, 3, 250, 8, 61, 7, 19))
HYBRID_PARAMS = SamplingParams.greedy(max_tokens=3, ignore_eos=True)
# Virtual seconds a kernel's first load compiles (triton-ascend: seconds on a real NPU).
COMPILE_S = 0.01
TRITON_PACKAGE = "tandem.core.kernels.triton."


def _hybrid_generate(engine: LLMEngine) -> tuple[tuple[int, ...], ...]:
    outs = engine.generate([list(p) for p in HYBRID_PROMPTS], HYBRID_PARAMS)
    for out in outs:
        if out.finish_reason != "length":
            raise AssertionError(f"{out.request_id} ended with {out.error}")
    return tuple(tuple(o.token_ids) for o in outs)


@lru_cache(maxsize=1)
def _hybrid_reference() -> tuple[tuple[int, ...], ...]:
    config = EngineConfig(model=ModelLoadConfig(model=str(tiny_hybrid())))
    engine = LLMEngine(replace(config, cache=CacheConfig(num_blocks=16)))
    try:
        return _hybrid_generate(engine)
    finally:
        engine.shutdown()


def hybrid_first_request(s: DeterministicScheduler, broken: bool) -> None:
    """The failing request of xLLM pull request #1894's review on its model family: the real
    engine serving a Qwen3.5 hybrid at TP=2 in one process on the fake NPU runtime, whose
    kernels compile on first use. What it registers are the Triton kernels themselves (run under
    Triton's interpreter), as triton-ascend's on an NPU, wherever Triton is installed. Both
    workers' first forward registers the linear-attention kernels (and the others) at once, each
    for its own device; then two decode batches run on the two pipeline lanes of every device,
    whose first decode kernels are the same keys, loaded by two lanes at once. Every (kernel,
    device) must be registered exactly once, tokens equal TP=1's (the CPU path). The broken
    variant uses that review's registry: the second lane reads a null stub or registers again
    (507028)."""
    runtime = FakeNpuRuntime(s, compile_s=COMPILE_S, kernel_families=("triton",))
    # Duck-typed: the workers only call get(key, register).
    registry = cast("KernelRegistry[Any]", UnsynchronizedRegistry(s) if broken else None)
    model = tiny_hybrid()
    config = _config(2, model, "npu", lanes=2, cache=CacheConfig(num_blocks=16))
    executor = _executor(s, 2, model, runtime, lanes=2, config=config, registry=registry)
    engine = LLMEngine(config, executor=executor, sync=s)
    try:
        tokens = _hybrid_generate(engine)
    finally:
        engine.shutdown()
    if tokens != _hybrid_reference():
        raise AssertionError(f"TP=2 lanes sampled {tokens}, TP=1 {_hybrid_reference()}")
    kernels = {name for name, _ in runtime.registered}
    linear = {"causal_conv1d_prefill", "causal_conv1d_update", "chunk_gated_delta_rule",
              "recurrent_gated_delta_rule", "rms_norm_gated"}  # fmt: skip
    if not linear <= kernels:
        raise AssertionError(f"linear-attention kernels never registered: {linear - kernels}")
    if triton_usable():
        untriton = sorted(
            name
            for (name, _), impl in runtime.loaded.items()
            if name in linear and not impl.__module__.startswith(TRITON_PACKAGE)
        )
        if untriton:
            raise AssertionError(f"registered without their Triton kernels: {untriton}")
    if runtime.registrations != len(kernels) * 2:
        raise AssertionError(
            f"{runtime.registrations} registrations for {len(kernels)} kernels on 2 devices"
        )
    stats = engine.stats
    if stats.num_free_state_slots != stats.num_state_slots or stats.num_state_slots == 0:
        raise AssertionError(f"state slots not all returned: {stats}")


def _expect(staged: Staged, value: float, what: str) -> None:
    if not torch.equal(staged.tensors[0], torch.full((4,), value)):
        raise AssertionError(f"{what}: {staged.tensors[0].tolist()} != {value}")


def _run_lanes(
    s: DeterministicScheduler, stagers: list[LaneStager], streams: list[TaskThread]
) -> None:
    """Each lane's host thread stages a step of its own values, launches a kernel that reads
    them on the lane's stream, and gives the scratch back at once (no synchronize)."""

    def lane(i: int) -> None:
        launched: list[Promise[None]] = []
        for step in range(1):
            value = float(10 * i + step)
            staged = stagers[i].stage([torch.full((4,), value)])
            _expect(staged, value, "the host staged another lane's inputs")

            def kernel(staged: Staged = staged, value: float = value) -> None:
                s.yield_point("kernel.read")
                staged.check()
                _expect(staged, value, "a stream read another step's inputs")

            launched.append(streams[i].submit(kernel))
            stagers[i].release(staged)
        for promise in launched:
            promise.result()

    try:
        threads = [s.start_thread(partial(lane, i), f"host{i}") for i in range(len(stagers))]
        for t in threads:
            t.join()
    finally:
        for stream in streams:
            stream.stop()


def stream_workspace_reuse(s: DeterministicScheduler, record: bool) -> None:
    allocator = ScratchAllocator(torch.device("cpu"), s)
    streams = [TaskThread(f"stream{i}", s) for i in range(2)]
    kind = LaneStager if record else UnrecordedStager
    _run_lanes(s, [kind(allocator, stream, s) for stream in streams], streams)


def shared_cache_across_streams(s: DeterministicScheduler, shared: bool) -> None:
    """Two lanes' host threads stage at once; what each staged must be its own. (The lanes'
    streams are not driven here: the race is on the host, before any launch, and leaving
    them out keeps the schedule tree small enough for exhaustive search.)"""
    allocator = ScratchAllocator(torch.device("cpu"), s)
    streams = [_IdleStream(), _IdleStream()]
    if shared:
        # xLLM pull request #1453: one static cache that every pipeline stages into.
        one = LaneStager(allocator, streams[0], s)
        stagers = [one, one]
    else:
        stagers = [LaneStager(allocator, stream, s) for stream in streams]

    def lane(i: int) -> None:
        value = float(i + 1)
        staged = stagers[i].stage([torch.full((4,), value)])
        _expect(staged, value, "the host staged another lane's inputs")
        stagers[i].release(staged)

    threads = [s.start_thread(partial(lane, i), f"host{i}") for i in range(2)]
    for t in threads:
        t.join()


class _IdleStream:
    """A stream with nothing queued: its events are always done."""

    def record_event(self) -> Promise[None]:
        done: Promise[None] = Promise(REAL_SYNC)
        done.set_result(None)
        return done


SCENARIOS: dict[str, ScenarioSpec] = {
    spec.name: spec
    for spec in [
        ScenarioSpec("registry_race_unsynchronized", partial(registry_race, broken=True),
                     "xLLM PR #1894 review: racing first registration, 507028, erased entry, "
                     "null stub",
                     broken=True),
        ScenarioSpec("registry_race", partial(registry_race, broken=False),
                     "the same first-use race on the shipped KernelRegistry", broken=False),
        ScenarioSpec("two_groups_mismatched_order", partial(two_groups, mismatched=True),
                     "xLLM PR #1894: two groups in one process issuing in different orders",
                     broken=True),
        ScenarioSpec("two_groups_ordered", partial(two_groups, mismatched=False),
                     "the same two groups, every rank in one order", broken=False),
        ScenarioSpec("raw_set_device", partial(set_device, raw=True),
                     "xLLM PR #1894: aclrtSetDevice leaves torch_npu's cached device stale",
                     broken=True),
        ScenarioSpec("framework_set_device", partial(set_device, raw=False),
                     "binding through the framework's setter", broken=False),
        ScenarioSpec("tp_forward", partial(tp_forward, tp=2),
                     "the real single-process executor, TP=2 step on the fake backend",
                     broken=False),
        ScenarioSpec("tp_forward_4", partial(tp_forward, tp=4),
                     "the same with TP=4", broken=False),
        ScenarioSpec("rank_dies_mid_collective", rank_dies_mid_collective,
                     "a rank raises inside a step: errors everywhere, no hang", broken=False),
        ScenarioSpec("tp_lanes_shared_communicator", partial(tp_lanes, share_communicator=True),
                     "two pipeline lanes issuing TP collectives on one communicator",
                     broken=True),
        ScenarioSpec("tp_lanes", partial(tp_lanes, share_communicator=False),
                     "TP=2, two lanes, a communicator set per lane: steps at once, TP=1 tokens",
                     broken=False),
        ScenarioSpec("llm_lanes_kv_pressure_decode_only", partial(llm_lanes_kv_pressure,
                     broken=True), "decode-only launches with nothing in flight never "
                     "preempt: the engine spins once no sequence has room", broken=True),
        ScenarioSpec("llm_lanes_kv_pressure", partial(llm_lanes_kv_pressure, broken=False),
                     "the LLM engine, two lanes, KV pressure: every request ends, tokens as "
                     "one step at a time", broken=False),
        ScenarioSpec("hybrid_first_request_unsynchronized", partial(hybrid_first_request,
                     broken=True), "xLLM PR #1894 review on Qwen3.5: two lanes of a device load "
                     "the same first decode kernels at once through that review's registry",
                     broken=True),
        ScenarioSpec("hybrid_first_request", partial(hybrid_first_request, broken=False),
                     "a Qwen3.5 hybrid's first requests, TP=2 and two lanes: each kernel "
                     "registered once per device, tokens equal TP=1", broken=False),
        ScenarioSpec("stream_workspace_reuse_unrecorded", partial(stream_workspace_reuse,
                     record=False), "xLLM PR #1453: scratch freed without record_stream, reused "
                     "while a stream reads it", broken=True),
        ScenarioSpec("stream_workspace_reuse", partial(stream_workspace_reuse, record=True),
                     "scratch recorded on the stream that reads it", broken=False),
        ScenarioSpec("shared_cache_across_streams_static", partial(shared_cache_across_streams,
                     shared=True), "xLLM PR #1453: one staging cache shared by every pipeline",
                     broken=True),
        ScenarioSpec("shared_cache_across_streams", partial(shared_cache_across_streams,
                     shared=False), "each pipeline lane stages through its own cache",
                     broken=False),
        ScenarioSpec("engine_lifecycle", engine_lifecycle, "the whole LLM engine, TP=2: "
                     "arrivals, aborts, preemption; every request ends once, every block free, "
                     "tokens as alone", broken=False),
        ScenarioSpec("engine_lifecycle_rank_fails", partial(engine_lifecycle,
                     faults=RANK_FAULT), "the same with rank 1's collective failing mid-step: "
                     "every request fails naming rank 1, at once, nothing blocked",
                     broken=False),
        ScenarioSpec("engine_lifecycle_hybrid", partial(engine_lifecycle, hybrid=True),
                     "the same with a Qwen3.5 hybrid and 3 state slots for 4 requests: every "
                     "state slot free too", broken=False),
        ScenarioSpec("engine_lifecycle_abort_leaks_blocks", partial(engine_lifecycle,
                     engine_class=LeakyAbortEngine), "an abort that forgets the request's KV "
                     "blocks", broken=True),
        ScenarioSpec("engine_lifecycle_no_communicator_abort", partial(engine_lifecycle,
                     faults=RANK_FAULT, executor_class=NoAbortExecutor), "a failure path that "
                     "skips the communicator abort: the other rank waits out the timeout",
                     broken=True),
        ScenarioSpec("rec_lifecycle", rec_lifecycle, "the whole recommender, TP=2, two lanes, "
                     "requests waiting for blocks: every request answered once, every block, "
                     "lane and lane state free, results as alone", broken=False),
        ScenarioSpec("rec_lifecycle_rank_fails", partial(rec_lifecycle, faults=REC_FAULT),
                     "the same with rank 1's collective failing mid-step", broken=False),
        ScenarioSpec("rec_lifecycle_failure_forgets_batches", partial(rec_lifecycle,
                     faults=REC_FAULT, engine_class=FailureForgetsBatchesEngine),
                     "a failure that forgets the batches in flight", broken=True),
    ]
}  # fmt: skip
