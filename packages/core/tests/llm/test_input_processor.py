"""Requests in: the limits a prompt is refused by, with the messages clients see."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.core.config import SchedulerConfig, StructuredOutputConfig
from tandem.core.demo.pretrained import stories260k_folder
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


@pytest.fixture(scope="module", params=["demo", "stories260k"])
def any_tokenizer(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> Tokenizer:
    """The demo's byte-level BPE (GPT-2's regex keeps a run of digits or of CJK letters in
    one pre-token), or the bundled Llama 2 SentencePiece BPE with byte fallback (no
    pre-tokenizer at all)."""
    return tokenizer if request.param == "demo" else Tokenizer(stories260k_folder())


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
    assert len(lengths) == 1 and lengths[0] <= encoder.prefix_bytes_per_token * (
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


@pytest.mark.parametrize("bytes_per_token", [8, 1])
def test_texts_around_the_limit_are_judged_by_all_their_tokens(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, bytes_per_token: int
) -> None:
    """Just over: refused with the exact count, as ever; just under: the whole text's ids,
    also when (with a small prefix) a prefix was counted first."""
    encoder = PromptEncoder(tokenizer, max_model_len=256)
    encoder.prefix_bytes_per_token = bytes_per_token
    text = DEMO_TEXT * 40
    ids = tokenizer.encode(text)
    fits = tokenizer.decode(ids[:255])
    over = tokenizer.decode(ids[:300])
    assert len(tokenizer.encode(fits)) == 255 and len(tokenizer.encode(over)) == 300
    lengths = recording_encodes(tokenizer, monkeypatch)
    assert encoder.encode_prompt(fits) == encode_plain(tokenizer, fits)
    assert lengths[-1] == len(fits) and (len(lengths) > 1) == (bytes_per_token == 1)
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
    encoder.prefix_bytes_per_token = 1
    lengths = recording_encodes(tokenizer, monkeypatch)
    assert encoder.encode_prompt(text) == encode_plain(tokenizer, text)
    assert len(lengths) > 1, "the prefix path should have run"
    with pytest.raises(InvalidRequestError, match=f"^{count} tokens of prompt"):
        PromptEncoder(tokenizer, max_model_len=count).encode_prompt(text)


# Texts with no space to cut a prefix at, each many times the bytes of its prefix.
UNSPACED = {
    "digits": "0123456789",
    "cjk": "数据并行与张量切分，流水线调度。",
    "punctuation": "=-*#.,;:!?()[]{}<>/|",
}


@pytest.mark.parametrize("kind", UNSPACED)
def test_a_huge_text_without_spaces_is_refused_by_a_prefix_of_it(
    any_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The issue's case: 6 MB of digits, CJK or punctuation, no space in it, under the size
    bound of a long context; it was tokenized whole before its 400, as no cut was found."""
    tokenizer = any_tokenizer
    unit = UNSPACED[kind]
    text = unit * (6_000_000 // len(unit.encode("utf-8")))
    encoder = PromptEncoder(tokenizer, max_model_len=1 << 20)
    assert len(text.encode("utf-8")) <= 4 * tokenizer.max_token_bytes * (1 << 20)
    budget = TokenBudget(1000, lambda what: InvalidRequestError(f"{what}, over 1000", "prompt"))
    lengths = recording_encodes(tokenizer, monkeypatch)
    with pytest.raises(InvalidRequestError, match=r"^at least \d+ tokens, over 1000$") as err:
        encoder.encode_prompt(text, check_length=False, budget=budget)
    prefix = encoder.prefix_bytes_per_token * (1000 + 2 * tokenizer.max_token_bytes)
    assert len(lengths) == 1 and prefix // 2 < len(text[: lengths[0]].encode()) <= prefix
    assert int(str(err.value).split()[2]) > 1000
    # The engine's own limit, from a text under its size bound: refused by a prefix too, and
    # by no more tokens than the whole has.
    lengths.clear()
    encoder = PromptEncoder(tokenizer, max_model_len=1024)
    text = text[: 4 * tokenizer.max_token_bytes * 1024 // 3]
    with pytest.raises(InvalidRequestError, match=r"^at least \d+ tokens of prompt") as err:
        encoder.encode_prompt(text)
    prefix = encoder.prefix_bytes_per_token * (1023 + 2 * tokenizer.max_token_bytes)
    assert len(lengths) == 1 and len(text[: lengths[0]].encode()) <= prefix < len(text.encode())
    assert 1023 < int(str(err.value).split()[2]) <= len(encode_plain(tokenizer, text))


@pytest.mark.parametrize("kind", [*UNSPACED, "words"])
def test_cutting_a_text_without_spaces_anywhere_adds_fewer_tokens_than_the_margin(
    any_tokenizer: Tokenizer, kind: str
) -> None:
    """The docstring's bound, for cuts inside one pre-token (every cut here, for Llama 2's
    SentencePiece): a prefix has at most 2 * max_token_bytes more tokens than the whole
    text's tokens that end inside it."""
    tokenizer = any_tokenizer
    backend = tokenizer.backend.backend_tokenizer
    words = ["checkpoint", "scheduler", "tokenizer", "数据", "2026", "=="]
    text = ("".join(words) if kind == "words" else UNSPACED[kind]) * 100
    text = text[:1200]
    ends = sorted(end for _, end in backend.encode(text, add_special_tokens=False).offsets)
    worst = 0
    for cut in range(1, len(text), 5):
        prefix = len(backend.encode(text[:cut], add_special_tokens=False).ids)
        worst = max(worst, prefix - bisect.bisect_right(ends, cut))
    assert worst < 2 * tokenizer.max_token_bytes, worst


@pytest.mark.parametrize("kind", UNSPACED)
def test_a_text_without_spaces_at_the_limit_is_judged_by_all_its_tokens(
    any_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Unspaced words around runs of ``kind``, so that the prefix path runs and cuts where
    it finds no space: a text at the limit gets the whole text's ids; one token over, the
    whole text's exact count."""
    tokenizer = any_tokenizer
    unit = "checkpointschedulertokenizer" * 3 + UNSPACED[kind][:4]
    lengths = recording_encodes(tokenizer, monkeypatch)
    for end in range(600, 1200, 53):
        text = (unit * 20)[:end]
        count = len(encode_plain(tokenizer, text))
        encoder = PromptEncoder(tokenizer, max_model_len=count + 1)
        encoder.prefix_bytes_per_token = 1
        lengths.clear()
        assert encoder.encode_prompt(text) == encode_plain(tokenizer, text)
        assert len(lengths) > 1 and lengths[-1] == len(text), "the prefix path should have run"
        with pytest.raises(InvalidRequestError, match=f"^{count} tokens of prompt"):
            PromptEncoder(tokenizer, max_model_len=count).encode_prompt(text)


def test_a_text_without_spaces_is_cut_before_a_letter_not_between_it_and_its_marks(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decomposed accents: NFC would compose a mark with its letter only on one side.
    text = "e\u0301\u0323" * 8_000
    # 8 * (1000 + 2 * 13) bytes end between a mark and the next.
    encoder = PromptEncoder(tokenizer, max_model_len=1001)
    lengths = recording_encodes(tokenizer, monkeypatch)
    with pytest.raises(InvalidRequestError, match=r"^at least \d+ tokens of prompt"):
        encoder.encode_prompt(text)
    assert len(lengths) == 1 and text[lengths[0]] == "e", lengths


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
