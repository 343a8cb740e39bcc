"""A new model architecture as a plugin, the worked example of ``docs/extending.md``: a
test-only distribution (written here, found through its ``entry_points.txt`` like any installed
package) declares ``ToyParallelForCausalLM``, a parallel-residual decoder (``x + attn(norm(x))
+ mlp(norm(x))``, as GPT-J and Cohere build their blocks) whose checkpoint uses its own config
fields and tensor names. ``tandem generate`` serves it with nothing in Tandem naming it: the
architecture resolves through the ``tandem.models`` entry point, its ``parse_config`` reads
the config, its ``WEIGHTS`` maps the checkpoint onto fused projections, the engine sizes the
paged KV cache from its ``attention_layers()``. Greedy tokens must equal a plain-torch
reference of the same model computed here from the checkpoint tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from harness import write_plugin_distribution
from safetensors.torch import save_file

from tandem.core.demo.demo_model import tiny_spec, write_demo_model

PLUGIN = '''"""A parallel-residual decoder: one norm feeds attention and the MLP side by side."""

from tandem.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.core.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tandem.core.layers.norm import RMSNorm
from tandem.core.layers.rotary import RotaryEmbedding
from tandem.core.kernels import handles
from tandem.core.models.causal_lm import CausalLM
from tandem.core.models.decoder import DecoderAttention
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.weight_mapping import WeightMapping
from torch import nn


class ToyFeedForward(nn.Module):
    def __init__(self, config, group):
        super().__init__()
        self.act = handles.gated_activation("silu")
        self.w13 = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False, group=group
        )
        self.w2 = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, group=group
        )

    def forward(self, x):
        return self.w2(self.act(self.w13(x)))


class ToyBlock(nn.Module):
    def __init__(self, config, group):
        super().__init__()
        self.ln = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DecoderAttention(config, group)
        self.ffn = ToyFeedForward(config, group)

    def forward(self, positions, x, rotary, meta):
        h = self.ln(x)
        return x + self.attn(positions, h, rotary, meta) + self.ffn(h)


class ToyParallelForCausalLM(CausalLM):
    # Its checkpoint keeps q/k/v and w1/w3 apart; the layers fuse them.
    WEIGHTS = WeightMapping(
        fused=(
            ("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
            ("w1", "w13", 0), ("w3", "w13", 1),
        ),
        prefixes=("transformer.",),
    )

    @staticmethod
    def parse_config(raw, arch):
        heads = int(raw["n_head"])
        return ModelConfig(
            architecture=arch, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["d_model"]),
            intermediate_size=int(raw["d_ff"]), num_layers=int(raw["n_layer"]), num_heads=heads,
            num_kv_heads=int(raw["n_kv_head"]), head_dim=int(raw["d_model"]) // heads,
            rms_norm_eps=float(raw["eps"]), rope_theta=float(raw["rope_base"]), rope_scaling=None,
            max_position_embeddings=int(raw["n_ctx"]), tie_word_embeddings=False,
            hidden_act="silu", qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
            checkpoint_dtype="float32", bos_token_id=None, eos_token_ids=(int(raw["eos"]),),
        )

    def __init__(self, config, group, dtype):
        super().__init__(config, group, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, None, dtype
        )
        self.blocks = nn.ModuleList(ToyBlock(config, group) for _ in range(config.num_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group)

    def attention_layers(self):
        return [block.attn.attn for block in self.blocks]

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        for block in self.blocks:
            x = block(positions, x, self.rotary, meta)
        return self.ln_f(x)
'''

ENTRY_POINTS = """[tandem.models]
ToyParallelForCausalLM = toy_model:ToyParallelForCausalLM
"""

HIDDEN, FF, LAYERS, HEADS, KV_HEADS, THETA, EPS = 64, 96, 2, 4, 2, 10000.0, 1e-6
PROMPTS = [[5, 17, 300, 42], [11, 3, 250, 8, 61, 9, 140]]
STEPS = 8


def _write_toy_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """The demo model's tokenizer files, then the toy's own config and tensors."""
    write_demo_model(folder, tiny_spec())
    for stale in folder.glob("*.safetensors"):
        stale.unlink()
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    config = {
        "architectures": ["ToyParallelForCausalLM"],
        "vocab_size": vocab, "d_model": HIDDEN, "d_ff": FF, "n_layer": LAYERS, "n_head": HEADS,
        "n_kv_head": KV_HEADS, "eps": EPS, "rope_base": THETA, "n_ctx": 256, "eos": vocab - 1,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(7)
    head_dim = HIDDEN // HEADS

    def rand(*shape: int) -> torch.Tensor:
        # Wide enough that greedy choices differ by real margins, not by rounding.
        return torch.randn(*shape, generator=gen) * 0.25

    tensors = {
        "transformer.embed_tokens.weight": rand(vocab, HIDDEN),
        "transformer.ln_f.weight": 1 + rand(HIDDEN) * 0.2,
        "lm_head.weight": rand(vocab, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"transformer.blocks.{i}."
        tensors |= {
            p + "ln.weight": 1 + rand(HIDDEN) * 0.2,
            p + "attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "ffn.w1.weight": rand(FF, HIDDEN),
            p + "ffn.w3.weight": rand(FF, HIDDEN),
            p + "ffn.w2.weight": rand(HIDDEN, FF),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _reference_greedy(w: dict[str, torch.Tensor], prompt: list[int]) -> list[int]:
    """The toy model recomputed over the whole sequence at each step, in float64."""
    w = {k: v.double() for k, v in w.items()}
    head_dim = HIDDEN // HEADS
    ids = list(prompt)
    for _ in range(STEPS):
        n = len(ids)
        inv = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        causal = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
        x = w["transformer.embed_tokens.weight"][ids]
        for i in range(LAYERS):
            p = f"transformer.blocks.{i}."
            h = _rms(x, w[p + "ln.weight"])
            q = _rotate((h @ w[p + "attn.q_proj.weight"].T).view(n, HEADS, head_dim), cos, sin)
            k = _rotate((h @ w[p + "attn.k_proj.weight"].T).view(n, KV_HEADS, head_dim), cos, sin)
            v = (h @ w[p + "attn.v_proj.weight"].T).view(n, KV_HEADS, head_dim)
            k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
            v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim**-0.5 + causal
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HIDDEN)
            gate = torch.nn.functional.silu(h @ w[p + "ffn.w1.weight"].T)
            ffn = (gate * (h @ w[p + "ffn.w3.weight"].T)) @ w[p + "ffn.w2.weight"].T
            x = x + attn @ w[p + "attn.o_proj.weight"].T + ffn
        logits = _rms(x[-1], w["transformer.ln_f.weight"]) @ w["lm_head.weight"].T
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _generate(model: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tandem.server.cli.main", "generate", "--model", str(model),
           "--dtype", "float32", "--num-blocks", "32", "--max-tokens", str(STEPS),
           "--ignore-eos", "--json"]  # fmt: skip
    for prompt in PROMPTS:
        cmd += ["--prompt-token-ids", ",".join(map(str, prompt))]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_a_model_architecture_plugs_in_through_an_entry_point(tmp_path: Path) -> None:
    model = tmp_path / "model"
    tensors = _write_toy_checkpoint(model)
    site = write_plugin_distribution(tmp_path, "toy_model", PLUGIN, ENTRY_POINTS)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = _generate(model, env)
    assert done.returncode == 0, done.stderr[-3000:]
    served = [json.loads(line)["token_ids"] for line in done.stdout.splitlines() if line[:1] == "{"]
    assert served == [_reference_greedy(tensors, prompt) for prompt in PROMPTS]


def test_without_the_plugin_the_architecture_is_refused_by_name(tmp_path: Path) -> None:
    model = tmp_path / "model"
    _write_toy_checkpoint(model)
    done = _generate(model, dict(os.environ))
    assert done.returncode != 0
    assert "architecture 'ToyParallelForCausalLM' is not supported" in done.stderr
    assert "Qwen3ForCausalLM" in done.stderr and "Traceback" not in done.stderr
