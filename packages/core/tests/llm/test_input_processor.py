"""Requests in: the limits a prompt is refused by, with the messages clients see."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.core.config import SchedulerConfig, StructuredOutputConfig
from tandem.core.errors import InvalidRequestError
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.input_processor import InputProcessor, PromptEncoder, TokenBudget
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.structured_output import StructuredOutputs
from tandem.core.llm.tokenizer import Tokenizer

VOCAB = 512

InputsFactory = Callable[..., InputProcessor]


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer(demo_dir)


@pytest.fixture
def make_inputs(tokenizer: Tokenizer) -> Iterator[InputsFactory]:
    compilers: list[StructuredOutputs] = []

    def build(
        max_model_len: int = 64,
        num_blocks: int = 32,
        scheduler: SchedulerConfig | None = None,
    ) -> InputProcessor:
        compiler = StructuredOutputs(tokenizer, VOCAB, frozenset({2}), StructuredOutputConfig())
        compilers.append(compiler)
        return InputProcessor(
            tokenizer,
            max_model_len,
            VOCAB,
            frozenset({2}),
            BlockManager(num_blocks=num_blocks, block_size=4, enable_prefix_cache=False),
            scheduler or SchedulerConfig(),
            compiler,
        )

    yield build
    for compiler in compilers:
        compiler.shutdown()


def test_a_prompt_leaving_no_room_for_a_token_is_refused_naming_its_field(
    tokenizer: Tokenizer,
) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=8)
    encoder.check_prompt_length(7)
    with pytest.raises(InvalidRequestError) as err:
        encoder.check_prompt_length(8, param="messages")
    assert str(err.value) == (
        "8 tokens of messages, but this model's maximum context length is 8 tokens (prompt "
        "plus at least one generated token); shorten the messages"
    )
    assert err.value.param == "messages"


def test_a_text_too_long_by_its_size_is_refused_before_it_is_tokenized(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=8)

    def never(*args: object, **kwargs: object) -> list[int]:
        raise AssertionError("tokenized a text refused by its size")

    monkeypatch.setattr(tokenizer, "encode", never)
    size = 4 * tokenizer.max_token_bytes * 8 + 1
    with pytest.raises(InvalidRequestError, match=f"the prompt is {size} bytes long"):
        encoder.encode_prompt("a" * size)
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        encoder.encode_prompt("\ud800")


def test_check_length_off_lets_a_long_text_through(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=4)
    text = "hello world hello world hello world"
    ids = encoder.encode_prompt(text, check_length=False)
    assert len(ids) >= 4 and ids == tokenizer.encode(text)
    with pytest.raises(InvalidRequestError, match="maximum context length is 4"):
        encoder.encode_prompt(text)


DEMO_TEXT = "the quick brown fox jumps over the lazy dog 123 "


def recording_encodes(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the texts ``tokenizer`` is asked to encode from now on (it still
    encodes them)."""
    lengths: list[int] = []
    encode = tokenizer.encode

    def recording(text: str, add_special_tokens: bool = True) -> list[int]:
        lengths.append(len(text))
        return encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", recording)
    return lengths


def test_a_text_far_over_the_limit_is_refused_by_a_prefix_of_it(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=1024)
    # Under the size bound (4 * max_token_bytes bytes per position), tens of times too long.
    text = (DEMO_TEXT * 1100)[: 4 * tokenizer.max_token_bytes * 1024 - 100]
    lengths = recording_encodes(tokenizer, monkeypatch)
    with pytest.raises(InvalidRequestError, match=r"^at least \d+ tokens of prompt, but") as err:
        encoder.encode_prompt(text)
    assert err.value.param == "prompt"
    assert len(lengths) == 1 and lengths[0] <= encoder.prefix_chars_per_token * (
        1023 + 2 * tokenizer.max_token_bytes
    ), lengths
    at_least = int(str(err.value).split()[2])
    assert 1023 < at_least <= len(encode_plain(tokenizer, text))
    # /tokenize's budget: its own limit and message.
    lengths.clear()
    budget = TokenBudget(300, lambda what: InvalidRequestError(f"{what}, over 300", "prompt"))
    with pytest.raises(InvalidRequestError, match=r"^at least \d+ tokens, over 300$"):
        encoder.encode_prompt(text, check_length=False, budget=budget)
    assert len(lengths) == 1 and lengths[0] < len(text) // 10


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    return Tokenizer.encode(tokenizer, text)


@pytest.mark.parametrize("chars_per_token", [8, 1])
def test_texts_around_the_limit_are_judged_by_all_their_tokens(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, chars_per_token: int
) -> None:
    """Just over: refused with the exact count, as ever; just under: the whole text's ids,
    also when (with a small prefix) a prefix was counted first."""
    encoder = PromptEncoder(tokenizer, max_model_len=256)
    encoder.prefix_chars_per_token = chars_per_token
    text = DEMO_TEXT * 40
    ids = tokenizer.encode(text)
    fits = tokenizer.decode(ids[:255])
    over = tokenizer.decode(ids[:300])
    assert len(tokenizer.encode(fits)) == 255 and len(tokenizer.encode(over)) == 300
    lengths = recording_encodes(tokenizer, monkeypatch)
    assert encoder.encode_prompt(fits) == encode_plain(tokenizer, fits)
    assert lengths[-1] == len(fits) and (len(lengths) > 1) == (chars_per_token == 1)
    with pytest.raises(InvalidRequestError) as err:
        encoder.encode_prompt(over)
    assert str(err.value).startswith("300 tokens of prompt, but this model's maximum context")


@pytest.mark.parametrize(
    "dense",
    ["0123456789" * 8, "数据并行与张量" * 12, "\n" * 40],
    ids=["digits", "cjk", "newlines"],
)
def test_a_dense_start_never_gets_a_text_that_fits_refused(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, dense: str
) -> None:
    """A start far denser than the rest (digits, CJK at three byte tokens a character)
    makes a short prefix look too long by its rate; it is refused only by its own count."""
    sparse = " checkpoint scheduler tokenizer" * 30
    text = dense + sparse
    count = len(tokenizer.encode(text))
    encoder = PromptEncoder(tokenizer, max_model_len=count + 1)
    encoder.prefix_chars_per_token = 1
    lengths = recording_encodes(tokenizer, monkeypatch)
    assert encoder.encode_prompt(text) == encode_plain(tokenizer, text)
    assert len(lengths) > 1, "the prefix path should have run"
    with pytest.raises(InvalidRequestError, match=f"^{count} tokens of prompt"):
        PromptEncoder(tokenizer, max_model_len=count).encode_prompt(text)


def test_prepared_requests_are_numbered_and_carry_the_limits(
    make_inputs: InputsFactory,
) -> None:
    inputs = make_inputs()
    first = inputs.prepare(None, [5, 6, 7], SamplingParams())
    second = inputs.prepare(None, "hello", SamplingParams())
    named = inputs.prepare("mine", [5], SamplingParams())
    assert (first.request_id, second.request_id, named.request_id) == ("req-0", "req-1", "mine")
    assert first.eos_token_ids == frozenset({2}) and first.max_total_tokens == 64
    assert second.prompt_token_ids == inputs.tokenizer.encode("hello")


@pytest.mark.parametrize(
    ("prompt", "params", "message", "param"),
    [
        ([], SamplingParams(), "the prompt is empty", "prompt"),
        ([5, VOCAB], SamplingParams(), rf"integers in \[0, {VOCAB}\); got \[{VOCAB}\]", "prompt"),
        (list(range(1, 65)), SamplingParams(), "maximum context length is 64", "prompt"),
        ([5], SamplingParams(stop_token_ids=[VOCAB + 1]), "stop_token_ids names", "stop_token_ids"),
        ([5], SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias names", "logit_bias"),
    ],
)
def test_a_bad_request_is_refused_with_its_field(
    make_inputs: InputsFactory,
    prompt: list[int],
    params: SamplingParams,
    message: str,
    param: str,
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as err:
        make_inputs().prepare(None, prompt, params)
    assert err.value.param == param


def test_a_request_that_could_never_run_is_refused(make_inputs: InputsFactory) -> None:
    # 2 blocks of 4 tokens hold 8; the last sampled token needs none.
    small = make_inputs(num_blocks=2)
    small.prepare(None, [5, 6, 7], SamplingParams(max_tokens=6))
    with pytest.raises(InvalidRequestError, match="more than the whole cache holds") as err:
        small.prepare(None, [5, 6, 7], SamplingParams(max_tokens=7))
    assert err.value.param == "max_tokens"
    unchunked = make_inputs(
        scheduler=SchedulerConfig(enable_chunked_prefill=False, max_tokens_per_batch=4)
    )
    unchunked.prepare(None, [5, 6, 7, 8], SamplingParams())
    with pytest.raises(InvalidRequestError, match="more than max_tokens_per_batch"):
        unchunked.prepare(None, [5, 6, 7, 8, 9], SamplingParams())
