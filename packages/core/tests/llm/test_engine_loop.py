"""The background engine loop and its asyncio face: streaming, concurrency, aborts."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.core import (
    AsyncEngine,
    EngineLoop,
    InvalidRequestError,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)


def test_streams_match_offline_generation(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    prompts = ["hello world", "the model reads", "λ"]
    params = SamplingParams.greedy(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in make_engine(demo_dir).generate(prompts, params)]
    loop = EngineLoop(make_engine(demo_dir))
    aengine = AsyncEngine(loop)

    async def one(prompt: str) -> tuple[list[int], str, RequestOutput]:
        ids: list[int] = []
        text = ""
        last = None
        async for out in aengine.generate(prompt, params):
            ids += out.new_token_ids
            text += out.delta_text
            last = out
        assert last is not None
        return ids, text, last

    async def main() -> list[tuple[list[int], str, RequestOutput]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        results = asyncio.run(main())
    finally:
        loop.stop()
    for (ids, text, last), want in zip(results, expected, strict=True):
        assert ids == want == last.token_ids
        assert text == last.text
        assert last.finished and last.metrics is not None
        m = last.metrics
        assert m.first_token_time is not None and m.finished_time is not None
        assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_leaving_a_stream_early_aborts_and_frees_blocks(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir)
    loop = EngineLoop(engine)
    aengine = AsyncEngine(loop)

    async def main() -> int:
        seen = 0
        gen = aengine.generate("hello", SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()
        return seen

    try:
        assert asyncio.run(main()) == 3
        for _ in range(100):
            if not engine.has_unfinished():
                break
            threading.Event().wait(0.05)
        assert not engine.has_unfinished()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        loop.stop()


def test_bad_request_raises_on_the_callers_thread(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    loop = EngineLoop(make_engine(demo_dir))
    try:
        with pytest.raises(InvalidRequestError):
            loop.submit([], SamplingParams(), callback=lambda out: None)
        done = threading.Event()
        outs: list[RequestOutput] = []

        def collect(out: RequestOutput) -> None:
            outs.append(out)
            if out.finished:
                done.set()

        loop.submit("hello", SamplingParams.greedy(max_tokens=4), callback=collect)
        assert done.wait(30)
        assert outs[-1].finish_reason == "length"
    finally:
        loop.stop()


def test_outputs_posted_together_wake_the_event_loop_once_and_keep_their_order() -> None:
    from tandem.core.llm.engine_loop import _Mailbox
    from tandem.core.llm.outputs import RequestOutput

    def output(request: str, n: int) -> RequestOutput:
        return RequestOutput(
            request_id=request, prompt_token_ids=[1], token_ids=list(range(n + 1)), text="",
            new_token_ids=[n], delta_text="", finished=False,
        )  # fmt: skip

    async def scenario() -> tuple[int, dict[str, list[int]]]:
        aio = asyncio.get_running_loop()
        wakeups = 0
        schedule = aio.call_soon_threadsafe

        def counting(*args: object) -> object:
            nonlocal wakeups
            wakeups += 1
            return schedule(*args)  # type: ignore[arg-type]

        aio.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
        mailbox = _Mailbox(aio)
        queues = {name: asyncio.Queue[RequestOutput]() for name in ("a", "b", "c")}

        def engine_step() -> None:
            # One step's outputs, posted from the engine thread while the loop is busy.
            for n in range(5):
                for name, queue in queues.items():
                    mailbox.post(queue, output(name, n))

        worker = threading.Thread(target=engine_step)
        worker.start()
        worker.join()
        got = {
            name: [(await queue.get()).new_token_ids[0] for _ in range(5)]
            for name, queue in queues.items()
        }
        return wakeups, got

    wakeups, got = asyncio.run(scenario())
    assert wakeups == 1
    assert got == {name: [0, 1, 2, 3, 4] for name in ("a", "b", "c")}
