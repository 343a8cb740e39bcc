"""TP=2 in one process: greedy tokens equal TP=1, and nothing on the path is serialized."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import ParallelConfig
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.executor.transport import ShmBroadcastWriter
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput

PROMPTS = ["hello world", "the model reads the prompt in order", "λ"]


def test_single_process_never_serializes(
    demo_dir: Path, make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("serialization or a transport on the single-process path")

    for cls in (ForwardInput, SamplerOutput):
        monkeypatch.setattr(cls, "__reduce_ex__", refuse, raising=False)
        monkeypatch.setattr(cls, "__reduce__", refuse, raising=False)
        monkeypatch.setattr(cls, "__getstate__", refuse, raising=False)
    monkeypatch.setattr(ShmBroadcastWriter, "__init__", refuse)
    seen: list[ForwardInput] = []
    real_execute = ThreadExecutor.execute

    def recording(self: ThreadExecutor[ForwardInput, SamplerOutput], fi: ForwardInput) -> Any:
        seen.append(fi)
        return real_execute(self, fi)

    monkeypatch.setattr(ThreadExecutor, "execute", recording)

    params = SamplingParams.greedy(max_tokens=16, ignore_eos=True)
    tp1 = [o.token_ids for o in make_engine(demo_dir).generate(PROMPTS, params)]
    engine = make_engine(
        demo_dir, parallel=ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    )
    assert isinstance(engine.executor, ThreadExecutor)
    assert [w.group.size for w in engine.executor.workers] == [2, 2]
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == tp1

    # The guard is live: serializing one of those step inputs really would have failed.
    assert seen
    with pytest.raises(AssertionError, match="serialization"):
        pickle.dumps(seen[-1])


def test_a_failing_rank_kills_the_engine_without_hanging(
    demo_dir: Path, make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(
        demo_dir, parallel=ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    )
    executor = engine.executor
    assert isinstance(executor, ThreadExecutor)
    runner = executor.workers[1].runner

    def broken(fi: ForwardInput, state: object) -> SamplerOutput | None:
        raise RuntimeError("rank 1 device fault")

    monkeypatch.setattr(runner, "execute", broken)
    engine.add_request("a", "hello", SamplingParams.greedy(max_tokens=4))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    assert "rank 1 device fault" in (outs[0].error or "")
    assert engine.dead is not None
