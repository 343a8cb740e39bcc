"""A logits processor that raises (in add, apply or on_sampled) fails the requests it serves,
alone: the step's other rows are sampled as without it, every block and slot comes back, and
the engine serves on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import PipelineConfig, SpeculativeConfig
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.llm import logits_processors, sampling_rows
from tandem.core.llm import sampler as sampler_module
from tandem.core.llm.forward_input import DraftRows, ForwardInput, SamplerOutput, SamplingBatch
from tandem.core.llm.input_processor import Prompt
from tandem.core.llm.logits_processor import (
    AddedRow,
    BatchUpdate,
    LogitsProcessor,
    ProcessorContext,
    StepRows,
)
from tandem.core.llm.logits_processors import BUILTIN_PROCESSORS, LogitBias, LogitsProcessors
from tandem.core.llm.model_runner import ModelRunner
from tandem.core.llm.outputs import RequestOutput
from tandem.core.llm.sampler import Sampler
from tandem.core.worker.worker import Worker

VOCAB = 24
TRIGGER = 4242  # the seed that makes a request use the failing processor


class _Failing(LogitsProcessor):
    """Serves the requests seeded TRIGGER, and raises in ``fail_in`` every time it is called
    there (a processor that keeps failing)."""

    fail_in: ClassVar[str] = "apply"
    calls: ClassVar[int] = 0
    # Fails only in steps of at least this many rows (with drafts: positions verified).
    min_rows: ClassVar[int] = 0

    @classmethod
    def uses(cls, params: SamplingParams) -> bool:
        return params.seed == TRIGGER

    def _maybe_fail(self, method: str, num_rows: int = 0) -> None:
        if method == self.fail_in and num_rows >= self.min_rows:
            type(self).calls += 1
            raise RuntimeError(f"boom in {method}")

    def add(self, slot: int, row: AddedRow) -> None:
        self._maybe_fail("add")

    def apply(self, logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        self._maybe_fail("apply", rows.num_rows)
        if self.fail_in == "shape":
            return logits[:1]
        # Its edit, were it kept, would change its rows' tokens: -inf on the argmax.
        index = rows.rows_on(logits.device)
        logits[index] = logits[index].scatter(
            1, logits[index].argmax(dim=1, keepdim=True), float("-inf")
        )
        return logits

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None:
        self._maybe_fail("on_sampled")

    def remove(self, slot: int) -> None:
        self._maybe_fail("remove")


def _batch(n: int, slots: list[int], update: BatchUpdate | None) -> SamplingBatch:
    slot_tensor = torch.tensor(slots, dtype=torch.int64)
    return replace(SamplingBatch.uniform(n), slots=slot_tensor, update=update)


def _row(slot: int, **params: object) -> AddedRow:
    return AddedRow(slot, SamplingParams(**params), frozenset({2}), 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("fail_in", ["add", "apply", "shape", "on_sampled"])
def test_the_sampler_fails_only_the_rows_of_the_failing_processor(
    fail_in: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Failing, "fail_in", fail_in)
    monkeypatch.setattr(_Failing, "calls", 0)
    ctx = ProcessorContext(VOCAB, torch.device("cpu"), 8)
    sampler = Sampler(0, LogitsProcessors(ctx, classes=(*BUILTIN_PROCESSORS, _Failing)))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    # Row 0 is biased by a built-in, row 2 uses the failing processor, rows 1 and 3 nothing.
    update = BatchUpdate(added=(_row(0, logit_bias={5: 100.0}), _row(1, seed=TRIGGER)))
    out = sampler(logits, _batch(4, [0, -1, 1, -1], update))
    assert out.failed is not None and list(out.failed) == [2]
    message = out.failed[2]
    method = "apply" if fail_in == "shape" else fail_in
    assert f"the logits processor _Failing ({__name__}) failed in {method}" in message
    assert ("ValueError" if fail_in == "shape" else f"RuntimeError: boom in {method}") in message
    # The other rows as the model has them, bar the built-in's bias.
    expected = logits.argmax(dim=1).tolist()
    expected[0] = 5
    assert [t for i, t in enumerate(out.token_ids) if i != 2] == [
        t for i, t in enumerate(expected) if i != 2
    ]
    # The slot stays failed, off in every processor, on later steps too, and is called no
    # more; its removal forgets it and a new row takes it afresh.
    calls = _Failing.calls
    again = sampler(logits, _batch(4, [0, -1, 1, -1], None))
    assert again.failed == out.failed and _Failing.calls == calls
    update = BatchUpdate(removed=(1,), added=(_row(1, seed=TRIGGER),))
    monkeypatch.setattr(_Failing, "fail_in", "nowhere")
    fresh = sampler(logits[1:2], _batch(1, [1], update))
    # The processor serves the slot's new row again: its edit bans the row's argmax.
    assert fresh.failed is None and fresh.token_ids != [int(logits[1].argmax())]
    assert sampler.processors is not None and not sampler.processors.failed


def test_a_failing_remove_is_logged_and_the_slot_taken_afresh(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its row has left the batch already: nothing fails, and the slot's next row is served."""
    monkeypatch.setattr(_Failing, "fail_in", "remove")
    ctx = ProcessorContext(VOCAB, torch.device("cpu"), 8)
    sampler = Sampler(0, LogitsProcessors(ctx, classes=(*BUILTIN_PROCESSORS, _Failing)))
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    first = sampler(logits, _batch(1, [0], BatchUpdate(added=(_row(0, seed=TRIGGER),))))
    update = BatchUpdate(removed=(0,), added=(_row(0, seed=TRIGGER),))
    second = sampler(logits, _batch(1, [0], update))
    assert first.failed is None and second.failed is None
    assert second.token_ids == first.token_ids != [int(logits[0].argmax())]
    assert "_Failing failed to remove slot 0" in caplog.text


def test_a_failed_row_is_named_by_its_sequence_in_a_step_with_drafts() -> None:
    ctx = ProcessorContext(VOCAB, torch.device("cpu"), 8)
    sampler = Sampler(0, LogitsProcessors(ctx, classes=(*BUILTIN_PROCESSORS, _Failing)))
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(9))
    argmax = logits.argmax(dim=1).tolist()
    # Sequence 0 verifies two drafts (both the model's argmax: accepted), sequence 1 none
    # and fails, sequence 2 none.
    batch = replace(
        _batch(5, [-1, -1, -1, 0, -1], BatchUpdate(added=(_row(0, seed=TRIGGER),))),
        drafts=DraftRows(num_drafts=(2, 0, 0), token_ids=(argmax[0], argmax[1])),
    )
    out = sampler(logits, batch)
    assert out.failed is not None and list(out.failed) == [1]
    assert out.num_accepted == [2, 0, 0]
    assert [out.token_ids[0], out.token_ids[2]] == [argmax[2], argmax[4]]


def test_a_failing_processor_leaves_the_logits_the_others_see_untouched() -> None:
    """Applied after a processor that edits in place, the failed one's partial edit is not
    kept: the step is sampled again from the model's logits."""

    class _EditsThenFails(_Failing):
        def apply(self, logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
            logits[:, 0] = 1e9  # every row, in place, then fails
            raise RuntimeError("half done")

    ctx = ProcessorContext(VOCAB, torch.device("cpu"), 8)
    sampler = Sampler(0, LogitsProcessors(ctx, classes=(LogitBias, _EditsThenFails)))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[:, 0] = -10.0
    update = BatchUpdate(added=(_row(0, logit_bias={7: 50.0}), _row(1, seed=TRIGGER)))
    out = sampler(logits, _batch(3, [0, 1, -1], update))
    assert out.failed is not None and set(out.failed) == {1}
    assert out.token_ids[0] == 7 and out.token_ids[2] == int(logits[2].argmax())


# -- through the engine ------------------------------------------------------------------


def _with_failing(monkeypatch: pytest.MonkeyPatch, fail_in: str) -> None:
    """The failing processor registered as a plugin would be, for engines built after."""
    monkeypatch.setattr(_Failing, "fail_in", fail_in)
    monkeypatch.setattr(_Failing, "calls", 0)
    classes = (*BUILTIN_PROCESSORS, _Failing)
    monkeypatch.setattr(logits_processors, "processor_classes", lambda: classes)
    monkeypatch.setattr(sampling_rows, "processor_classes", lambda: classes)


def _worker_failed_slots(engine: LLMEngine) -> bool:
    executor = engine.executor
    assert isinstance(executor, ThreadExecutor)

    def failed(worker: Worker[ForwardInput, SamplerOutput]) -> bool:
        runner = worker.runner
        assert isinstance(runner, ModelRunner) and runner.sampler is not None
        assert runner.sampler.processors is not None
        return bool(runner.sampler.processors.failed)

    return bool(executor.call(0, failed))


# Token ids that repeat themselves, so that n-grams find drafts in the prompt at once.
PROMPTS: list[Prompt] = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [40, 41, 42, 43, 40, 41, 42],
    [100, 3, 200, 3, 100, 3, 200],
    [11, 12, 13, 11, 12],
]
GOOD = [
    SamplingParams.greedy(max_tokens=6),
    SamplingParams.greedy(max_tokens=5, logit_bias={11: 3.0}),
    SamplingParams.greedy(max_tokens=6, repetition_penalty=1.3, min_tokens=2),
]


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(out.token_ids) for out in outputs]


def _num_drafts(engine: LLMEngine) -> int:
    return 0 if engine.spec_stats is None else engine.spec_stats.num_drafts


def _check_request_fails_alone(engine: LLMEngine, fail_in: str) -> int:
    """Runs the checks; how many drafts the run with the failing request verified."""
    baseline = _tokens(engine.generate(PROMPTS[:3], GOOD))
    drafts = _num_drafts(engine)
    bad = SamplingParams.greedy(max_tokens=12, seed=TRIGGER)
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[2]]
    outputs = engine.generate(prompts, [GOOD[0], bad, GOOD[1], GOOD[2]])
    failed = outputs[1]
    assert failed.finished and failed.finish_reason == "error"
    assert failed.error is not None
    assert f"the logits processor _Failing ({__name__}) failed in {fail_in}" in failed.error
    assert f"RuntimeError: boom in {fail_in}" in failed.error
    assert _tokens([outputs[0], outputs[2], outputs[3]]) == baseline
    assert all(o.finish_reason == "length" for o in (outputs[0], outputs[2], outputs[3]))
    drafts = _num_drafts(engine) - drafts
    # The engine serves on; a plain step afterwards frees the failed row's slot.
    assert engine.dead is None
    engine.check_health()
    assert _tokens(engine.generate(PROMPTS[:1], GOOD[0])) == baseline[:1]
    assert engine.sampling_rows.num_held == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not _worker_failed_slots(engine)
    return drafts


@pytest.mark.parametrize("fail_in", ["add", "apply", "on_sampled"])
def test_a_failing_processor_fails_its_request_alone(
    fail_in: str,
    demo_dir: Path,
    make_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _with_failing(monkeypatch, fail_in)
    engine = make_engine(demo_dir)
    _check_request_fails_alone(engine, fail_in)


def test_a_failing_processor_beside_drafted_rows(
    demo_dir: Path, make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With speculative decoding the failing request (given no drafts) fails alone too, and
    the drafted rows of its steps keep the tokens they have without it."""
    _with_failing(monkeypatch, "apply")
    # The request fails in a step that verifies drafts (more rows than the batch's four
    # sequences): its row is named by its sequence.
    monkeypatch.setattr(_Failing, "min_rows", len(PROMPTS) + 1)
    original = sampler_module._by_sequence
    in_verify: list[dict[int, str]] = []

    def by_sequence(failed: dict[int, str], drafts: DraftRows) -> dict[int, str]:
        in_verify.append(failed)
        return original(failed, drafts)

    monkeypatch.setattr(sampler_module, "_by_sequence", by_sequence)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    engine = make_engine(demo_dir, speculative=spec)
    assert _check_request_fails_alone(engine, "apply") > 0
    assert in_verify


@pytest.mark.parametrize("fail_in", ["apply", "on_sampled"])
@pytest.mark.parametrize(
    "pipeline",
    [PipelineConfig(max_concurrency=2), PipelineConfig(overlap_steps=True)],
    ids=["two-lanes", "launch-ahead"],
)
def test_a_failing_processor_beside_steps_in_flight(
    fail_in: str,
    pipeline: PipelineConfig,
    demo_dir: Path,
    make_engine: Callable[..., LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps still in flight when a request fails (lanes, a step launched ahead) name its
    slot: their rows of it are failed too, never used, and its blocks wait for them."""
    _with_failing(monkeypatch, fail_in)
    engine = make_engine(demo_dir, pipeline=pipeline)
    _check_request_fails_alone(engine, fail_in)
