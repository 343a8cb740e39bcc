"""One Qwen3.5 full-attention layer (``GatedAttention``) at the bench hybrid's shapes
(``tandem make-demo-model --kind qwen3_5 --preset bench``: hidden 768, 8 query heads with
their gates, 2 KV heads, head_dim 128, the first 32 dims rotated), forward through the
layer as it runs, against the same layer with its q/k norms and partial rotary done op by
op (two zero-centred norms, two rotaries of a slice, two ``torch.cat`` copies: the path
before the fused ``qk_norm_rotary`` took them). Also the two q/k parts alone, and the
output gate's ``out * sigmoid(gate)`` alone, to size what fusing it could save.

Decode (48 sequences, contexts around 384) and prefill (one 2,048-token prompt), float32
and bfloat16, two threads by default; the sides interleaved round by round, medians of the
rounds:

    python benchmarks/gated_attention_step.py [--rounds 9] [--calls 20] [--threads 2]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from attention_step import decode_step, prefill_step
from compare import cpu_line
from linear_kernels import _interleaved_ms

from tandem.collectives import SingleRankGroup
from tandem.core.kernels import handles
from tandem.core.kernels.attention_metadata import AttentionMetadata
from tandem.core.kernels.cpu.packed_linear import pack_linear_weights
from tandem.core.layers.gated_attention import GatedAttention
from tandem.core.layers.partial_rotary import PartialRotaryEmbedding
from tandem.core.llm.attention_metadata import build_attention_metadata
from tandem.core.llm.forward_input import ForwardInput

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, ROTARY_DIM = 768, 8, 2, 128, 32
BLOCK_SIZE, MAX_POSITION = 16, 4096


def build_layer(dtype: torch.dtype, num_blocks: int) -> GatedAttention:
    layer = GatedAttention(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, False, 1e-6, SingleRankGroup())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.02
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    layer = layer.to(dtype).eval()
    pack_linear_weights(layer, torch.device("cpu"), dtype)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    layer.attn.bind_cache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    return layer


def qk_op_by_op(
    layer: GatedAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    rotary: PartialRotaryEmbedding,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k norms and partial rotary as the layer ran them before the fused kernel: the
    step's table rows looked up (once per model step then, counted here per layer), each
    norm through its handle, each rotary through the table's own (``RotaryEmbedding.rotate``)
    on the rotated slice, then a copy joining the slice and the rest."""
    cos, sin = rotary.lookup(positions)
    q, k = layer.q_norm(q), layer.k_norm(k)
    q = torch.cat((rotary.rotate(q[..., :ROTARY_DIM], cos, sin), q[..., ROTARY_DIM:]), dim=-1)
    k = torch.cat((rotary.rotate(k[..., :ROTARY_DIM], cos, sin), k[..., ROTARY_DIM:]), dim=-1)
    return q, k


def forward_op_by_op(
    layer: GatedAttention,
    x: torch.Tensor,
    rotary: PartialRotaryEmbedding,
    positions: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """``GatedAttention.forward`` with ``qk_op_by_op`` in place of the fused kernel."""
    tokens, dim = x.shape[0], layer.head_dim
    split = [layer.q_size, layer.kv_size, layer.kv_size]
    query_gate, k, v = layer.qkv_proj(x).split(split, -1)
    q, gate = query_gate.view(tokens, layer.num_heads, 2 * dim).split([dim, dim], dim=-1)
    k = k.view(tokens, layer.num_kv_heads, dim)
    q, k = qk_op_by_op(layer, q, k, rotary, positions)
    v = v.view(tokens, layer.num_kv_heads, dim)
    out = layer.attn(q, k, v, meta) * torch.sigmoid(gate.reshape(tokens, -1))
    result: torch.Tensor = layer.o_proj(out)
    return result


def cases(dtype: torch.dtype, fi: ForwardInput, num_blocks: int) -> dict[str, Callable[[], Any]]:
    layer = build_layer(dtype, num_blocks)
    rotary = PartialRotaryEmbedding(ROTARY_DIM, MAX_POSITION, 1e7, None, dtype)
    meta = build_attention_metadata(fi, torch.device("cpu"))
    tokens = fi.num_tokens
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    qkv = layer.qkv_proj(x)
    split = [layer.q_size, layer.kv_size, layer.kv_size]
    qg, k_cols, _ = qkv.split(split, -1)
    q = qg.view(tokens, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM]
    k = k_cols.view(tokens, KV_HEADS, HEAD_DIM)
    gate = qg.view(tokens, HEADS, 2 * HEAD_DIM)[..., HEAD_DIM:]
    out = torch.randn(tokens, HEADS * HEAD_DIM, generator=gen).to(dtype)
    qk = handles.qk_norm_rotary()
    weights = (layer.q_norm.weight, layer.k_norm.weight, 1e-6, rotary.cos, rotary.sin)
    positions = fi.positions
    # The in-place kernel rewrites q and k each call: the values drift, the work does not.
    return {
        "layer op-by-op": lambda: forward_op_by_op(layer, x, rotary, positions, meta),
        "layer fused": lambda: layer(x, rotary, positions, meta),
        "q/k op-by-op": lambda: qk_op_by_op(layer, q, k, rotary, positions),
        "q/k fused": lambda: qk(q, k, *weights, positions, True, ROTARY_DIM),
        "gate mul": lambda: out * torch.sigmoid(gate.reshape(tokens, -1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20)
    # One thread where other work shares the cores: two spin-waiting threads on an
    # oversubscribed host stall for whole time slices.
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line(), flush=True)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}", flush=True)
    steps: dict[str, Callable[[], tuple[ForwardInput, int]]] = {
        "decode 48": lambda: decode_step(48, 384, BLOCK_SIZE, seed=0),
        "prefill 2048": lambda: prefill_step(1, 2048, BLOCK_SIZE, seed=0),
    }
    for step_name, make in steps.items():
        fi, num_blocks = make()
        for dtype in (torch.float32, torch.bfloat16):
            calls = args.calls if step_name.startswith("decode") else max(1, args.calls // 10)
            with torch.inference_mode():
                # Each side runs once untimed per round (builds, packs, first-touch pages).
                ms = _interleaved_ms(cases(dtype, fi, num_blocks), args.rounds, calls)
            row = "  ".join(f"{name} {1000 * t:.1f} us" for name, t in ms.items())
            print(f"{step_name} {str(dtype).removeprefix('torch.')}: {row}", flush=True)


if __name__ == "__main__":
    main()
