"""torch_npu's fused ops as the model kernels (``kernels/npu/``), through the stand-in, against
the torch references: paged decode and prefill attention (GQA, head sizes 64 and 128, block
sizes 16 and 128, ragged contexts, chunks after a cached prefix), the cache write, norms,
rotary with q/k norm, SwiGLU and the routed experts (top-k 2, experts with no rows).

Tolerances: the references run in float32 on the same (rounded) inputs; the stand-in computes
each op in float32 and rounds its result once to the output dtype, and the MoE chain rounds
three times on the way (the gate/up product, SwiGLU, the down product). float32 agrees to 1e-5
relative; in float16 and bfloat16 every element is within two roundings at the output's scale,
2 * eps * max|reference| (measured over 20 seeds: MoE 0.88 / 0.97 eps * max, the norms 3.8 /
0.5 ulps of the element itself, which is smaller)."""

from __future__ import annotations

import pytest
import torch

from tandem.core.kernels.npu import activation, attention, fused_moe, norms, rotary
from tandem.core.kernels.reference import elementwise as ref
from tandem.core.kernels.reference import paged_attention as attention_ref
from tandem.core.kernels.reference.fused_moe import fused_moe as reference_fused_moe
from tandem.core.kernels.reference.fused_moe import topk_softmax as reference_topk_softmax
from tandem.core.llm.attention_metadata import build_attention_metadata

from ..cpu.attention_steps import make_step

HALVES = [torch.float16, torch.bfloat16]


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    want = want.float()
    bound = 1e-5 * (1 + want.abs())
    if dtype is not torch.float32:
        bound = bound + 2 * torch.finfo(dtype).eps * want.abs().max()
    err = (got.float() - want).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(4, 2, 64, 16), (8, 1, 128, 128), (4, 4, 128, 16)])  # fmt: skip
def test_attention_matches_the_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim + block_size + heads)
    num_blocks = 2048 // block_size
    step = make_step(
        [1, 5, block_size + 3, 70],
        [(0, 9), (block_size + 5, 6), (0, 1)],
        block_size=block_size,
        num_blocks=num_blocks,
        gen=gen,
    )
    meta = build_attention_metadata(step, torch.device("cpu"))
    assert meta.decode is not None and meta.prefill is not None
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    num_tokens = step.positions.shape[0]
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
    # The cache write, then both groups, each against the reference on the same caches.
    mine = (k_cache.clone(), v_cache.clone())
    attention.write_kv_cache(k, v, mine[0], mine[1], meta)
    attention_ref.write_kv_cache(k, v, k_cache, v_cache, meta)
    assert torch.equal(mine[0], k_cache) and torch.equal(mine[1], v_cache)
    nd, scale = meta.num_decode_tokens, head_dim**-0.5
    for kernel, reference, group, rows in (
        (attention.paged_decode, attention_ref.reference_decode, meta.decode, slice(0, nd)),
        (attention.paged_prefill, attention_ref.reference_prefill, meta.prefill, slice(nd, None)),
    ):
        out = torch.empty_like(q[rows])
        got = kernel(q[rows], k[rows], v[rows], k_cache, v_cache, group, scale, out)
        want = torch.empty(q[rows].shape)
        wide = (k_cache.float(), v_cache.float())
        reference(q[rows].float(), k[rows], v[rows], wide[0], wide[1], group, scale, want)
        assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES])
def test_norms_activation_and_rotary_match_the_references(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(7, 96, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    assert_close(
        norms.rms_norm(x, weight, 1e-6), ref.rms_norm(x.float(), weight.float(), 1e-6), dtype
    )
    y, summed = norms.add_rms_norm(x, residual, weight, 1e-6)
    want_y, want_sum = ref.add_rms_norm(x.float(), residual.float(), weight.float(), 1e-6)
    assert_close(y, want_y, dtype)
    assert_close(summed, want_sum, dtype)
    gate_up = torch.randn(5, 2 * 48, generator=gen).to(dtype)
    assert_close(
        activation.gated_silu(gate_up), ref.GATED_ACTIVATIONS["silu"](gate_up.float()), dtype
    )
    # q/k as views of a fused projection, Qwen3's per-head norm, positions out of order.
    qkv = torch.randn(6, (4 + 2 + 2) * 64, generator=gen).to(dtype)
    q, k = qkv[:, : 4 * 64].view(6, 4, 64), qkv[:, 4 * 64 : 6 * 64].view(6, 2, 64)
    qw, kw = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype), torch.ones(64, dtype=dtype)
    angles = torch.arange(40).unsqueeze(1) * 0.1 * torch.arange(1, 33).unsqueeze(0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.tensor([3, 0, 39, 7, 7, 21])
    got_q, got_k = rotary.qk_norm_rotary(q, k, qw, kw, 1e-6, cos, sin, positions)
    want_q, want_k = ref.qk_norm_rotary(
        q.float(), k.float(), qw.float(), kw.float(), 1e-6, cos.float(), sin.float(), positions
    )
    assert_close(got_q, want_q, dtype)
    assert_close(got_k, want_k, dtype)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want = ref.rotary(q.float(), c.float(), s.float())
    assert_close(rotary.rotary(q, c, s), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES])
def test_zero_centered_norm_and_partial_rotary_match_the_reference(dtype: torch.dtype) -> None:
    """Qwen3.5's gated attention: q between its output gates, weights offset from one, the
    first 32 of 128 dims rotated."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, (2 * 4 + 2 * 2) * 128, generator=gen).to(dtype)
    q = qkv[:, : 8 * 128].view(6, 4, 256)[..., :128]
    k = qkv[:, 8 * 128 : 10 * 128].view(6, 2, 128)
    qw, kw = ((0.1 * torch.randn(128, generator=gen)).to(dtype) for _ in "qk")
    angles = torch.arange(40).unsqueeze(1) * 0.1 * torch.arange(1, 17).unsqueeze(0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.tensor([3, 0, 39, 7, 7, 21])
    got_q, got_k = rotary.qk_norm_rotary(q, k, qw, kw, 1e-6, cos, sin, positions, True, 32)
    want_q, want_k = ref.qk_norm_rotary(
        q.float(), k.float(), qw.float(), kw.float(), 1e-6, cos.float(), sin.float(),
        positions, True, 32,
    )  # fmt: skip
    assert_close(got_q, want_q, dtype)
    assert_close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES])
def test_the_routed_experts_match_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    experts, hidden, inter, tokens, k = 6, 32, 48, 9, 2
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(dtype)
    w2 = (0.2 * torch.randn(experts, hidden, inter, generator=gen)).to(dtype)
    # Experts 1 and 4 get no rows; every token's two experts differ.
    ids = torch.tensor([[0, 2], [3, 5], [2, 0], [5, 3], [0, 3], [2, 5], [3, 0], [5, 2], [0, 5]])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1)
    got = fused_moe.fused_moe(x, w13, w2, weights, ids, "silu")
    want = reference_fused_moe(x.float(), w13.float(), w2.float(), weights, ids, "silu")
    assert_close(got, want, dtype)


@pytest.mark.usefixtures("standin_torch_npu")
def test_an_npu_runtime_resolves_torch_npu_ops_and_falls_back_by_dtype() -> None:
    """NpuRuntime lists ("torch_npu", "triton"): the fused op where torch_npu takes the dtype,
    the next family (or the reference) where it does not."""
    from tandem.core.kernels import handles
    from tandem.core.kernels.triton.loading import triton_usable

    families = ("torch_npu", "triton")
    assert handles.rms_norm().choose(families, torch.float32) is norms.rms_norm
    decode = handles.paged_attention_decode(128)
    assert decode.choose(families, torch.bfloat16) is attention.paged_decode
    fallback = decode.choose(families, torch.float32)  # the attention ops take halves only
    assert fallback is not attention.paged_decode
    if not triton_usable():
        assert fallback is attention_ref.reference_decode
    assert handles.write_kv_cache().choose(families, torch.float32) is attention_ref.write_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_router_top_k_matches_the_reference(dtype: torch.dtype, normalize: bool) -> None:
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, ids = fused_moe.topk_softmax(logits, 2, normalize)
    want_weights, want_ids = reference_topk_softmax(logits, 2, normalize)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int64
    assert weights.dtype == dtype
    assert_close(weights, want_weights, dtype)
