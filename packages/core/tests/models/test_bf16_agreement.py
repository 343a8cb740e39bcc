"""bfloat16 against float32 on the same checkpoint: the dtype `--dtype auto` picks on a CPU with
AMX or AVX512-BF16 must give the float32 path's answers within bfloat16's rounding.

The tolerance: bfloat16 keeps 8 significant bits (relative rounding 2**-9 per operation), and a
forward pass rounds each activation a few dozen times, so logits may move by a few hundredths
of their spread. On stories260k (a trained model, so its logits have real margins) every prompt
position's log-probabilities stay within ``LOGPROB_TOL`` nats of float32's over the tokens that
matter (those float32 gives at least 1e-3 probability), the prefill's argmax agrees wherever
float32's top two are further apart than ``MARGIN``, and the greedy continuation, decoded one
token per step through the paged decode kernel, is the same tokens as float32's up to the
first such near tie.
"""

from __future__ import annotations

import math

import torch

from tandem.core import SamplingParams
from tandem.core.demo.pretrained import stories260k_folder
from tandem.core.llm.tokenizer import Tokenizer

from ..conftest import EngineFactory, prompt_logits

STORIES = stories260k_folder()
LOGPROB_TOL = 0.15
MARGIN = 0.3
PROMPT = "Once upon a time, there was a little dog named Max. Max liked to run in the park with"


def _near_tie(top: list[tuple[int, float]]) -> bool:
    return len(top) > 1 and top[0][1] - top[1][1] <= MARGIN


def test_prefill_log_probabilities_agree(make_engine: EngineFactory) -> None:
    prompt = Tokenizer(STORIES).encode(PROMPT)
    exact = prompt_logits(make_engine(STORIES, dtype="float32"), prompt).float()
    fast = prompt_logits(make_engine(STORIES, dtype="bfloat16"), prompt).float()
    assert exact.shape == fast.shape == (len(prompt), exact.shape[1])

    exact_lp, fast_lp = exact.log_softmax(-1), fast.log_softmax(-1)
    likely = exact_lp > math.log(1e-3)
    worst = (exact_lp - fast_lp).abs()[likely].max().item()
    assert worst <= LOGPROB_TOL, f"log-probabilities moved by {worst:.4f} nats"

    top2 = exact.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > MARGIN
    assert clear.sum() >= len(prompt) // 2, "the prompt should mostly have clear winners"
    assert torch.equal(exact.argmax(-1)[clear], fast.argmax(-1)[clear])


def test_greedy_decode_agrees_up_to_a_near_tie(make_engine: EngineFactory) -> None:
    params = SamplingParams.greedy(max_tokens=40, logprobs=2)
    [exact] = make_engine(STORIES, dtype="float32").generate([PROMPT], params)
    [fast] = make_engine(STORIES, dtype="bfloat16").generate([PROMPT], params)
    assert exact.logprobs is not None and fast.logprobs is not None

    agreed = 0
    for want, got in zip(exact.logprobs, fast.logprobs, strict=True):
        if want.token_id != got.token_id:
            assert _near_tie(want.top), (
                f"bf16 chose {got.token_id} over {want.token_id} at step {agreed}, "
                f"where float32's top two are {want.top}"
            )
            break
        assert abs(want.logprob - got.logprob) <= LOGPROB_TOL, (agreed, want, got)
        agreed += 1
    assert agreed >= 20, f"only {agreed} tokens agreed before a near tie"
