"""The torch_npu stand-in's ops against plain torch computations written here, and the
documented refusals."""

from __future__ import annotations

import pytest
import torch
from tandem_sim import torch_npu_standin as npu

torch.manual_seed(0)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def ref_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [S, N, D], k/v [L, KVN, D]; mask [S, L] True = attend. Loops over heads."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    for h in range(q.shape[1]):
        s = (q[:, h].float() @ k[:, h // group].float().T) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)
        out[:, h] = p @ v[:, h // group].float()
    return out


# ---- _npu_reshape_and_cache -------------------------------------------------------------------


def test_reshape_and_cache_writes_slots_and_skips_negative() -> None:
    kc = torch.zeros(4, 16, 2, 8, dtype=torch.float16)
    vc = torch.zeros(4, 16, 2, 8, dtype=torch.float16)
    key = torch.randn(3, 2, 8).half()
    value = torch.randn(3, 2, 8).half()
    slots = torch.tensor([37, -1, 5], dtype=torch.int32)
    npu._npu_reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc[2, 5], key[0]) and torch.equal(vc[0, 5], value[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2


def test_reshape_and_cache_refusals() -> None:
    kc = torch.zeros(2, 16, 2, 8, dtype=torch.float16)
    key = torch.randn(2, 2, 8).half()
    with pytest.raises(TypeError, match="slot_indices must be int32"):
        npu._npu_reshape_and_cache(key, key, kc, kc.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="must not repeat"):
        npu._npu_reshape_and_cache(
            key, key, kc, kc.clone(), torch.tensor([3, 3], dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="must lie in"):
        npu._npu_reshape_and_cache(
            key, key, kc, kc.clone(), torch.tensor([0, 32], dtype=torch.int32)
        )
    with pytest.raises(TypeError, match="share one dtype"):
        npu._npu_reshape_and_cache(
            key, key.bfloat16(), kc, kc.clone(), torch.tensor([0, 1], dtype=torch.int32)
        )


# ---- _npu_paged_attention ---------------------------------------------------------------------


def paged_setup(
    lens: list[int], heads: int, kv_heads: int, d: int, bs: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    kc = torch.randn(num_blocks, bs, kv_heads, d).half()
    vc = torch.randn(num_blocks, bs, kv_heads, d).half()
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max(-(-n // bs) for n in lens) + 1
    rows = []
    for n in lens:
        used = [perm.pop() for _ in range(-(-n // bs))]
        rows.append(used + [-1] * (max_blocks - len(used)))  # -1 padding past the end
    table = torch.tensor(rows, dtype=torch.int32)
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32), rows


def gather(cache: torch.Tensor, row: list[int], n: int) -> torch.Tensor:
    return torch.cat([cache[b] for b in row if b >= 0])[:n]


def test_paged_attention_gqa_ragged_against_loop() -> None:
    lens = [1, 17, 40]
    kc, vc, table, ctx, rows = paged_setup(lens, 8, 2, 32, 16, 12)
    q = torch.randn(3, 8, 32).half()
    out = torch.empty(3, 8, 32, dtype=torch.float16)
    npu._npu_paged_attention(q, kc, vc, 2, 8, 0.2, table, ctx, out)
    for b, n in enumerate(lens):
        ref = ref_attention(q[b : b + 1], gather(kc, rows[b], n), gather(vc, rows[b], n), 0.2, None)
        close(out[b], ref[0])


def test_paged_attention_refusals() -> None:
    kc, vc, table, ctx, _ = paged_setup([5, 9], 4, 2, 16, 16, 4)
    q = torch.randn(2, 4, 16).half()
    out = torch.empty(2, 4, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match="block_table must be int32"):
        npu._npu_paged_attention(q, kc, vc, 2, 4, 1.0, table.long(), ctx, out)
    with pytest.raises(TypeError, match="context_lens must be int32"):
        npu._npu_paged_attention(q, kc, vc, 2, 4, 1.0, table, ctx.long(), out)
    with pytest.raises(ValueError, match="num_heads % num_kv_heads"):
        npu._npu_paged_attention(q, kc, vc, 3, 4, 1.0, table, ctx, out)
    big = torch.randn(2, 256, 2, 16).half()
    with pytest.raises(ValueError, match="block_size <= 128"):
        npu._npu_paged_attention(q, big, big, 2, 4, 1.0, table, ctx, out)
    odd = torch.randn(2, 24, 2, 16).half()
    with pytest.raises(ValueError, match="block_size % 16"):
        npu._npu_paged_attention(q, odd, odd, 2, 4, 1.0, table, ctx, out)
    wide_q = torch.randn(2, 4, 272).half()
    wide = torch.randn(4, 16, 2, 272).half()
    with pytest.raises(ValueError, match=r"head_size must be in \(0, 256\]"):
        npu._npu_paged_attention(
            wide_q, wide, wide, 2, 4, 1.0, table, ctx, torch.empty(2, 4, 272).half()
        )
    with pytest.raises(TypeError, match="query must be float16, bfloat16"):
        npu._npu_paged_attention(q.float(), kc, vc, 2, 4, 1.0, table, ctx, out)
    with pytest.raises(ValueError, match="dimensions"):
        npu._npu_paged_attention(q.reshape(2, 64), kc, vc, 2, 4, 1.0, table, ctx, out)
    bad = table.clone()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match="block_table entries"):
        npu._npu_paged_attention(q, kc, vc, 2, 4, 1.0, bad, ctx, out)
    if torch.device("meta").type != "cpu":
        with pytest.raises(ValueError, match="host"):
            npu._npu_paged_attention(q, kc, vc, 2, 4, 1.0, table, ctx.to("meta"), out)


# ---- npu_fused_infer_attention_score ----------------------------------------------------------

MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def test_fia_tnd_paged_chunked_prefill_right_down_causal() -> None:
    # Two sequences: 3 new tokens after 130 cached, 5 new tokens after 0 cached.
    q_lens, kv_lens, heads, kv_heads, d, bs = [3, 5], [133, 5], 4, 2, 32, 128
    kc, vc, table, _, rows = paged_setup(kv_lens, heads, kv_heads, d, bs, 6)
    q = torch.randn(sum(q_lens), heads, d).half()
    out, lse = npu.npu_fused_infer_attention_score(
        q,
        kc.view(6, bs, -1),
        vc.view(6, bs, -1),
        atten_mask=MASK,
        block_table=table,
        input_layout="TND",
        block_size=bs,
        actual_seq_lengths=[3, 8],
        actual_seq_lengths_kv=kv_lens,
        num_heads=heads,
        num_key_value_heads=kv_heads,
        scale=0.125,
        sparse_mode=3,
    )
    assert out.shape == q.shape and out.dtype == torch.float16 and lse.shape == (1,)
    start = 0
    for b, (n, ln) in enumerate(zip(q_lens, kv_lens, strict=True)):
        i = torch.arange(n).unsqueeze(1)
        j = torch.arange(ln).unsqueeze(0)
        ref = ref_attention(
            q[start : start + n],
            gather(kc, rows[b], ln),
            gather(vc, rows[b], ln),
            0.125,
            j <= i + (ln - n),
        )
        close(out[start : start + n], ref)
        start += n


def test_fia_bsnd_left_up_causal_and_lse() -> None:
    q = torch.randn(2, 6, 4, 16).half()
    k = torch.randn(2, 6, 2, 16).half()
    v = torch.randn(2, 6, 2, 16).half()
    out, lse = npu.npu_fused_infer_attention_score(
        q,
        k,
        v,
        atten_mask=MASK,
        num_heads=4,
        num_key_value_heads=2,
        input_layout="BSND",
        scale=0.25,
        sparse_mode=2,
        softmax_lse_flag=True,
    )
    assert lse.shape == (2, 4, 6, 1) and lse.dtype == torch.float32
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    for b in range(2):
        close(out[b], ref_attention(q[b], k[b], v[b], 0.25, causal))
        s = torch.einsum("snd,lnd->nsl", q[b].float(), k[b].float().repeat_interleave(2, 1))
        s = (s * 0.25).masked_fill(~causal, float("-inf"))
        close(lse[b, :, :, 0], torch.logsumexp(s, -1), tol=1e-3)


def test_fia_bsh_decode_paged_matches_loop() -> None:
    lens, heads, d, bs = [7, 300], 4, 16, 128
    kc, vc, table, _, rows = paged_setup(lens, heads, heads, d, bs, 5)
    q = torch.randn(2, 1, heads * d).half()
    out, _ = npu.npu_fused_infer_attention_score(
        q,
        kc.view(5, bs, -1),
        vc.view(5, bs, -1),
        block_table=table,
        block_size=bs,
        actual_seq_lengths_kv=lens,
        num_heads=heads,
        scale=0.3,
        input_layout="BSH",
    )
    for b, n in enumerate(lens):
        ref = ref_attention(
            q[b].view(1, heads, d), gather(kc, rows[b], n), gather(vc, rows[b], n), 0.3, None
        )
        close(out[b].view(1, heads, d), ref)


def test_fia_refusals() -> None:
    q = torch.randn(1, 4, 2, 16).half()
    with pytest.raises(NotImplementedError, match="sparse_mode=4"):
        npu.npu_fused_infer_attention_score(
            q, q, q, num_heads=2, input_layout="BSND", sparse_mode=4, atten_mask=MASK
        )
    with pytest.raises(ValueError, match="not supported"):
        npu.npu_fused_infer_attention_score(
            q, q, q, num_heads=2, input_layout="BSND", sparse_mode=6
        )
    with pytest.raises(NotImplementedError, match="BNSD_BSND"):
        npu.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="BNSD_BSND")
    with pytest.raises(ValueError, match="needs an atten_mask"):
        npu.npu_fused_infer_attention_score(
            q, q, q, num_heads=2, input_layout="BSND", sparse_mode=3
        )
    with pytest.raises(ValueError, match="compressed"):
        npu.npu_fused_infer_attention_score(
            q, q, q, num_heads=2, input_layout="BSND", sparse_mode=3, atten_mask=MASK[:4, :4]
        )
    with pytest.raises(TypeError, match="float16, bfloat16"):
        npu.npu_fused_infer_attention_score(
            q.float(), q.float(), q.float(), num_heads=2, input_layout="BSND"
        )
    t = torch.randn(5, 2, 16).half()
    with pytest.raises(ValueError, match="cumulative"):
        npu.npu_fused_infer_attention_score(
            t,
            t,
            t,
            num_heads=2,
            input_layout="TND",
            actual_seq_lengths=[3, 2],
            actual_seq_lengths_kv=[3, 5],
        )
    with pytest.raises(ValueError, match="must be given for the TND"):
        npu.npu_fused_infer_attention_score(t, t, t, num_heads=2, input_layout="TND")
    kc = torch.randn(2, 64, 32).half()
    with pytest.raises(ValueError, match="block_size"):
        npu.npu_fused_infer_attention_score(
            torch.randn(1, 4, 32).half(),
            kc,
            kc,
            num_heads=2,
            input_layout="BSH",
            block_table=torch.zeros(1, 2, dtype=torch.int32),
            block_size=64,
            actual_seq_lengths_kv=[10],
        )
    with pytest.raises(TypeError, match="block_table must be int32"):
        npu.npu_fused_infer_attention_score(
            torch.randn(1, 4, 32).half(),
            kc,
            kc,
            num_heads=2,
            input_layout="BSH",
            block_table=torch.zeros(1, 2, dtype=torch.int64),
            block_size=64,
            actual_seq_lengths_kv=[10],
        )
    with pytest.raises(TypeError):
        npu.npu_fused_infer_attention_score(q, q, q, None)  # type: ignore[call-arg]


# ---- norms, swiglu --------------------------------------------------------------------------


def test_rms_norm_and_add_rms_norm() -> None:
    x = torch.randn(3, 4, 64).bfloat16()
    g = torch.randn(64).bfloat16()
    y, rstd = npu.npu_rms_norm(x, g)
    xf = x.float()
    r = 1 / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (3, 4, 1) and y.dtype == torch.bfloat16
    close(rstd, r, tol=1e-4)
    close(y, xf * r * g.float())
    x2 = torch.randn(3, 4, 64).bfloat16()
    y2, rstd2, xs = npu.npu_add_rms_norm(x, x2, g, 1e-5)
    s = x.float() + x2.float()
    r2 = 1 / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-5)
    close(xs, s)
    close(y2, s * r2 * g.float())
    assert rstd2.shape == (3, 4, 1)
    with pytest.raises(TypeError, match="one of the listed pairs"):
        npu.npu_rms_norm(x.float(), g)
    with pytest.raises(ValueError, match="dimensions"):
        npu.npu_rms_norm(torch.randn(64), torch.randn(64))
    with pytest.raises(ValueError, match="trailing dims"):
        npu.npu_rms_norm(x, torch.randn(32).bfloat16())
    with pytest.raises(RuntimeError, match="x1's dtype"):
        npu.npu_add_rms_norm(x, x2.half(), g)


def test_swiglu_gate_is_first_half() -> None:
    x = torch.randn(5, 8)
    a, b = x[:, :4], x[:, 4:]
    close(npu.npu_swiglu(x), torch.nn.functional.silu(a) * b, tol=1e-5)
    close(npu.npu_swiglu(x.T.contiguous(), dim=0), (torch.nn.functional.silu(a) * b).T, tol=1e-5)
    with pytest.raises(ValueError, match="divisible by 2"):
        npu.npu_swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="contiguous"):
        npu.npu_swiglu(torch.randn(8, 4).T)
    with pytest.raises(TypeError):
        npu.npu_swiglu(torch.ones(4, dtype=torch.int32))


# ---- rotary --------------------------------------------------------------------------------


def neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def test_rotary_embedding_neox_and_gptj_in_place() -> None:
    t, d = 5, 16
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(32).float().unsqueeze(1) * inv
    cache = torch.cat((ang.cos(), ang.sin()), dim=-1)
    pos = torch.tensor([0, 3, 7, 31, 2])
    q = torch.randn(t, 3 * d).half()
    k = torch.randn(t, d).half()
    q0, k0 = q.clone(), k.clone()
    npu._npu_rotary_embedding(pos, q, k, d, cache, True)
    c, s = ang[pos].cos().unsqueeze(1), ang[pos].sin().unsqueeze(1)
    close(q, neox(q0.float().view(t, 3, d), c, s).view(t, -1))
    close(k, neox(k0.float().view(t, 1, d), c, s).view(t, -1))
    q = q0.clone()
    npu._npu_rotary_embedding(pos, q, k0.clone(), d, cache, False)
    x = q0.float().view(t, 3, d)
    ev, od = x[..., ::2], x[..., 1::2]
    ref = torch.stack((ev * c - od * s, od * c + ev * s), dim=-1).flatten(-2)
    close(q, ref.view(t, -1))
    with pytest.raises(ValueError, match="partial rotary"):
        npu._npu_rotary_embedding(pos, q, k, d, cache[:, :8], True)
    with pytest.raises(ValueError, match="dimensions"):
        npu._npu_rotary_embedding(pos, q.view(t, 3, d), k, d, cache, True)


def test_apply_rotary_pos_emb_tnd_in_place_and_rotary_mul() -> None:
    t, d = 4, 64
    q = torch.randn(t, 4, d)
    k = torch.randn(t, 2, d)
    ang = torch.rand(t, 1, d // 2)
    cos = torch.cat((ang.cos(), ang.cos()), -1)
    sin = torch.cat((ang.sin(), ang.sin()), -1)
    q0, k0 = q.clone(), k.clone()
    qo, ko = npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="TND")
    assert qo is q and ko is k
    close(q, neox(q0, ang.cos(), ang.sin()), tol=1e-5)
    close(k, neox(k0, ang.cos(), ang.sin()), tol=1e-5)
    with pytest.raises(ValueError, match="64 or 128"):
        npu.npu_apply_rotary_pos_emb(q[..., :32], k[..., :32], cos[..., :32], sin[..., :32], "TND")
    with pytest.raises(ValueError, match="950DT"):
        npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="TND", rotary_mode="interleave")
    x = torch.randn(2, 3, 4, d)
    r1 = torch.rand(1, 3, 1, d)
    r2 = torch.rand(1, 3, 1, d)
    close(
        npu.npu_rotary_mul(x, r1, r2),
        x * r1 + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * r2,
        tol=1e-5,
    )
    inter = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    close(npu.npu_rotary_mul(x, r1, r2, "interleave"), x * r1 + inter * r2, tol=1e-5)
    with pytest.raises(ValueError, match="broadcast"):
        npu.npu_rotary_mul(x, torch.rand(1, 2, 1, d), r2)


# ---- MoE -----------------------------------------------------------------------------------


def test_gating_top_k_softmax_row_idx_is_column_major() -> None:
    x = torch.randn(5, 8)
    y, idx, row = npu.npu_moe_gating_top_k_softmax(x, k=3)
    p = torch.softmax(x, -1)
    ty, ti = p.topk(3, -1)
    close(y, ty, tol=1e-6)
    assert torch.equal(idx, ti.int()) and idx.dtype == torch.int32
    assert row.tolist() == [[i + 5 * k for k in range(3)] for i in range(5)]
    with pytest.raises(ValueError, match="0 < k"):
        npu.npu_moe_gating_top_k_softmax(x, k=9)
    with pytest.raises(NotImplementedError, match="finished"):
        npu.npu_moe_gating_top_k_softmax(x, torch.ones(5, dtype=torch.bool), 2)


def test_init_routing_follows_the_documented_reference() -> None:
    n, k = 6, 2
    x = torch.randn(n, 4)
    expert = torch.tensor([[3, 0], [0, 3], [1, 3], [3, 1], [0, 0], [1, 1]], dtype=torch.int32)
    row = torch.arange(n * k, dtype=torch.int32).reshape(k, n).T.contiguous()
    ex, erow, eexp = npu.npu_moe_init_routing(x, row, expert, n)
    order = sorted(range(n * k), key=lambda s: (int(expert.flatten()[s]), s))
    dst_to_src = [int(row.flatten()[s]) for s in order]
    assert eexp.tolist() == sorted(expert.flatten().tolist())
    for j, src in enumerate(dst_to_src):
        assert int(erow[src]) == j
        assert torch.equal(ex[j], x[src % n])
    ex2, _, _ = npu.npu_moe_init_routing(x, row, expert, 2)
    assert ex2.shape == (4, 4)
    with pytest.raises(TypeError, match="int32"):
        npu.npu_moe_init_routing(x, row.long(), expert, n)
    with pytest.raises(ValueError, match="dimensions"):
        npu.npu_moe_init_routing(x, row.flatten(), expert.flatten(), n)


def test_compute_expert_tokens_cumulative_with_empty_experts() -> None:
    s = torch.tensor([0, 0, 2, 2, 2, 4], dtype=torch.int32)
    out = npu.npu_moe_compute_expert_tokens(s, 6)
    assert out.tolist() == [2, 2, 5, 5, 6, 6] and out.dtype == torch.int32
    with pytest.raises(ValueError, match="non-decreasing"):
        npu.npu_moe_compute_expert_tokens(torch.tensor([1, 0], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="2048"):
        npu.npu_moe_compute_expert_tokens(s, 4096)


def test_moe_round_trip_equals_per_token_loop() -> None:
    n, h, inter, experts, k = 7, 16, 8, 5, 2
    x = torch.randn(n, h).half()
    logits = torch.randn(n, experts)
    logits[:, 4] = -1e4  # expert 4 never chosen: zero tokens
    w = torch.randn(experts, h, inter).half() * 0.2
    topv, topi, row = npu.npu_moe_gating_top_k_softmax(logits, k=k)
    ex, erow, eexp = npu.npu_moe_init_routing(x, row, topi, n)
    counts = npu.npu_moe_compute_expert_tokens(eexp, experts)
    assert counts[-1] == counts[-2] == n * k
    (y,) = npu.npu_grouped_matmul(
        [ex], [w], group_list=counts.long(), split_item=2, group_type=0, group_list_type=0
    )
    out = npu.npu_moe_finalize_routing(
        y, None, None, None, topv.half(), erow, topi, drop_pad_mode=0
    )
    ref = torch.zeros(n, inter)
    for i in range(n):
        for j in range(k):
            e = int(topi[i, j])
            ref[i] += float(topv[i, j]) * (x[i].float() @ w[e].float())
    close(out, ref, tol=3e-2)


def test_finalize_routing_modes_bias_skips_and_drops() -> None:
    n, k, h, e = 3, 2, 4, 3
    rows = torch.randn(n * k, h)
    src = torch.randperm(n * k).int()
    scales = torch.rand(n, k)
    experts = torch.randint(0, e, (n, k), dtype=torch.int32)
    bias = torch.randn(e, h)
    skip1, skip2 = torch.randn(n, h), torch.randn(n, h)
    out0 = npu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src, experts, 0)
    out2 = npu.npu_moe_finalize_routing(rows, skip1, skip2, bias, scales, src, experts, 2)
    for out, column in ((out0, True), (out2, False)):  # mode 0 column-, mode 2 row-arranged
        ref = skip1 + skip2
        for i in range(n):
            for j in range(k):
                at = j * n + i if column else i * k + j
                ref[i] += scales[i, j] * (rows[int(src[at])] + bias[int(experts[i, j])])
        close(out, ref, tol=1e-5)
    padded = torch.randn(e, 2, h)
    drop = torch.tensor([0, -1, 5, 3, -1, 1], dtype=torch.int32)
    out1 = npu.npu_moe_finalize_routing(padded, None, None, None, scales, drop, None, 1)
    flat = padded.reshape(-1, h)
    ref = torch.zeros(n, h)
    for i in range(n):
        for j in range(k):
            d = int(drop[j * n + i])
            if d >= 0:
                ref[i] += scales[i, j] * flat[d]
    close(out1, ref, tol=1e-5)
    with pytest.raises(ValueError, match="skip2 must be None"):
        npu.npu_moe_finalize_routing(rows, None, skip2, None, scales, src, experts, 0)
    with pytest.raises(TypeError, match="int32"):
        npu.npu_moe_finalize_routing(rows, None, None, None, scales, src.long(), experts)


def test_grouped_matmul_variants_and_refusals() -> None:
    x = torch.randn(6, 8).bfloat16()
    ws = [torch.randn(8, 4).bfloat16() for _ in range(3)]
    sizes = torch.tensor([2, 0, 4])
    bias = [torch.randn(4) for _ in range(3)]
    (y,) = npu.npu_grouped_matmul(
        [x], ws, bias=bias, group_list=sizes, split_item=3, group_type=0, group_list_type=1
    )
    ref = torch.cat(
        [x[:2].float() @ ws[0].float() + bias[0], x[2:].float() @ ws[2].float() + bias[2]]
    )
    close(y, ref, tol=5e-2)
    outs = npu.npu_grouped_matmul([x, x[:2]], ws[:2], group_type=-1)
    assert len(outs) == 2 and outs[1].shape == (2, 4)
    w3 = torch.stack(ws)
    with pytest.raises(ValueError, match="last value must equal"):
        npu.npu_grouped_matmul(
            [x], [w3], group_list=torch.tensor([2, 2, 5]), split_item=2, group_type=0
        )
    with pytest.raises(TypeError, match="int64"):
        npu.npu_grouped_matmul(
            [x], [w3], group_list=torch.tensor([2, 2, 6]).int(), split_item=2, group_type=0
        )
    with pytest.raises(ValueError, match="split_item 2 or 3"):
        npu.npu_grouped_matmul(
            [x], [w3], group_list=torch.tensor([2, 2, 6]), split_item=0, group_type=0
        )
    with pytest.raises(TypeError, match="bias"):
        npu.npu_grouped_matmul(
            [x],
            ws,
            bias=[b.bfloat16() for b in bias],
            group_list=sizes,
            split_item=2,
            group_type=0,
            group_list_type=1,
        )
    with pytest.raises(NotImplementedError, match="group_type=2"):
        npu.npu_grouped_matmul([x], [w3], group_list=sizes, split_item=2, group_type=2)
    with pytest.raises(NotImplementedError, match="scale"):
        npu.npu_grouped_matmul(
            [x], [w3], scale=[torch.ones(4)], group_list=sizes, split_item=2, group_type=0
        )
    with pytest.raises(TypeError):
        npu.npu_grouped_matmul([x], [w3], None)  # type: ignore[call-arg]


def test_mixing_device_types_is_refused() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="one device"):
        npu.npu_rms_norm(x, torch.randn(8, device="meta"))
