"""Penalties equal transformers' logits processors (repetition) and vLLM's definition
(presence / frequency), on raw logits and as greedy tokens of the real stories260k model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers

from tandem.core import LLMEngine, SamplingParams
from tandem.core.demo.pretrained import stories260k_folder
from tandem.core.llm.logits_processor import AddedRow, BatchUpdate, ProcessorContext
from tandem.core.llm.penalties import Penalties

VOCAB = 64


class VllmPresenceFrequency(transformers.LogitsProcessor):
    """vLLM's presence/frequency penalties, written plainly: only the generated tokens count."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len = prompt_len
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row in range(scores.shape[0]):
            for token in set(input_ids[row, self.prompt_len :].tolist()):
                count = int((input_ids[row, self.prompt_len :] == token).sum())
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def penalize(
    logits: torch.Tensor, rows: list[int], cases: list[tuple[list[int], list[int], dict[str, Any]]]
) -> torch.Tensor:
    """``logits`` with the penalties of ``cases`` (prompt, output, params) at ``rows``: each
    row added to the processor with its tokens, in slots other than its row."""
    processor = Penalties(ProcessorContext(logits.shape[1], torch.device("cpu"), max_rows=8))
    added = tuple(
        AddedRow(
            slot=7 - i,
            params=SamplingParams(max_tokens=64, **params),
            eos_token_ids=frozenset({2}),
            num_output_tokens=len(output),
            prompt_token_ids=torch.tensor(prompt),
            output_token_ids=torch.tensor(output),
        )
        for i, (prompt, output, params) in enumerate(cases)
    )
    processor.update_state(BatchUpdate(added=added))
    slots = torch.full((logits.shape[0],), -1)
    slots[rows] = torch.tensor([row.slot for row in added])
    step = processor.rows_of(slots.numpy())
    assert step is not None
    return processor.apply(logits.clone(), step)


def test_penalties_equal_the_reference_processors() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=generator) * 3
    cases = [
        ([5, 6, 7, 5], [7, 8, 8, 8, 9], {"repetition_penalty": 1.3}),
        ([1, 2], [3, 3, 4], {"presence_penalty": 0.7, "frequency_penalty": 0.4}),
        ([10, 11, 12], [13, 10, 10], {"repetition_penalty": 0.8, "frequency_penalty": -0.5}),
    ]
    # Row 2 has no penalties: it is not in the batch and must come out untouched.
    rows = [0, 1, 3]
    ours = penalize(logits, rows, cases)
    expected = logits.clone()
    for row, (prompt, output, params) in zip(rows, cases, strict=True):
        ids = torch.tensor([prompt + output])
        scores = logits[row : row + 1]
        if "repetition_penalty" in params:
            processor = transformers.RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])
            scores = processor(ids, scores)
        presence = params.get("presence_penalty", 0.0)
        frequency = params.get("frequency_penalty", 0.0)
        expected[row] = VllmPresenceFrequency(len(prompt), presence, frequency)(ids, scores)[0]
    diff = (ours - expected).abs().max().item()
    assert diff <= 1e-6, diff
    assert torch.equal(ours[2], logits[2])
    assert not torch.equal(ours[0], logits[0])


@pytest.fixture(scope="module")
def reference() -> Any:
    # from_pretrained leaves the model in eval mode.
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(stories260k_folder()), dtype=torch.float32
    )


PROMPT = "Once upon a time"
NEW_TOKENS = 40


def _transformers_greedy(reference: Any, prompt_ids: list[int], **kwargs: Any) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = reference.generate(
            ids,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
            **kwargs,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 1.0},
    ],
)
def test_greedy_tokens_equal_transformers(
    make_engine: Callable[..., LLMEngine], reference: Any, params: dict[str, float]
) -> None:
    engine = make_engine(stories260k_folder())
    prompt_ids = engine.tokenizer.encode(PROMPT)
    [plain] = engine.generate([PROMPT], SamplingParams.greedy(NEW_TOKENS, ignore_eos=True))
    [ours] = engine.generate([PROMPT], SamplingParams.greedy(NEW_TOKENS, ignore_eos=True, **params))
    processors = transformers.LogitsProcessorList(
        [
            VllmPresenceFrequency(
                len(prompt_ids),
                params.get("presence_penalty", 0.0),
                params.get("frequency_penalty", 0.0),
            )
        ]
    )
    expected = _transformers_greedy(
        reference,
        prompt_ids,
        repetition_penalty=params.get("repetition_penalty", 1.0),
        logits_processor=processors,
    )
    assert ours.token_ids == expected
    # The penalties changed what a real model writes: the check above could fail.
    assert ours.token_ids != plain.token_ids
