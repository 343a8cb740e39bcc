"""How far each quantization scheme moves a model: per-position KL divergence of the quantized
model's next-token distribution from the float one, its mean and 99th percentile, and how often
the two agree on the top token, over a few hundred prompt positions. Each scheme's copy is
written by ``tandem quantize``'s writers; both models run in Tandem in float32 (so the figures
are the quantization's, not bfloat16's) through the real prefill path.

    python benchmarks/quant_accuracy.py --model DIR [--schemes w8a8 w4a16:128 w4a16:32:asym]
        [--prompts text|random] [--positions 500]

``--prompts text`` scores three short stories in the TinyStories style (for models trained on
such text, e.g. stories260k); ``random`` scores seeded random token ids, which is all a
random-weight bench model can be given: its figures then measure the arithmetic, not a
language. A scheme is ``w8a8`` or ``w4a16[:GROUP][:asym]`` (group 128, symmetric by default).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from compare import cpu_line

from tandem.core import CacheConfig, EngineConfig, LLMEngine, ModelLoadConfig
from tandem.core.llm.prompt_logits import prompt_logits
from tandem.core.llm.tokenizer import Tokenizer
from tandem.core.models.config_json import load_model_config
from tandem.core.models.w4a16_writer import write_w4a16
from tandem.core.models.w8a8_writer import write_w8a8

logger = logging.getLogger("quant_accuracy")

STORIES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "sun with her dog, Max. One day, Lily and Max went to the park. They saw a big tree with "
    "red apples. Lily wanted an apple, but the tree was too tall. Max barked and ran around "
    "the tree. Then a kind old man came and picked an apple for Lily.",
    "Tom had a small red ball. He liked to throw it high in the sky. One day, the ball fell "
    "into the pond. Tom was sad because he could not swim. A duck saw the ball and pushed it "
    'to Tom with its beak. Tom smiled and said, "Thank you, duck!" The duck quacked and swam '
    "away.",
    "Sue and her mom went to the store to buy some milk and bread. At the store, Sue saw a "
    "pretty doll with a blue dress. She asked her mom if she could have it. Her mom said, "
    '"Not today, Sue. But if you help me at home, you can have it next week."',
]
# Random prompts: this many tokens each.
_RANDOM_LEN = 128


@dataclass(frozen=True)
class Scheme:
    name: str
    group_size: int = 128
    sym: bool = True

    @staticmethod
    def parse(text: str) -> Scheme:
        parts = text.split(":")
        if parts[0] == "w8a8" and len(parts) == 1:
            return Scheme("w8a8")
        if parts[0] != "w4a16" or len(parts) > 3 or (len(parts) == 3 and parts[2] != "asym"):
            raise argparse.ArgumentTypeError(f"{text}: give w8a8 or w4a16[:GROUP][:asym]")
        group = int(parts[1]) if len(parts) > 1 else 128
        return Scheme("w4a16", group, sym=len(parts) < 3)

    def label(self) -> str:
        if self.name == "w8a8":
            return "W8A8 (int8 per channel, dynamic per-token activations)"
        return f"W4A16 group {self.group_size}, {'symmetric' if self.sym else 'zero points'}"

    def write(self, src: Path, dst: Path) -> None:
        if self.name == "w8a8":
            write_w8a8(src, dst)
        else:
            write_w4a16(src, dst, group_size=self.group_size, sym=self.sym)


def prompts(model: Path, kind: str, positions: int) -> list[list[int]]:
    if kind == "text":
        tokenizer = Tokenizer(model)
        out = [tokenizer.encode(text) for text in STORIES]
        if sum(map(len, out)) < positions:
            logger.warning("the stories give %d positions", sum(map(len, out)))
        return out
    vocab = load_model_config(model).vocab_size
    generator = torch.Generator().manual_seed(0)
    count = -(-positions // _RANDOM_LEN)
    return [
        torch.randint(vocab, (_RANDOM_LEN,), generator=generator).tolist() for _ in range(count)
    ]


def log_probs(model: Path, tokens: list[list[int]]) -> torch.Tensor:
    longest = max(map(len, tokens))
    engine = LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(model), dtype="float32"),
            cache=CacheConfig(num_blocks=-(-longest // 16) + 4),
        )
    )
    try:
        return torch.cat([prompt_logits(engine, t).double().log_softmax(-1) for t in tokens])
    finally:
        engine.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a float model folder")
    p.add_argument(
        "--schemes",
        nargs="+",
        type=Scheme.parse,
        default=[Scheme.parse("w8a8"), Scheme.parse("w4a16")],
    )
    p.add_argument("--prompts", choices=["text", "random"], default="text")
    p.add_argument("--positions", type=int, default=500, help="random prompts: how many")
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tokens = prompts(args.model, args.prompts, args.positions)
    logger.info("float32 reference: %s, %d positions", args.model, sum(map(len, tokens)))
    exact = log_probs(args.model, tokens)
    rows = []
    for scheme in args.schemes:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "quantized"
            logger.info("%s: writing and scoring", scheme.label())
            scheme.write(args.model, folder)
            approx = log_probs(folder, tokens)
        kl = (exact.exp() * (exact - approx)).sum(-1)
        top1 = (exact.argmax(-1) == approx.argmax(-1)).double().mean().item()
        rows.append(
            f"| {scheme.label()} | {kl.mean().item():.2e} | {kl.quantile(0.99).item():.2e} "
            f"| {top1:.1%} |"
        )
    print(f"{args.model.name}, {exact.shape[0]} positions ({args.prompts} prompts); {cpu_line()}")
    print("| scheme | KL mean (nats) | KL p99 | top-1 agreement |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
