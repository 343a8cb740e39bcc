"""The real pretrained tiny Llama shipped in the package (tandem.core.demo.stories260k)."""

from __future__ import annotations

from collections.abc import Callable

from tandem.core import LLMEngine, SamplingParams
from tandem.core.demo.pretrained import stories260k_folder
from tandem.core.llm.tokenizer import Tokenizer

STORIES = stories260k_folder()

# From the model folder's README (checked there with transformers on CPU, fp32).
GREEDY_FROM_BOS = [
    1,
    403,
    407,
    261,
    378,
    432,
    383,
    286,
    261,
    376,
    298,
    315,
    421,
    395,
    317,
    426,
    338,
    401,
    396,
    267,
    337,
    410,
    408,
    419,
    292,
    411,
    322,
    265,
    282,
    295,
]


def test_tokenizer_ids() -> None:
    assert Tokenizer(STORIES).encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_greedy_from_bos(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(STORIES)
    [out] = engine.generate([[1]], SamplingParams.greedy(max_tokens=len(GREEDY_FROM_BOS) - 1))
    assert [1, *out.token_ids] == GREEDY_FROM_BOS
    assert out.text.startswith("Once upon a time, there was a little girl named Lily.")


def test_greedy_is_batch_invariant(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(STORIES, block_size=8, max_tokens_per_batch=16)
    prompts = ["Once upon a time", "The cat", "Lily and Tom went to the park. They", "One day"]
    params = SamplingParams.greedy(max_tokens=40)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    together = [o.token_ids for o in engine.generate(prompts, params)]
    assert together == alone
