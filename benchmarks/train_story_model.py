"""Train a small Qwen3.5 hybrid on stories the pretrained stories260k tells, so that its text
has structure a multi-token-prediction head can learn (random bench models have none: their
next-but-one token is unpredictable without running the whole network, see
``results/2026-12-05-speculative-zen4``). The model is then a real target for
``train_mtp_head.py`` and speculative decoding's "mtp" method.

1. Corpus: Tandem runs stories260k (``../shared/models/stories260k``, its README) from BOS,
   sampled at ``--temperature``, ``--stories`` stories of ``--length`` tokens.
2. Model: transformers' ``Qwen3_5ForCausalLM``, three Gated DeltaNet layers then one gated
   full-attention layer per ``--layers`` group of four, hidden ``--hidden``, stories260k's
   vocabulary (512) and tokenizer, trained from scratch on next-token cross entropy.
3. Saved in the Hugging Face layout (float32 safetensors) with stories260k's tokenizer.

    .tox/tests/bin/python benchmarks/train_story_model.py OUT [--steps 800] [--hidden 192]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path

import torch

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig

logger = logging.getLogger("train_story_model")
STORIES = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260k"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def tell_stories(folder: Path, stories: int, length: int, temperature: float) -> torch.Tensor:
    """[stories, length + 1] token ids, BOS first."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(folder), dtype="float32"),
            cache=CacheConfig(enable_prefix_cache=False),
            scheduler=SchedulerConfig(max_seqs_per_batch=64, max_tokens_per_batch=4096),
        )
    )
    try:
        params = [
            SamplingParams(max_tokens=length, temperature=temperature, seed=i, ignore_eos=True)
            for i in range(stories)
        ]
        outputs = engine.generate([[1]] * stories, params)
    finally:
        engine.shutdown()
    return torch.tensor([[1, *o.token_ids] for o in outputs])


def build_model(hidden: int, groups: int) -> torch.nn.Module:
    import transformers

    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    config = transformers.Qwen3_5TextConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=4 * groups,
        layer_types=layer_types * groups,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model: torch.nn.Module = transformers.Qwen3_5ForCausalLM(config)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stories", type=int, default=768)
    parser.add_argument("--length", type=int, default=255)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not STORIES.is_dir():
        print(f"needs the pretrained stories260k at {STORIES}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    started = time.monotonic()
    corpus = tell_stories(STORIES, args.stories, args.length, args.temperature)
    logger.info("corpus: %d stories of %d tokens", *corpus.shape)
    model = build_model(args.hidden, args.groups)
    logger.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    for step in range(1, args.steps + 1):
        batch = corpus[torch.randint(len(corpus), (args.batch,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.steps:
            logger.info(
                "step %d/%d: loss %.3f (%.0f s)",
                step,
                args.steps,
                loss.item(),
                time.monotonic() - started,
            )
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out), safe_serialization=True)  # type: ignore[operator]
    for name in TOKENIZER_FILES:
        shutil.copy(STORIES / name, args.out / name)
    print(f"wrote {args.out} ({args.steps} steps, final loss {loss.item():.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
