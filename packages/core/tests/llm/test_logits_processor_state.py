"""The logits processors' batch state: the engine's slots (taken on a row's first sample,
freed only in a step with nothing else in flight, reused only once no step can still name
them), and processors whose state, kept across steps as rows come, finish, are preempted and
resume, edits the logits exactly as one built afresh from the rows' tokens would."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from tandem.core import LLMEngine, SamplingParams
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput, SamplingBatch
from tandem.core.llm.logits_processor import (
    AddedRow,
    BatchUpdate,
    LogitsProcessor,
    ProcessorContext,
    StepRows,
)
from tandem.core.llm.logits_processors import BUILTIN_PROCESSORS, LogitsProcessors, MinTokens
from tandem.core.llm.model_runner import ModelRunner
from tandem.core.llm.sampler import Sampler
from tandem.core.llm.sampling_rows import SamplingRows
from tandem.core.llm.sequence import SequenceStatus, TokenSequence
from tandem.core.worker.worker import Worker

VOCAB = 24
EOS = 2


def _seq(name: str, prompt: list[int], **params: object) -> TokenSequence:
    seq = TokenSequence(
        request_id=name,
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=64, **params),  # type: ignore[arg-type]
        eos_token_ids=frozenset({EOS}),
        max_total_tokens=512,
    )
    seq.status = SequenceStatus.RUNNING
    return seq


def _slots(rows: SamplingRows, seqs: list[TokenSequence], alone: bool = True) -> list[int]:
    slots, _ = rows.assign(seqs, alone)
    return [] if slots is None else slots.tolist()


def test_rows_without_a_processor_take_no_slot() -> None:
    rows = SamplingRows(4)
    slots, update = rows.assign([_seq("a", [1, 2]), _seq("b", [3], temperature=0.5)], True)
    assert slots is None and update is None and rows.num_held == 0


def test_a_row_takes_a_slot_once_and_carries_its_tokens() -> None:
    rows = SamplingRows(4)
    plain, penalized = _seq("a", [1]), _seq("b", [6, 5, 6], repetition_penalty=1.2)
    penalized.token_ids.append(9)
    slots, update = rows.assign([plain, penalized], True)
    assert slots is not None and slots.tolist() == [-1, 0]
    assert update is not None and update.removed == ()
    [added] = update.added
    assert added.slot == 0 and added.num_output_tokens == 1
    # The repetition penalty reads which tokens the prompt holds, not their order.
    assert added.prompt_token_ids is not None and added.prompt_token_ids.tolist() == [5, 6]
    assert added.output_token_ids is not None and added.output_token_ids.tolist() == [9]
    # The next step names the same slot and changes nothing.
    slots, update = rows.assign([penalized, plain], True)
    assert slots is not None and slots.tolist() == [0, -1] and update is None
    # Presence and frequency penalties read the output only: the prompt stays behind.
    _, update = rows.assign([_seq("d", [7, 8], presence_penalty=1.0)], True)
    assert update is not None and update.added[0].prompt_token_ids is None
    assert update.added[0].output_token_ids is not None
    # min_p needs no tokens: none are copied for it.
    _, update = rows.assign([_seq("c", [1], temperature=1.0, min_p=0.1)], True)
    assert update is not None and update.added[0].prompt_token_ids is None


def test_a_finished_row_is_freed_only_in_a_step_built_alone() -> None:
    rows = SamplingRows(4)
    a, b = _seq("a", [1], min_tokens=3), _seq("b", [1], min_tokens=3)
    assert _slots(rows, [a, b]) == [0, 1]
    a.status = SequenceStatus.FINISHED
    c = _seq("c", [1], min_tokens=3)
    # Beside a step in flight (which may still name slot 0), a new row takes a fresh slot.
    slots, update = rows.assign([b, c], alone=False)
    assert slots is not None and slots.tolist() == [1, 2]
    assert update is not None and update.removed == ()
    # Alone: slot 0 is removed, and taken by a row added in that same step.
    d = _seq("d", [1], min_tokens=3)
    slots, update = rows.assign([d, b], alone=True)
    assert slots is not None and slots.tolist() == [0, 1]
    assert update is not None and update.removed == (0,) and update.added[0].slot == 0


def test_a_slot_freed_beside_later_steps_waits_for_the_next_lone_step() -> None:
    rows = SamplingRows(4)
    a, b = _seq("a", [1], min_tokens=3), _seq("b", [1], min_tokens=3)
    assert _slots(rows, [a, b]) == [0, 1]
    a.status = SequenceStatus.FINISHED
    # Removed here; nothing takes it in this step.
    _, update = rows.assign([b], alone=True)
    assert update is not None and update.removed == (0,)
    # A step launched beside that one may run first: slot 0 is not taken again yet.
    c = _seq("c", [1], min_tokens=3)
    assert _slots(rows, [b, c], alone=False) == [1, 2]
    # Once a step is built alone (everything before it has completed), it is.
    assert _slots(rows, [_seq("d", [1], min_tokens=3)], alone=True) == [0]


def test_a_preempted_row_resumes_in_a_fresh_slot_with_its_tokens() -> None:
    rows = SamplingRows(4)
    seq = _seq("a", [1, 2], frequency_penalty=0.5)
    assert _slots(rows, [seq]) == [0]
    seq.token_ids += [7, 8]
    seq.num_preemptions += 1  # preempted, then admitted again before this step
    slots, update = rows.assign([seq], alone=True)
    assert slots is not None and slots.tolist() == [0]
    assert update is not None and update.removed == (0,)
    [added] = update.added
    assert added.output_token_ids is not None and added.output_token_ids.tolist() == [7, 8]
    assert added.num_output_tokens == 2


def test_running_out_of_slots_changes_nothing() -> None:
    rows = SamplingRows(1)
    a, b = _seq("a", [1], min_tokens=2), _seq("b", [1], min_tokens=2)
    with pytest.raises(RuntimeError, match="slots are held"):
        rows.assign([a, b], True)
    assert rows.num_held == 0
    assert _slots(rows, [b]) == [0]


def test_an_update_reaches_the_processors_on_a_step_that_samples_nothing() -> None:
    processors = LogitsProcessors(ProcessorContext(VOCAB, torch.device("cpu"), 2))
    sampler = Sampler(0, processors)
    row = AddedRow(1, SamplingParams(min_tokens=3), frozenset({EOS}), 0)
    sampler.update(_batch(0, update=BatchUpdate(added=(row,))))
    min_tokens = next(p for p in processors.processors if isinstance(p, MinTokens))
    assert min_tokens.active.tolist() == [False, True]
    sampler.update(_batch(0, update=BatchUpdate(removed=(1,))))
    assert min_tokens.active.tolist() == [False, False]


def _batch(n: int, **kw: object) -> SamplingBatch:
    fields: dict[str, object] = {
        "temperatures": torch.zeros(n),
        "top_p": torch.ones(n),
        "top_k": torch.zeros(n, dtype=torch.int64),
        "seeds": (None,) * n,
        "steps": (0,) * n,
        "all_greedy": True,
        "needs_top_k_top_p": False,
        "max_logprobs": None,
    }
    fields.update(kw)
    return SamplingBatch(**fields)  # type: ignore[arg-type]


_PARAMS: list[dict[str, object]] = [
    {},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.7, "repetition_penalty": 1.6},
    {"repetition_penalty": 0.6, "presence_penalty": -0.5},
    {"min_tokens": 4, "logit_bias": {EOS: 6.0}},
    {"logit_bias": {3: 2.5, 4: -1.0, 5: 1.0}, "frequency_penalty": 0.3},
    {"min_tokens": 2, "stop_token_ids": [6, 7], "logit_bias": {6: 4.0}},
]


def _fresh_tokens(seqs: list[TokenSequence], logits: torch.Tensor) -> list[int]:
    """Greedy tokens with every row's processors built afresh from its tokens."""
    processors = LogitsProcessors(ProcessorContext(VOCAB, torch.device("cpu"), len(seqs)))
    added = tuple(
        AddedRow(
            i, seq.params, seq.eos_token_ids, seq.num_output_tokens,
            torch.tensor(seq.prompt_token_ids, dtype=torch.int64),
            torch.tensor(seq.output_token_ids, dtype=torch.int64),
        )
        for i, seq in enumerate(seqs)
    )  # fmt: skip
    batch = _batch(len(seqs), slots=torch.arange(len(seqs)), update=BatchUpdate(added=added))
    return Sampler(0, processors)(logits, batch).token_ids


@pytest.mark.parametrize("seed", range(4))
def test_state_kept_across_steps_equals_state_built_afresh(seed: int) -> None:
    """Rows join, sample in shuffled orders, finish mid-batch (their slots taken by others),
    sit out steps, and are preempted and resume; each step's greedy tokens equal those of
    processors built afresh from every row's tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows = SamplingRows(6)
    sampler = Sampler(0, LogitsProcessors(ProcessorContext(VOCAB, torch.device("cpu"), 6)))
    live: list[TokenSequence] = []
    made = 0
    for _ in range(40):
        while len(live) < 5 and rng.random() < 0.6:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
            live.append(_seq(f"r{made}", prompt, **rng.choice(_PARAMS)))
            made += 1
        if not live:
            continue
        step = rng.sample(live, rng.randrange(1, len(live) + 1))
        for seq in step:
            if rng.random() < 0.1:
                seq.num_preemptions += 1
        logits = torch.randn(len(step), VOCAB, generator=gen) * 2
        slots, update = rows.assign(step, alone=True)
        ours = sampler(logits, _batch(len(step), slots=slots, update=update)).token_ids
        assert ours == _fresh_tokens(step, logits)
        for seq, token in zip(step, ours, strict=True):
            seq.token_ids.append(token)
        for seq in list(live):
            if rng.random() < 0.15:
                seq.status = SequenceStatus.FINISHED
                live.remove(seq)


class _Recorder(LogitsProcessor):
    """Records the calls it gets: what each processor is told, in order."""

    calls: ClassVar[list[str]] = []

    @classmethod
    def uses(cls, params: SamplingParams) -> bool:
        return params.min_tokens > 0

    def add(self, slot: int, row: AddedRow) -> None:
        self.calls.append(f"add {slot}")

    def remove(self, slot: int) -> None:
        self.calls.append(f"remove {slot}")

    def apply(self, logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
        self.calls.append(f"apply {rows.rows.tolist()} {rows.slots.tolist()}")
        return logits

    def on_sampled(self, rows: StepRows, tokens: torch.Tensor) -> None:
        self.calls.append(f"sampled {tokens[torch.from_numpy(rows.rows)].tolist()}")


def test_the_engine_tells_a_processor_each_change_once_in_order(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """Through the real engine: a processor sees each row added once, applied on each step
    it samples in, and removed once after it finished; rows that do not use it never."""
    engine = make_engine(demo_dir)
    recorder = _Recorder(ProcessorContext(VOCAB, torch.device("cpu"), 64))
    _Recorder.calls = []
    executor = engine.executor
    assert isinstance(executor, ThreadExecutor)

    def install(worker: Worker[ForwardInput, SamplerOutput]) -> None:
        runner = worker.runner
        assert isinstance(runner, ModelRunner) and runner.sampler is not None
        assert runner.sampler.processors is not None
        runner.sampler.processors.processors.append(recorder)

    executor.call(0, install)
    engine.sampling_rows = SamplingRows(64, (*BUILTIN_PROCESSORS, _Recorder))
    a = SamplingParams.greedy(max_tokens=3, min_tokens=1)
    b = SamplingParams.greedy(max_tokens=2)
    engine.generate(["hello world", "the model"], [a, b])
    engine.generate(["hi"], SamplingParams.greedy(max_tokens=1))
    calls = _Recorder.calls
    assert calls[0] == "add 0"
    assert [c.split()[0] for c in calls] == ["add"] + ["apply", "sampled"] * 3 + ["remove"]
    assert all(c.startswith(("add", "remove", "sampled")) or c.endswith(" [0]") for c in calls)
