"""Grow a small trained Qwen3.5 hybrid (and its multi-token-prediction head) to bench size
without changing what it computes: a speed target whose text has structure.

Why: speculative decoding's speed depends on two things, the cost of a step at serving size
and how often drafts are accepted. A random bench-size model has the first and no second (its
text has no structure a head can learn, ``results/2026-12-05-speculative-zen4``); the 2M-
parameter model trained on stories (``train_story_model.py``, with ``train_mtp_head.py``) has
the second and no first (its step is fixed per-step cost). Training a 100M model here takes
hours on two cores. This script gives the small one the shapes, and so the GEMM work and the
weight bytes per step, of a bench model, while it computes the same function:

- the hidden size is padded with zeros: the embeddings, and every projection that writes the
  residual stream (``o_proj``, ``out_proj``, ``down_proj``, the head's ``fc``), are zero in the
  new dimensions, so the stream stays zero there. Projections that read the stream get random
  weights in the new columns (they multiply zeros). Each hidden-size RMSNorm (zero-centred:
  ``x / rms(x) * (1 + w)``) sees its mean square divided by H'/H, so ``1 + w`` is scaled by
  ``sqrt(H / H')`` to compensate; its epsilon (1e-6) grows by H'/H in effect, negligible.
- heads are added (attention, key/value, Gated DeltaNet key and value heads) after the
  existing ones, keeping the ratios so each existing query or value head reads the same key
  head; MLPs get more intermediate rows. The new heads and rows are random, and their columns
  of the output projection zero: they run at full cost and contribute nothing. Head sizes stay
  (a padded head would change the attention scale or the linear attention's normalisation).
- layers are added after the trained ones, in the same pattern (three Gated DeltaNet, one
  full attention): copies of the inflated trained layers with their output projections zero,
  so each adds exactly zero to the stream (exact: ``x + 0``).

The result is float32 like the source; greedy tokens match the small model's up to the
rounding of sums in another order. The figures measured with it are speculative decoding's
on a model of this cost whose drafts are as good as the small head's.

    .tox/tests/bin/python benchmarks/inflate_model.py SMALL OUT [--hidden 768]
        [--intermediate 2560] [--layers 12] [--heads 8] [--kv-heads 4]
        [--linear-key-heads 4] [--linear-value-heads 8]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger("inflate_model")
# Zero-centred RMSNorms over the hidden size (the stream's width changes under them).
_HIDDEN_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "model.norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.pre_fc_norm_embedding.weight",
)


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int

    @classmethod
    def of(cls, config: dict[str, int]) -> Shapes:
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            heads=config["num_attention_heads"],
            kv_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            linear_key_heads=config["linear_num_key_heads"],
            linear_value_heads=config["linear_num_value_heads"],
            linear_key_dim=config["linear_key_head_dim"],
            linear_value_dim=config["linear_value_head_dim"],
        )


class Inflater:
    def __init__(self, small: Shapes, big: Shapes, seed: int) -> None:
        # Each existing query (value) head must read the same key head after the growth.
        if small.heads * big.kv_heads != big.heads * small.kv_heads or (
            small.linear_value_heads * big.linear_key_heads
            != big.linear_value_heads * small.linear_key_heads
        ):
            raise ValueError("the head ratios must stay those of the small model")
        self.small, self.big = small, big
        self.gen = torch.Generator().manual_seed(seed)

    def _random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * 0.02

    def rows(self, w: torch.Tensor, sections: list[tuple[int, int]]) -> torch.Tensor:
        """``w``'s rows in sections of (old, new) rows each, every section grown with
        random rows at its end."""
        parts, start = [], 0
        for old, new in sections:
            part = w[start : start + old]
            parts += [part, self._random(new - old, *w.shape[1:]).to(w.dtype)]
            start += old
        assert start == w.shape[0], (start, w.shape)
        return torch.cat(parts)

    def reader(self, w: torch.Tensor, sections: list[tuple[int, int]]) -> torch.Tensor:
        """A projection reading the stream: rows grown by sections, random new columns."""
        grown = self.rows(w, sections)
        extra = self._random(grown.shape[0], self.big.hidden - self.small.hidden)
        return torch.cat([grown, extra.to(w.dtype)], dim=1)

    def writer(self, w: torch.Tensor, sections: list[tuple[int, int]]) -> torch.Tensor:
        """A projection writing the stream: ``w`` in the top-left corner of zeros, its input
        columns placed by sections (new ones zero), rows for new hidden dims zero."""
        out = torch.zeros(self.big.hidden, sum(new for _, new in sections), dtype=w.dtype)
        src = dst = 0
        for old, new in sections:
            out[: self.small.hidden, dst : dst + old] = w[:, src : src + old]
            src, dst = src + old, dst + new
        return out

    def hidden_norm(self, w: torch.Tensor) -> torch.Tensor:
        scale = math.sqrt(self.small.hidden / self.big.hidden)
        grown = torch.zeros(self.big.hidden, dtype=w.dtype)
        grown[: self.small.hidden] = (1 + w) * scale - 1
        return grown

    def tensor(self, name: str, w: torch.Tensor) -> torch.Tensor:
        s, b = self.small, self.big
        attn_q = [(s.heads * s.head_dim * 2, b.heads * b.head_dim * 2)]
        attn_kv = [(s.kv_heads * s.head_dim, b.kv_heads * b.head_dim)]
        lk = (s.linear_key_heads * s.linear_key_dim, b.linear_key_heads * b.linear_key_dim)
        lv = (s.linear_value_heads * s.linear_value_dim, b.linear_value_heads * b.linear_value_dim)
        lheads = [(s.linear_value_heads, b.linear_value_heads)]
        mlp = [(s.intermediate, b.intermediate)]
        if name.endswith(_HIDDEN_NORMS):
            return self.hidden_norm(w)
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            pad = torch.zeros(w.shape[0], b.hidden - s.hidden, dtype=w.dtype)
            return torch.cat([w, pad], dim=1)
        if name.endswith("mtp.fc.weight"):
            # [H, 2H] over [norm(embedding) | norm(hidden)]: each half placed at its start.
            h = s.hidden
            out = torch.zeros(b.hidden, 2 * b.hidden, dtype=w.dtype)
            out[:h, :h] = w[:, :h]
            out[:h, b.hidden : b.hidden + h] = w[:, h:]
            return out
        table: dict[str, tuple[str, list[tuple[int, int]]]] = {
            "self_attn.q_proj.weight": ("reader", attn_q),
            "self_attn.k_proj.weight": ("reader", attn_kv),
            "self_attn.v_proj.weight": ("reader", attn_kv),
            "self_attn.o_proj.weight": ("writer", [(s.heads * s.head_dim, b.heads * b.head_dim)]),
            "linear_attn.in_proj_qkv.weight": ("reader", [lk, lk, lv]),
            "linear_attn.in_proj_z.weight": ("reader", [lv]),
            "linear_attn.in_proj_b.weight": ("reader", lheads),
            "linear_attn.in_proj_a.weight": ("reader", lheads),
            "linear_attn.out_proj.weight": ("writer", [lv]),
            "linear_attn.conv1d.weight": ("rows", [lk, lk, lv]),
            "linear_attn.A_log": ("rows", lheads),
            "linear_attn.dt_bias": ("rows", lheads),
            "mlp.gate_proj.weight": ("reader", mlp),
            "mlp.up_proj.weight": ("reader", mlp),
            "mlp.down_proj.weight": ("writer", mlp),
        }
        for suffix, (kind, sections) in table.items():
            if name.endswith(suffix):
                if kind == "rows" and suffix.endswith(("A_log", "dt_bias")):
                    # Per-head decay and step: new heads take the existing heads' mean.
                    grown = w.new_full((b.linear_value_heads,), float(w.mean()))
                    grown[: w.shape[0]] = w
                    return grown
                grow: Callable[[torch.Tensor, list[tuple[int, int]]], torch.Tensor]
                grow = getattr(self, kind)
                return grow(w, sections)
        if name.endswith(("q_norm.weight", "k_norm.weight", "linear_attn.norm.weight")):
            return w  # per head: head sizes stay
        raise ValueError(f"no rule for {name} {tuple(w.shape)}")


_OUTPUTS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")


def inflate(small_dir: Path, out: Path, big: dict[str, int], seed: int) -> None:
    config = json.loads((small_dir / "config.json").read_text())
    text = config.get("text_config", config)
    small_shapes = Shapes.of(text)
    big_config = {**text, **big}
    inflater = Inflater(small_shapes, Shapes.of(big_config), seed)
    layer_types = list(text["layer_types"])
    num_small = len(layer_types)
    pattern = layer_types[: min(4, num_small)]
    while len(layer_types) < big["num_hidden_layers"]:
        layer_types.append(pattern[len(layer_types) % len(pattern)])
    big_config["layer_types"] = layer_types

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(small_dir.glob("*.safetensors")):
        for name, w in load_file(str(path)).items():
            tensors[name] = inflater.tensor(name, w)
            logger.info("%s %s -> %s", name, tuple(w.shape), tuple(tensors[name].shape))
    mtp = {n: tensors.pop(n) for n in list(tensors) if n.startswith("mtp.")}
    # New layers: the trained layer of the same kind, its outputs zero (adds exactly 0).
    prefix = "model.layers."
    for index in range(num_small, len(layer_types)):
        source = next(i for i in range(num_small) if layer_types[i] == layer_types[index])
        for name in [n for n in tensors if n.startswith(f"{prefix}{source}.")]:
            rest = name[len(f"{prefix}{source}.") :]
            copy = tensors[name].clone()
            if rest in _OUTPUTS:
                copy.zero_()
            tensors[f"{prefix}{index}.{rest}"] = copy
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if mtp:
        save_file(mtp, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    if "text_config" in config:
        config["text_config"] = big_config
    else:
        config = big_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # The tokenizer and generation config; the weights and their index are written anew.
    for extra in small_dir.iterdir():
        written = extra.suffix == ".safetensors" or extra.name.endswith(".index.json")
        if not written and extra.name != "config.json":
            shutil.copy(extra, out / extra.name)
    count = sum(t.numel() for t in tensors.values()) + sum(t.numel() for t in mtp.values())
    logger.info("wrote %s: %.1fM parameters (head included)", out, count / 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("small", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--linear-key-heads", type=int, default=4)
    parser.add_argument("--linear-value-heads", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    big = {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
    }
    inflate(args.small, args.out, big, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
