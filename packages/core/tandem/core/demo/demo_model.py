"""The embedded default model: a small Qwen3-architecture model with random weights (fixed
seed) and a byte-level BPE tokenizer trained on generated text, written in the Hugging Face
layout so a fresh machine can serve without any download. Same arguments, same bytes."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen uses it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SUBJECTS = [
    "the engine",
    "a worker",
    "the scheduler",
    "every device",
    "the model",
    "a request",
    "the cache",
    "one thread",
    "the server",
    "a user",
    "the tokenizer",
    "each rank",
]
_VERBS = [
    "serves",
    "schedules",
    "reads",
    "writes",
    "frees",
    "binds",
    "loads",
    "streams",
    "samples",
    "gathers",
    "reduces",
    "waits for",
    "answers",
    "counts",
    "splits",
]
_OBJECTS = [
    "the prompt",
    "a block",
    "the weights",
    "every token",
    "the next batch",
    "its stream",
    "a checkpoint",
    "the logits",
    "two devices",
    "the KV cache",
    "an error",
    "the output",
]
_EXTRAS = [
    "quickly",
    "in order",
    "once",
    "on the CPU",
    "without waiting",
    "at once",
    "again",
    "in one process",
    "for every layer",
    "before serving",
    "after each step",
]
_WORDS = [
    "hello",
    "world",
    "Tandem",
    "NPU",
    "Ascend",
    "token",
    "batch",
    "prefill",
    "decode",
    "attention",
    "rotary",
    "norm",
    "tensor",
    "parallel",
    "über",
    "café",
    "naïve",
    "日本",
    "数据",
    "模型",
    "😀",
    "→",
    "≤",
    "λ",
    "Ω",
    "0",
    "1",
    "42",
    "2026",
    "3.14",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ":",
    ";",
    '"',
    "'",
    "#",
    "def",
    "return",
    "import",
    "class",
]


@dataclass(frozen=True)
class DemoModelSpec:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    # Deliberately not hidden_size / num_heads, as in Qwen3.
    head_dim: int = 64
    vocab_size: int = 2048
    max_position_embeddings: int = 4096
    seed: int = 0
    # Standard deviation of the random weights.
    init_std: float = 0.02
    # Dtype of the saved weights (and the config's ``dtype``).
    dtype: str = "float32"


# Named sizes for `tandem make-demo-model --preset`. "bench" is the real-size model the
# benchmarks run on (Qwen3-shaped, 111M parameters): per-token costs that a tiny model hides
# (weights and KV streamed from memory every step) dominate it as they do real serving.
PRESETS: dict[str, DemoModelSpec] = {
    "demo": DemoModelSpec(),
    "bench": DemoModelSpec(
        hidden_size=1024,
        intermediate_size=2816,
        num_layers=8,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        vocab_size=16384,
        max_position_embeddings=4096,
        dtype="bfloat16",
    ),
}


def tiny_spec(init_std: float = 0.2) -> DemoModelSpec:
    """A very small demo model for tests: quick to build and run. The default std of 0.2
    keeps greedy choices separated by real margins rather than by float rounding."""
    return DemoModelSpec(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=512,
        max_position_embeddings=512,
        init_std=init_std,
    )


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ng", "qu"]


def demo_corpus(seed: int, num_lines: int = 4000, pseudo_words: int = 0) -> list[str]:
    """Generated text for the tokenizer; ``pseudo_words`` more lines of made-up words give
    BPE enough distinct pieces for a large vocabulary (the English-like lines alone stop
    at about 2,000 tokens)."""
    rng = random.Random(seed)
    lines = [
        " ".join(
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 5)))
            for _ in range(rng.randint(4, 12))
        )
        for _ in range(pseudo_words)
    ]
    for _ in range(num_lines):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(
                f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
                f"{rng.choice(_OBJECTS)} {rng.choice(_EXTRAS)}."
            )
        elif kind == 1:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))))
        elif kind == 2:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"Question: what is {a} + {b}? Answer: {a + b}.")
        else:
            lines.append(
                f"<|im_start|>user\n{rng.choice(_WORDS)} {rng.choice(_OBJECTS)}?<|im_end|>\n"
                f"<|im_start|>assistant\n{rng.choice(_SUBJECTS).capitalize()} "
                f"{rng.choice(_VERBS)} {rng.choice(_OBJECTS)}.<|im_end|>"
            )
    return lines


def train_tokenizer(vocab_size: int, seed: int) -> str:
    """A byte-level BPE tokenizer (the tokenizer.json text) trained on the demo corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Only vocabularies larger than the English-like lines give get made-up words, so the
    # default demo model keeps its bytes.
    extra = 0 if vocab_size <= 2048 else 8 * vocab_size
    tokenizer.train_from_iterator(demo_corpus(seed, pseudo_words=extra), trainer=trainer)
    text: str = tokenizer.to_str(pretty=True)
    return text


@dataclass(frozen=True)
class DemoTokens:
    """What a demo model's config needs to know of its tokenizer."""

    vocab_size: int
    bos_token_id: int
    eos_token_id: int


def write_tokenizer(
    out: Path, vocab_size: int, max_position_embeddings: int, seed: int
) -> DemoTokens:
    """The demo tokenizer (trained BPE, ChatML template) and generation_config.json in
    ``out``: every demo model's text side."""
    logger.info("training the demo tokenizer (%d tokens)", vocab_size)
    tokenizer_json = train_tokenizer(vocab_size, seed)
    vocab = len(json.loads(tokenizer_json)["model"]["vocab"])
    ids = {t["content"]: t["id"] for t in json.loads(tokenizer_json)["added_tokens"]}
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return DemoTokens(vocab, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])


def _weights(spec: DemoModelSpec, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * spec.init_std

    h, hd = spec.hidden_size, spec.head_dim
    w = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(spec.num_heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = normal(spec.num_kv_heads * hd, h)
        w[p + "self_attn.v_proj.weight"] = normal(spec.num_kv_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, spec.num_heads * hd)
        w[p + "self_attn.q_norm.weight"] = torch.ones(hd)
        w[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        w[p + "mlp.gate_proj.weight"] = normal(spec.intermediate_size, h)
        w[p + "mlp.up_proj.weight"] = normal(spec.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = normal(h, spec.intermediate_size)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return w


def write_demo_model(folder: str | Path, spec: DemoModelSpec | None = None) -> Path:
    spec = spec or DemoModelSpec()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokens = write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings, spec.seed)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": tokens.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": tokens.bos_token_id,
        "eos_token_id": tokens.eos_token_id,
        "dtype": spec.dtype,
        "tandem_demo_spec": asdict(spec),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    dtype = getattr(torch, spec.dtype)
    weights = {name: w.to(dtype) for name, w in _weights(spec, tokens.vocab_size).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("wrote the demo model to %s", out)
    return out
