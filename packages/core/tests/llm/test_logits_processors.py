"""min_p, min_tokens, logit_bias and include_stop_str_in_output, in the sampler and through
the engine; seeded rows with penalties stay independent of their batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.core import InvalidRequestError, LLMEngine, SamplingParams
from tandem.core.llm.forward_input import SamplingBatch
from tandem.core.llm.logits_processor import AddedRow, BatchUpdate, ProcessorContext
from tandem.core.llm.logits_processors import LogitsProcessors
from tandem.core.llm.sampler import Sampler


def _batch(n: int, **kw: object) -> SamplingBatch:
    fields: dict[str, object] = {
        "temperatures": torch.ones(n),
        "top_p": torch.ones(n),
        "top_k": torch.zeros(n, dtype=torch.int64),
        "seeds": (None,) * n,
        "steps": (0,) * n,
        "all_greedy": False,
        "needs_top_k_top_p": False,
        "max_logprobs": None,
    }
    fields.update(kw)
    return SamplingBatch(**fields)  # type: ignore[arg-type]


def test_min_p_keeps_tokens_near_the_top() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).expand(3000, 4).clone()
    # Rows alternate: min_p 0.5 keeps p >= 0.25 (tokens 0, 1); min_p 0 keeps everything.
    # The min_p rows share one slot: the state is per slot, the step names it per row.
    processors = LogitsProcessors(ProcessorContext(4, torch.device("cpu"), max_rows=1))
    added = AddedRow(0, SamplingParams(min_p=0.5), frozenset(), num_output_tokens=0)
    slots = torch.tensor([0, -1]).repeat(1500)
    batch = _batch(3000, slots=slots, update=BatchUpdate(added=(added,)))
    tokens = torch.tensor(Sampler(0, processors)(logits, batch).token_ids)
    cut, free = tokens[0::2], tokens[1::2]
    assert set(cut.tolist()) == {0, 1}
    assert abs((cut == 0).float().mean().item() - 0.5 / 0.8) < 0.05
    assert set(free.tolist()) == {0, 1, 2, 3}


def test_logit_bias_forces_a_token(demo_dir: Path, make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(demo_dir)
    [out] = engine.generate(
        ["hello world"], SamplingParams.greedy(max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    )
    assert out.token_ids == [77] * 6
    # A strongly negative bias takes the greedy token away.
    [plain] = engine.generate(["hello world"], SamplingParams.greedy(max_tokens=1))
    first = plain.token_ids[0]
    [banned] = engine.generate(
        ["hello world"], SamplingParams.greedy(max_tokens=1, logit_bias={first: -100})
    )
    assert banned.token_ids[0] != first


def test_min_tokens_holds_off_eos(demo_dir: Path, make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(demo_dir)
    eos = min(engine.inputs.eos_token_ids)
    eager = SamplingParams.greedy(max_tokens=20, logit_bias={eos: 100})
    [now] = engine.generate(["hello world"], eager)
    assert now.token_ids == [eos] and now.finish_reason == "stop"
    held = SamplingParams.greedy(max_tokens=20, logit_bias={eos: 100}, min_tokens=5)
    [later] = engine.generate(["hello world"], held)
    assert len(later.token_ids) == 6 and later.token_ids[-1] == eos
    assert eos not in later.token_ids[:5]
    assert later.finish_reason == "stop"


def test_stop_string_in_output(demo_dir: Path, make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(demo_dir)
    greedy = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    [plain] = engine.generate(["hello world"], greedy)
    stop = plain.text[5:8]
    assert stop.strip(), plain.text
    at = plain.text.index(stop)
    kept, cut = engine.generate(
        ["hello world", "hello world"],
        [
            SamplingParams.greedy(max_tokens=24, stop=[stop], include_stop_str_in_output=True),
            SamplingParams.greedy(max_tokens=24, stop=[stop]),
        ],
    )
    assert kept.text == plain.text[: at + len(stop)]
    assert cut.text == plain.text[:at]
    assert kept.stop_reason == cut.stop_reason == stop


def test_seeded_penalized_rows_ignore_their_batch(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir, max_tokens_per_batch=16)
    seeded = SamplingParams(
        max_tokens=16,
        temperature=0.8,
        seed=7,
        min_p=0.05,
        presence_penalty=0.8,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={5: 3.0},
        ignore_eos=True,
    )
    [alone] = engine.generate(["hello world"], seeded)
    others = [
        SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True),
        SamplingParams.greedy(max_tokens=12, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.7, min_p=0.2, min_tokens=3),
    ]
    mixed = engine.generate(
        ["the model reads", "hello world", "λ Ω", "a request"], [others[0], seeded, *others[1:]]
    )
    assert mixed[1].token_ids == alone.token_ids


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_new_fields_are_range_checked(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=16, **kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_token_ids_outside_the_vocabulary(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir)
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(None, "hi", SamplingParams(logit_bias={vocab: 1.0}))
    assert info.value.param == "logit_bias"
