"""Train a Qwen3.5 checkpoint's multi-token-prediction head by self-distillation, so that
speculative decoding's "mtp" method has a real head to measure with (no hub checkpoint can be
fetched here, and the bench models are random).

1. Text: Tandem generates ``--sequences`` continuations of ``--length`` tokens from random
   16-token prompts, sampled at ``--temperature`` (the model's own text).
2. Targets: transformers runs the model over each sequence once (no gradients): its final
   hidden states, and at every position its greedy choice of the next token.
3. The head (``models/mtp_training.py``), started from the checkpoint's last full-attention
   layer (``mtp_writer.initial_head``), learns at position t, from the token at t + 1 and
   the model's state at t, the model's greedy choice at t + 2: exactly what a greedy
   verification accepts. The model's embedding and lm_head stay frozen (they are shared).
4. The head goes into the checkpoint (``mtp.safetensors``, ``mtp_num_hidden_layers: 1``);
   the printed accuracy on held-out sequences before and after training is the fraction of
   greedy drafts the verification would accept.

    .tox/tests/bin/python benchmarks/train_mtp_head.py MODEL [--steps 300] [--sequences 96]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

import torch

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import CacheConfig, EngineConfig, ModelLoadConfig, SchedulerConfig
from tandem.core.models.mtp_training import TrainableHead, load_reference_model, text_config
from tandem.core.models.mtp_writer import initial_head, write_mtp_head

logger = logging.getLogger("train_mtp_head")


def generate_text(
    folder: Path, sequences: int, length: int, temperature: float, seed: int
) -> list[list[int]]:
    """The model's own continuations (prompt included) of random 16-token prompts."""
    engine = LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(folder), dtype="float32"),
            cache=CacheConfig(enable_prefix_cache=False),
            scheduler=SchedulerConfig(max_seqs_per_batch=32, max_tokens_per_batch=2048),
        )
    )
    try:
        vocab = engine.model_config.vocab_size
        rng = random.Random(seed)
        prompts = [[rng.randrange(vocab) for _ in range(16)] for _ in range(sequences)]
        params = [
            SamplingParams(
                max_tokens=length, temperature=temperature, seed=seed + i, ignore_eos=True
            )
            for i in range(sequences)
        ]
        outputs = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    return [p + list(o.token_ids) for p, o in zip(prompts, outputs, strict=True)]


def targets(model: object, texts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the model's final hidden states and its greedy next token everywhere."""
    ids = torch.tensor(texts)
    hidden, greedy = [], []
    with torch.no_grad():
        for start in range(0, len(texts), 8):
            chunk = ids[start : start + 8]
            h = model.model(input_ids=chunk).last_hidden_state  # type: ignore[attr-defined]
            hidden.append(h)
            greedy.append(model.lm_head(h).argmax(-1))  # type: ignore[attr-defined]
    return torch.cat(hidden), torch.cat(greedy)


def head_batch(
    model: object, ids: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's inputs at positions 0 .. T-3 and its labels: the token at t + 1 embedded,
    the model's state at t, the model's greedy choice at t + 2 (its argmax at t + 1)."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids[:, 1:-1])  # type: ignore[attr-defined]
    return embeds, hidden[:, :-2], greedy[:, 1:-1]


def accuracy(head: TrainableHead, model: object, batch: tuple[torch.Tensor, ...]) -> float:
    embeds, hidden, labels = batch
    with torch.no_grad():
        logits = model.lm_head(head(embeds, hidden))  # type: ignore[attr-defined]
    return float((logits.argmax(-1) == labels).float().mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--sequences", type=int, default=96)
    parser.add_argument("--length", type=int, default=240)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)

    started = time.monotonic()
    texts = generate_text(args.model, args.sequences, args.length, args.temperature, args.seed)
    logger.info("generated %d sequences of %d tokens", len(texts), len(texts[0]))
    model = load_reference_model(args.model)
    for p in model.parameters():
        p.requires_grad_(False)
    hidden, greedy = targets(model, texts)
    ids = torch.tensor(texts)
    logger.info("targets computed (%.0f s so far)", time.monotonic() - started)

    head = TrainableHead(text_config(model))
    start = initial_head(args.model, args.seed)
    head.load_head({k: v.float() for k, v in start.items()})
    held = head_batch(model, ids[: args.held_out], hidden[: args.held_out], greedy[: args.held_out])
    train_ids, train_hidden, train_greedy = (t[args.held_out :] for t in (ids, hidden, greedy))
    before = accuracy(head, model, held)
    logger.info("held-out draft accuracy before training: %.3f", before)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.steps + 1):
        pick = torch.randint(len(train_ids), (args.batch,), generator=gen)
        embeds, state, labels = head_batch(
            model, train_ids[pick], train_hidden[pick], train_greedy[pick]
        )
        logits = model.lm_head(head(embeds, state))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == args.steps:
            logger.info(
                "step %d/%d: loss %.3f, held-out accuracy %.3f (%.0f s)",
                step,
                args.steps,
                loss.item(),
                accuracy(head, model, held),
                time.monotonic() - started,
            )
    after = accuracy(head, model, held)
    dtype = next(iter(start.values())).dtype  # the checkpoint's
    path = write_mtp_head(args.model, head.head(dtype))
    print(f"held-out greedy draft accuracy: {before:.3f} before, {after:.3f} after training")
    print(f"wrote {path} ({args.steps} steps, {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
