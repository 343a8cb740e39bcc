"""How far INT8 W8A8 moves a real pretrained model: per-position KL divergence of the
quantized stories260k's next-token distribution from the float32 one, over 506 positions of
three short stories in its own style.

Thresholds. Measured here (float32 CPU, ``write_w8a8``, dynamic per-token activations): mean
KL 1.1e-3 nats, p99 9.0e-3, top-1 agreement 98.4%. A defect as small as one layer's
per-channel scales in the wrong order (layer 2's down_proj, reversed) measures mean 2.3e-2,
p99 0.14, top-1 93.3%. The limits sit ~3.5x above the clean figures, room for other CPUs'
float summation orders shifting a few int8 codes, and 4-6x below that one-tensor defect:
mean <= 4e-3, p99 <= 3e-2, top-1 >= 95%. This model is small (rows of 64 to 172 values),
so each int8 step is a larger share of a row than in real-size models: a bound that holds
here is loose for them, not tight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.core.demo.pretrained import stories260k_folder
from tandem.core.llm.engine import LLMEngine
from tandem.core.llm.tokenizer import Tokenizer
from tandem.core.models.w8a8_writer import write_w8a8

from ..conftest import prompt_logits

STORIES = stories260k_folder()
TEXTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "sun with her dog, Max. One day, Lily and Max went to the park. They saw a big tree with "
    "red apples. Lily wanted an apple, but the tree was too tall. Max barked and ran around "
    "the tree. Then a kind old man came and picked an apple for Lily. Lily said thank you and "
    "shared the apple with Max. They were very happy.",
    "Tom had a small red ball. He liked to throw it high in the sky. One day, the ball fell "
    "into the pond. Tom was sad because he could not swim. A duck saw the ball and pushed it "
    'to Tom with its beak. Tom smiled and said, "Thank you, duck!" The duck quacked and swam '
    "away. From that day on, Tom and the duck were best friends, and they played together "
    "every morning.",
    "Sue and her mom went to the store to buy some milk and bread. At the store, Sue saw a "
    "pretty doll with a blue dress. She asked her mom if she could have it. Her mom said, "
    '"Not today, Sue. But if you help me at home, you can have it next week." Sue helped her '
    "mom clean the house and wash the dishes. The next week, they went back to the store, and "
    "Sue got her doll.",
]
MEAN_KL, P99_KL, TOP1 = 4e-3, 3e-2, 0.95


def log_probs(engine: LLMEngine, prompts: list[list[int]]) -> torch.Tensor:
    logits = torch.cat([prompt_logits(engine, p) for p in prompts])
    return logits.double().log_softmax(-1)


@pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason="stories260k is absent")
def test_int8_w8a8_stays_within_the_kl_budget_of_float32(
    tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    quantized = tmp_path / "w8a8"
    write_w8a8(STORIES, quantized)
    prompts = [Tokenizer(STORIES).encode(text) for text in TEXTS]
    assert sum(map(len, prompts)) >= 300
    exact = log_probs(make_engine(STORIES, dtype="float32"), prompts)
    approx = log_probs(make_engine(quantized, dtype="float32"), prompts)
    kl = (exact.exp() * (exact - approx)).sum(-1)
    mean, p99 = kl.mean().item(), kl.quantile(0.99).item()
    top1 = (exact.argmax(-1) == approx.argmax(-1)).double().mean().item()
    summary = f"KL mean {mean:.2e}, p99 {p99:.2e}, top-1 agreement {top1:.3f}"
    assert mean <= MEAN_KL and p99 <= P99_KL and top1 >= TOP1, summary
