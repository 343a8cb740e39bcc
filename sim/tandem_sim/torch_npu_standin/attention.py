"""Attention over paged or contiguous KV: ``_npu_paged_attention`` (decode) and
``npu_fused_infer_attention_score`` (prefill, chunked prefill and decode)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._rules import (
    HALVES,
    NpuValueError,
    host_int_list,
    not_implemented,
    require,
    require_contiguous,
    require_dtype,
    require_rank,
    require_same_dtype,
    same_device,
)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention of one sequence: q [S, N, D], k [L, KVN, D], v [L, KVN, Dv];
    ``allowed`` [S, L] (True = computed) or None. Heads of a GQA group share KV head
    ``h // (N // KVN)``. Rows with nothing to attend to give zeros and lse -inf."""
    n, kvn = q.shape[1], k.shape[1]
    group = n // kvn
    qf = q.float()
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("snd,lnd->nsl", qf, kf) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [N, S]
    empty = torch.isinf(lse) & (lse < 0)
    probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(empty.unsqueeze(-1), 0.0))
    probs = probs.masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("nsl,lnd->snd", probs, vf)
    return out, lse.transpose(0, 1)  # [S, N, Dv], [S, N]


# ---------------------------------------------------------------------------------------------
# _npu_paged_attention
# ---------------------------------------------------------------------------------------------

_PA = "_npu_paged_attention"
_PA_DOC = (
    "ATB PagedAttentionOperation, hiascend CANN 8.0.RC3 ascendtbapi ascendtb_01_0083 / "
    "8.2.RC1 ascendtb_01_0206; the torch_npu docstring of _npu_paged_attention_v2 in "
    "op-plugin op_plugin/python/atb/_atb_api_docs.py; schema "
    "op_plugin/ops/atb/PagedAttentionAtb.cpp"
)


def _npu_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    *,
    workspace: torch.Tensor | None = None,
) -> None:
    """Decode attention over a paged KV cache, one query token per sequence, into ``out``.

    Schema (op-plugin ``PagedAttentionAtb.cpp``)::

        _npu_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache,
            int num_kv_heads, int num_heads, float scale_value, Tensor block_table,
            Tensor context_lens, Tensor(a!) out, *, Tensor? workspace=None) -> ()

    The wrapper runs ATB's PagedAttentionOperation with mask UNDEFINED, no quantisation,
    BSND layout; its rules (ATB page and the ``_npu_paged_attention_v2`` docstring):

    - ``query`` [num_tokens, num_heads, head_size], float16 / bfloat16 (int8 only with
      quantisation, which this entry point never enables).
    - ``key_cache`` [num_blocks, block_size, kv_head_num, head_size_k], ``value_cache``
      [num_blocks, block_size, kv_head_num, head_size_v], ND, the query's dtype.
    - ``block_table`` int32 [num_tokens, max_num_blocks_per_query], on the device.
    - ``context_lens`` int32 [batch], a HOST tensor (the "cpu/npu" column says cpu): a
      context_lens on another device type than cpu is refused. batch == num_tokens (one query
      token per sequence).
    - ``out`` [num_tokens, num_heads, head_size_v], float16 / bfloat16, the query's dtype.
    - kvHeadNum == 0 means num_heads; otherwise num_heads % num_kv_heads == 0 (GQA).
    - block_size % 16 == 0 and block_size <= 128, except block_size == head_size == 256
      (the v2 docstring allows that one case; its own example uses it).
    - head_size in (0, 256]; key and value head sizes may differ, each in (0, 576], and when
      either exceeds 256, block_size <= 128. The multiple-of-16 head size rule applies to NZ
      caches only, which CPU tensors never are, so it is not enforced.
    - block table entries a sequence uses (the first ceil(context_len / block_size)) must lie
      in [0, num_blocks); the ATB page says -1 ends a row, so later entries are not read.
    - Not documented: a context_len of 0 (the stand-in writes zeros) and values beyond the
      table's capacity (refused: they would read past the row).
    """
    same_device(
        _PA,
        {
            "query": query,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "block_table": block_table,
            "out": out,
        },
    )
    del workspace  # a scratch buffer on the device; nothing to model
    require_rank(_PA, "query", query, (3,), _PA_DOC)
    require_rank(_PA, "key_cache", key_cache, (4,), _PA_DOC)
    require_rank(_PA, "value_cache", value_cache, (4,), _PA_DOC)
    require_rank(_PA, "block_table", block_table, (2,), _PA_DOC)
    require_rank(_PA, "context_lens", context_lens, (1,), _PA_DOC)
    require_rank(_PA, "out", out, (3,), _PA_DOC)
    require_dtype(_PA, "query", query, HALVES, _PA_DOC)
    require_same_dtype(
        _PA,
        {"query": query, "key_cache": key_cache, "value_cache": value_cache, "out": out},
        _PA_DOC,
    )
    require_dtype(_PA, "block_table", block_table, (torch.int32,), _PA_DOC)
    require_dtype(_PA, "context_lens", context_lens, (torch.int32,), _PA_DOC)
    if context_lens.device.type != "cpu":
        raise NpuValueError(
            f"{_PA}: context_lens must be a host (cpu) tensor, got {context_lens.device} "
            f"({_PA_DOC})"
        )
    num_tokens, q_heads, head_size = query.shape
    num_blocks, block_size, kv_heads, head_size_k = key_cache.shape
    head_size_v = value_cache.shape[3]
    require(num_heads > 0, _PA, f"num_heads must be > 0, got {num_heads}", _PA_DOC)
    require(num_kv_heads >= 0, _PA, f"num_kv_heads must be >= 0, got {num_kv_heads}", _PA_DOC)
    expect_kv = num_kv_heads or num_heads
    require(
        num_heads % expect_kv == 0,
        _PA,
        f"num_heads % num_kv_heads must be 0, got {num_heads} and {num_kv_heads}",
        _PA_DOC,
    )
    require(
        q_heads == num_heads,
        _PA,
        f"query's head dim must equal num_heads={num_heads}, got {q_heads}",
        _PA_DOC,
    )
    require(
        kv_heads == expect_kv and value_cache.shape[2] == expect_kv,
        _PA,
        f"the caches' kv_head_num must equal num_kv_heads (num_heads when 0) = {expect_kv}, "
        f"got {kv_heads} and {value_cache.shape[2]}",
        _PA_DOC,
    )
    require(
        tuple(value_cache.shape[:2]) == (num_blocks, block_size),
        _PA,
        "key_cache and value_cache must share [num_blocks, block_size]",
        _PA_DOC,
    )
    require(
        head_size == head_size_k,
        _PA,
        f"query head_size {head_size} must equal key_cache head_size_k {head_size_k}",
        _PA_DOC,
    )
    require(
        block_size % 16 == 0,
        _PA,
        f"block_size % 16 == 0 (hardware limit), got {block_size}",
        _PA_DOC,
    )
    require(
        block_size <= 128 or (block_size == 256 and head_size_k == head_size_v == 256),
        _PA,
        f"block_size <= 128 (hardware limit; 256 only with head_size 256), got {block_size}",
        _PA_DOC,
    )
    if head_size_k == head_size_v:
        require(
            0 < head_size_k <= 256,
            _PA,
            f"head_size must be in (0, 256], got {head_size_k}",
            _PA_DOC,
        )
    else:
        require(
            0 < head_size_k <= 576 and 0 < head_size_v <= 576,
            _PA,
            f"differing key/value head sizes must be in (0, 576], got {head_size_k}, {head_size_v}",
            _PA_DOC,
        )
        require(
            max(head_size_k, head_size_v) <= 256 or block_size <= 128,
            _PA,
            "block_size <= 128 when a head size exceeds 256",
            _PA_DOC,
        )
    require(
        block_table.shape[0] == num_tokens and context_lens.shape[0] == num_tokens,
        _PA,
        f"block_table rows and context_lens length must equal num_tokens={num_tokens} (one "
        f"query token per sequence), got {block_table.shape[0]} and {context_lens.shape[0]}",
        _PA_DOC,
    )
    require(
        tuple(out.shape) == (num_tokens, num_heads, head_size_v),
        _PA,
        f"out must be [num_tokens, num_heads, head_size_v] = "
        f"{(num_tokens, num_heads, head_size_v)}, got {tuple(out.shape)}",
        _PA_DOC,
    )
    lens = [int(x) for x in context_lens.tolist()]
    table = block_table.to(torch.int64).cpu()
    max_blocks = block_table.shape[1]
    results = []
    for b, length in enumerate(lens):
        require(length >= 0, _PA, f"context_lens[{b}] must be >= 0, got {length}", _PA_DOC)
        used = -(-length // block_size)
        require(
            used <= max_blocks,
            _PA,
            f"context_lens[{b}]={length} needs {used} blocks, block_table has {max_blocks}",
            _PA_DOC,
        )
        ids = table[b, :used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise NpuValueError(
                f"{_PA}: block_table entries must lie in [0, num_blocks={num_blocks}), "
                f"row {b} uses {ids.tolist()} ({_PA_DOC})"
            )
        ids = ids.to(key_cache.device)
        k = key_cache[ids].reshape(-1, kv_heads, head_size_k)[:length]
        v = value_cache[ids].reshape(-1, kv_heads, head_size_v)[:length]
        o, _ = _attend(query[b : b + 1], k, v, float(scale_value), None)
        results.append(o[0])
    if results:
        out.copy_(torch.stack(results).to(out.dtype))


# ---------------------------------------------------------------------------------------------
# npu_fused_infer_attention_score
# ---------------------------------------------------------------------------------------------

_FIA = "npu_fused_infer_attention_score"
_FIA_DOC = (
    "torch_npu.npu_fused_infer_attention_score, op-plugin "
    "docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md; schema "
    "op_plugin/config/op_plugin_functions.yaml"
)
_MASK_POLARITY_DOC = (
    "mask value 1/True = position not computed: the torch_npu.npu_fusion_attention page "
    "(hiascend PyTorch 6.0.0 apiref ptaoplist_000850) for the same FlashAttention family"
)
_LAYOUTS = ("BSH", "BSND", "BNSD", "TND")
_OTHER_LAYOUTS = ("BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND_NTD", "NTD_TND", "NTD")
_COMPRESSED_MASK_SHAPES = ((2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048))


def _per_batch(name: str, values: list[int] | None, batch: int, default: int) -> list[int]:
    """Non-TND ``actual_seq_lengths(_kv)``: length 1 is shared by every batch; length >= batch
    takes the first batch values; None means the full S."""
    if values is None:
        return [default] * batch
    if len(values) == 1:
        return values * batch
    require(
        len(values) >= batch,
        _FIA,
        f"{name} must have 1 or >= batch ({batch}) entries, got {len(values)}",
        _FIA_DOC,
    )
    return values[:batch]


def _cumulative(name: str, values: list[int] | None) -> list[int]:
    require(values is not None, _FIA, f"{name} must be given for the TND layout", _FIA_DOC)
    assert values is not None
    require(
        0 < len(values) <= 4096,
        _FIA,
        f"{name} entry count is the batch, 1..4096, got {len(values)}",
        _FIA_DOC,
    )
    prev = 0
    lens = []
    for v in values:
        require(
            v >= prev,
            _FIA,
            f"{name} holds cumulative sums (non-negative, non-decreasing), got {values}",
            _FIA_DOC,
        )
        lens.append(v - prev)
        prev = v
    return lens


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | torch.Tensor | None = None,
    actual_seq_lengths_kv: Sequence[int] | torch.Tensor | None = None,
    dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None,
    key_antiquant_scale: torch.Tensor | None = None,
    key_antiquant_offset: torch.Tensor | None = None,
    value_antiquant_scale: torch.Tensor | None = None,
    value_antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    query_padding_size: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None,
    key_shared_prefix: torch.Tensor | None = None,
    value_shared_prefix: torch.Tensor | None = None,
    actual_shared_prefix_len: Sequence[int] | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    key_rope_antiquant_scale: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scale * Q K^T + mask) V`` for prefill, chunked prefill and decode, returning
    ``(attention_out, softmax_lse)``.

    Signature: ``op_plugin_functions.yaml`` (query, key, value positional, everything else
    keyword-only, same names, order and defaults). Rules from the op-plugin page
    ``torch_npu-npu_fused_infer_attention_score.md``:

    - query float16 / bfloat16, contiguous; key and value the query's dtype (int8 / int4 are
      the quantised paths, not implemented), contiguous, same shape.
    - input_layout: BSH (B,S,N*D), BSND (B,S,N,D), BNSD (B,N,S,D), TND (T,N,D). The other
      documented layouts (BNSD_BSND, *_NBSD, TND_NTD, NTD_TND) raise NotImplementedError.
    - num_key_value_heads 0 means num_heads; num_heads % num_key_value_heads == 0 and the
      ratio <= 64. N <= 256, D <= 512, B <= 65536 (prefill limits, applied to every call).
    - actual_seq_lengths / actual_seq_lengths_kv: per batch for BSH/BSND/BNSD (length 1 is
      shared, length >= B takes the first B; None means the full S; values <= S). TND: both
      required, each entry the CUMULATIVE sum of the lengths so far, entry count = batch
      <= 4096.
    - PageAttention (block_table given): block_table int32 [B, >= max blocks per sequence];
      actual_seq_lengths_kv required; key/value are the caches, [num_blocks, block_size, H_kv]
      (BnBsH, every layout) or [num_blocks, KV_N, block_size, D] (BnNBsD, BNSD/TND only);
      block_size equals the caches' block dim and is: TND, a multiple of 16 <= 1024; other
      layouts with S > 1, 128..512 in steps of 128; S == 1, 1..512.
      Ambiguity resolved: for TND with a paged cache the page asks for cumulative
      actual_seq_lengths_kv, but blocks are per sequence (and its MLA paragraph bounds each
      entry by the KV S). The stand-in reads actual_seq_lengths_kv per sequence when
      block_table is given (as vllm-ascend's chunked prefill passes it) and cumulative
      otherwise.
    - sparse_mode: 0 defaultMask (atten_mask optional, full (Q_S, KV_S)-style shapes,
      pre_tokens/next_tokens bound the band); 1 allMask (atten_mask required, pre/next
      ignored); 2 leftUpCausal and 3 rightDownCausal (atten_mask required, the compressed
      (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048) bool/int8/uint8 mask; the stand-in
      applies the causal rule itself and does not read the mask's values). 4 band raises
      NotImplementedError; 5..8 are documented as "not supported yet" and are refused. For a
      sequence with Q_S == 1 in BSH/BSND/BNSD, sparse_mode has no effect (documented). TND
      with sparse_mode 0/1 and an atten_mask raises NotImplementedError (the page gives no
      TND mask shape).
    - atten_mask values: 1/True = not computed, 0 = computed (stated on the
      npu_fusion_attention page; the op-plugin page is silent and its causal example builds a
      ``tril`` mask while calling the result bidirectional, so the stand-in follows the
      explicit statement).
    - Rows with nothing left to attend to (e.g. rightDownCausal with Q_S > KV_S) give zeros
      (the "invalid row" correction the page says is switched on automatically).
    - Output: query's shape with value's D, query's dtype. softmax_lse: float32
      (T, N, 1) for TND, (B, N, S, 1) otherwise, when softmax_lse_flag; else a (1,) zero
      tensor. Query rows past a batch's actual_seq_lengths give zeros (undocumented).
    - pse_shift, the quantisation / antiquant arguments, padding sizes, shared prefix and
      rope inputs raise NotImplementedError when given.
    """
    unsupported = {
        "pse_shift": pse_shift,
        "dequant_scale1": dequant_scale1,
        "quant_scale1": quant_scale1,
        "dequant_scale2": dequant_scale2,
        "quant_scale2": quant_scale2,
        "quant_offset2": quant_offset2,
        "antiquant_scale": antiquant_scale,
        "antiquant_offset": antiquant_offset,
        "key_antiquant_scale": key_antiquant_scale,
        "key_antiquant_offset": key_antiquant_offset,
        "value_antiquant_scale": value_antiquant_scale,
        "value_antiquant_offset": value_antiquant_offset,
        "query_padding_size": query_padding_size,
        "kv_padding_size": kv_padding_size,
        "key_shared_prefix": key_shared_prefix,
        "value_shared_prefix": value_shared_prefix,
        "actual_shared_prefix_len": actual_shared_prefix_len,
        "query_rope": query_rope,
        "key_rope": key_rope,
        "key_rope_antiquant_scale": key_rope_antiquant_scale,
    }
    for name, arg in unsupported.items():
        if arg is not None:
            raise not_implemented(_FIA, name)
    for name, mode in (
        ("antiquant_mode", antiquant_mode),
        ("key_antiquant_mode", key_antiquant_mode),
        ("value_antiquant_mode", value_antiquant_mode),
    ):
        if mode != 0:
            raise not_implemented(_FIA, f"{name}={mode}")
    if input_layout in _OTHER_LAYOUTS:
        raise not_implemented(_FIA, f"input_layout={input_layout!r}")
    require(
        input_layout in _LAYOUTS,
        _FIA,
        f"input_layout must be one of the documented layouts, got {input_layout!r}",
        _FIA_DOC,
    )
    if sparse_mode == 4:
        raise not_implemented(_FIA, "sparse_mode=4 (band)")
    require(
        sparse_mode in (0, 1, 2, 3),
        _FIA,
        f"sparse_mode must be 0..4 (5..8 are documented as not supported), got {sparse_mode}",
        _FIA_DOC,
    )
    require(
        inner_precise in (0, 1, 2, 3),
        _FIA,
        f"inner_precise must be 0..3, got {inner_precise}",
        _FIA_DOC,
    )
    same_device(
        _FIA,
        {
            "query": query,
            "key": key,
            "value": value,
            "atten_mask": atten_mask,
            "block_table": block_table,
        },
    )
    require_dtype(_FIA, "query", query, HALVES, _FIA_DOC)
    require_same_dtype(_FIA, {"query": query, "key": key, "value": value}, _FIA_DOC)
    for name, t in (("query", query), ("key", key), ("value", value)):
        require_contiguous(_FIA, name, t, _FIA_DOC)
    require(num_heads > 0, _FIA, f"num_heads must be > 0, got {num_heads}", _FIA_DOC)
    kv_heads = num_key_value_heads or num_heads
    require(
        num_key_value_heads >= 0 and num_heads % kv_heads == 0 and num_heads // kv_heads <= 64,
        _FIA,
        f"num_heads must be divisible by num_key_value_heads with a ratio <= 64, got "
        f"{num_heads} and {num_key_value_heads}",
        _FIA_DOC,
    )
    require(num_heads <= 256, _FIA, f"N <= 256, got {num_heads}", _FIA_DOC)

    # Bring the query to [B, S, N, D] (TND: [1, T, N, D] plus per-sequence slices).
    if input_layout == "TND":
        require_rank(_FIA, "query", query, (3,), _FIA_DOC)
        require(
            query.shape[1] == num_heads,
            _FIA,
            f"TND query's N must equal num_heads={num_heads}",
            _FIA_DOC,
        )
        q4 = query.unsqueeze(0)
    elif input_layout == "BSH":
        require_rank(_FIA, "query", query, (3,), _FIA_DOC)
        require(
            query.shape[2] % num_heads == 0,
            _FIA,
            f"BSH query's H must be num_heads * D, got H={query.shape[2]}",
            _FIA_DOC,
        )
        q4 = query.view(query.shape[0], query.shape[1], num_heads, -1)
    elif input_layout == "BSND":
        require_rank(_FIA, "query", query, (4,), _FIA_DOC)
        q4 = query
    else:  # BNSD
        require_rank(_FIA, "query", query, (4,), _FIA_DOC)
        q4 = query.transpose(1, 2)
    require(
        q4.shape[2] == num_heads,
        _FIA,
        f"query's N must equal num_heads={num_heads}, got {q4.shape[2]}",
        _FIA_DOC,
    )
    head_dim = q4.shape[3]
    require(0 < head_dim <= 512, _FIA, f"D must be in (0, 512], got {head_dim}", _FIA_DOC)
    require(
        tuple(key.shape[:-1]) == tuple(value.shape[:-1]),
        _FIA,
        "key and value must have the same shape (value's D aside)",
        _FIA_DOC,
    )

    q_list = (
        None
        if actual_seq_lengths is None
        else host_int_list(_FIA, "actual_seq_lengths", actual_seq_lengths)
    )
    kv_list = (
        None
        if actual_seq_lengths_kv is None
        else host_int_list(_FIA, "actual_seq_lengths_kv", actual_seq_lengths_kv)
    )

    # Per-sequence query slices: (start row in q4 flattened as [B*S], length, padded S).
    if input_layout == "TND":
        q_lens = _cumulative("actual_seq_lengths", q_list)
        batch = len(q_lens)
        require(
            sum(q_lens) <= query.shape[0],
            _FIA,
            f"actual_seq_lengths' last entry must be <= T={query.shape[0]}",
            _FIA_DOC,
        )
        starts = [sum(q_lens[:b]) for b in range(batch)]
        q_seqs = [q4[0, s : s + n] for s, n in zip(starts, q_lens, strict=True)]
        s_q = None
    else:
        batch, s_q = q4.shape[0], q4.shape[1]
        require(batch <= 65536, _FIA, f"B <= 65536, got {batch}", _FIA_DOC)
        q_lens = _per_batch("actual_seq_lengths", q_list, batch, s_q)
        for n in q_lens:
            require(
                0 <= n <= s_q,
                _FIA,
                f"actual_seq_lengths entries must be in [0, S={s_q}], got {n}",
                _FIA_DOC,
            )
        q_seqs = [q4[b, : q_lens[b]] for b in range(batch)]

    # Per-sequence keys and values, [L, KVN, D].
    paged = block_table is not None
    kv_seqs: list[tuple[torch.Tensor, torch.Tensor]] = []
    kv_extent: int
    if paged:
        assert block_table is not None
        require_dtype(_FIA, "block_table", block_table, (torch.int32,), _FIA_DOC)
        require_rank(_FIA, "block_table", block_table, (2,), _FIA_DOC)
        require(
            block_table.shape[0] == batch,
            _FIA,
            f"block_table must be [B={batch}, maxBlockNumPerSeq], got {tuple(block_table.shape)}",
            _FIA_DOC,
        )
        require(
            kv_list is not None,
            _FIA,
            "actual_seq_lengths_kv must be given with a block_table (PageAttention)",
            _FIA_DOC,
        )
        assert kv_list is not None
        if key.dim() == 3:  # BnBsH
            num_blocks, cache_block = key.shape[0], key.shape[1]
            require(
                key.shape[2] == kv_heads * head_dim,
                _FIA,
                f"BnBsH cache H must be num_key_value_heads * D = {kv_heads * head_dim}, "
                f"got {key.shape[2]}",
                _FIA_DOC,
            )
            k_tok = key.view(num_blocks, cache_block, kv_heads, head_dim)
            v_tok = value.view(num_blocks, cache_block, kv_heads, -1)
        elif key.dim() == 4 and input_layout in ("BNSD", "TND"):  # BnNBsD
            num_blocks, cache_block = key.shape[0], key.shape[2]
            require(
                key.shape[1] == kv_heads and key.shape[3] == head_dim,
                _FIA,
                f"BnNBsD cache must be [num_blocks, {kv_heads}, block_size, {head_dim}]",
                _FIA_DOC,
            )
            k_tok = key.transpose(1, 2)
            v_tok = value.transpose(1, 2)
        else:
            raise NpuValueError(
                f"{_FIA}: with a block_table the caches must be [num_blocks, block_size, H] "
                f"(BnBsH) or, for BNSD/TND, [num_blocks, N, block_size, D] (BnNBsD); got "
                f"{tuple(key.shape)} for {input_layout} ({_FIA_DOC})"
            )
        require(
            block_size == cache_block,
            _FIA,
            f"block_size must equal the caches' block dim {cache_block}, got {block_size}",
            _FIA_DOC,
        )
        if input_layout == "TND":
            ok = block_size % 16 == 0 and 0 < block_size <= 1024
            rule = "TND PageAttention: block_size a multiple of 16, <= 1024"
        elif s_q is not None and s_q > 1:
            ok = block_size % 128 == 0 and 128 <= block_size <= 512
            rule = "PageAttention with Q_S > 1: block_size in 128..512, a multiple of 128"
        else:
            ok = 0 < block_size <= 512
            rule = "PageAttention with Q_S == 1: block_size non-zero, <= 512"
        require(ok, _FIA, f"{rule}, got {block_size}", _FIA_DOC)
        kv_lens = _per_batch("actual_seq_lengths_kv", kv_list, batch, 0)
        max_blocks = block_table.shape[1]
        kv_extent = max_blocks * block_size
        table = block_table.to(torch.int64).cpu()
        for b, length in enumerate(kv_lens):
            used = -(-length // block_size)
            require(
                length >= 0 and used <= max_blocks,
                _FIA,
                f"actual_seq_lengths_kv[{b}]={length} needs {used} blocks, block_table has "
                f"{max_blocks}",
                _FIA_DOC,
            )
            ids = table[b, :used]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
                raise NpuValueError(
                    f"{_FIA}: block ids must lie in [0, {num_blocks}), row {b} uses "
                    f"{ids.tolist()} ({_FIA_DOC})"
                )
            ids = ids.to(key.device)
            k = k_tok[ids].reshape(-1, kv_heads, head_dim)[:length]
            v = v_tok[ids].reshape(-1, kv_heads, v_tok.shape[-1])[:length]
            kv_seqs.append((k, v))
    else:
        require(
            block_size == 0,
            _FIA,
            "block_size is for PageAttention and needs a block_table",
            _FIA_DOC,
        )
        if input_layout == "TND":
            require_rank(_FIA, "key", key, (3,), _FIA_DOC)
            k4, v4 = key, value
            kv_lens = _cumulative("actual_seq_lengths_kv", kv_list)
            require(
                len(kv_lens) == batch,
                _FIA,
                "actual_seq_lengths and actual_seq_lengths_kv must have one entry per batch",
                _FIA_DOC,
            )
            require(
                sum(kv_lens) <= key.shape[0],
                _FIA,
                f"actual_seq_lengths_kv's last entry must be <= T_kv={key.shape[0]}",
                _FIA_DOC,
            )
            kv_extent = max(kv_lens) if kv_lens else 0
            start = 0
            for n in kv_lens:
                kv_seqs.append((k4[start : start + n], v4[start : start + n]))
                start += n
        else:
            if input_layout == "BSH":
                require_rank(_FIA, "key", key, (3,), _FIA_DOC)
                k4 = key.view(key.shape[0], key.shape[1], kv_heads, -1)
                v4 = value.view(value.shape[0], value.shape[1], kv_heads, -1)
            elif input_layout == "BSND":
                require_rank(_FIA, "key", key, (4,), _FIA_DOC)
                k4, v4 = key, value
            else:
                require_rank(_FIA, "key", key, (4,), _FIA_DOC)
                k4, v4 = key.transpose(1, 2), value.transpose(1, 2)
            require(
                k4.shape[0] == batch and k4.shape[2] == kv_heads and k4.shape[3] == head_dim,
                _FIA,
                f"key must be [B={batch}, KV_S, N={kv_heads}, D={head_dim}] in "
                f"{input_layout}, got {tuple(key.shape)}",
                _FIA_DOC,
            )
            kv_extent = k4.shape[1]
            kv_lens = _per_batch("actual_seq_lengths_kv", kv_list, batch, kv_extent)
            for b, n in enumerate(kv_lens):
                require(
                    0 <= n <= kv_extent,
                    _FIA,
                    f"actual_seq_lengths_kv entries must be in [0, KV_S={kv_extent}], got {n}",
                    _FIA_DOC,
                )
                kv_seqs.append((k4[b, :n], v4[b, :n]))

    # Masks.
    full_mask: torch.Tensor | None = None
    if sparse_mode in (2, 3) or (sparse_mode == 1):
        require(
            atten_mask is not None,
            _FIA,
            f"sparse_mode={sparse_mode} needs an atten_mask",
            _FIA_DOC,
        )
    if atten_mask is not None:
        require_dtype(
            _FIA, "atten_mask", atten_mask, (torch.bool, torch.int8, torch.uint8), _FIA_DOC
        )
        if sparse_mode in (2, 3):
            require(
                tuple(atten_mask.shape) in _COMPRESSED_MASK_SHAPES,
                _FIA,
                f"sparse_mode={sparse_mode} takes the compressed (2048, 2048) mask "
                f"(or (1, 2048, 2048), (1, 1, 2048, 2048)), got {tuple(atten_mask.shape)}",
                _FIA_DOC,
            )
        elif input_layout == "TND":
            raise not_implemented(_FIA, f"atten_mask with sparse_mode={sparse_mode} in TND")
        else:
            assert s_q is not None
            m = atten_mask.bool()
            shape = tuple(m.shape)
            if shape in ((s_q, kv_extent), (1, s_q, kv_extent), (1, 1, s_q, kv_extent)):
                m = m.reshape(1, s_q, kv_extent).expand(batch, s_q, kv_extent)
            elif shape == (batch, 1, s_q, kv_extent):
                m = m.reshape(batch, s_q, kv_extent)
            elif s_q == 1 and shape == (batch, kv_extent):
                m = m.reshape(batch, 1, kv_extent)
            else:
                raise NpuValueError(
                    f"{_FIA}: atten_mask for sparse_mode={sparse_mode} must be (Q_S, KV_S), "
                    f"(1, Q_S, KV_S), (B, 1, Q_S, KV_S) or (1, 1, Q_S, KV_S) (Q_S == 1 also "
                    f"(B, KV_S)) with Q_S={s_q}, KV_S={kv_extent}, got {shape} ({_FIA_DOC}; "
                    f"{_MASK_POLARITY_DOC})"
                )
            full_mask = m

    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    for b in range(batch):
        q = q_seqs[b]
        k, v = kv_seqs[b]
        s, ln = q.shape[0], k.shape[0]
        decode_row = input_layout != "TND" and s_q == 1
        allowed: torch.Tensor | None = None
        if not decode_row and sparse_mode in (2, 3):
            i = torch.arange(s).unsqueeze(1)
            j = torch.arange(ln).unsqueeze(0)
            offset = 0 if sparse_mode == 2 else ln - s
            allowed = j <= i + offset
        elif full_mask is not None:
            allowed = ~full_mask[b, :s, :ln]
        if (
            sparse_mode == 0
            and not decode_row
            and (pre_tokens < 2147483647 or next_tokens < 2147483647)
        ):
            i = torch.arange(s).unsqueeze(1)
            j = torch.arange(ln).unsqueeze(0)
            band = (j - i <= next_tokens) & (i - j <= pre_tokens)
            allowed = band if allowed is None else allowed & band
        if allowed is not None:
            allowed = allowed.to(q.device)
        o, lse = _attend(q, k, v, float(scale), allowed)
        outs.append(o)
        lses.append(lse)

    d_v = value.shape[-1] if not (paged and key.dim() == 3) else value.shape[-1] // kv_heads
    if input_layout == "TND":
        out = torch.zeros(query.shape[0], num_heads, d_v, dtype=torch.float32)
        lse_all = torch.full((query.shape[0], num_heads), float("-inf"))
        row = 0
        for o, lse in zip(outs, lses, strict=True):
            out[row : row + o.shape[0]] = o
            lse_all[row : row + o.shape[0]] = lse
            row += o.shape[0]
        result = out
        lse_out = lse_all.unsqueeze(-1)
    else:
        assert s_q is not None
        out = torch.zeros(batch, s_q, num_heads, d_v, dtype=torch.float32)
        lse_all = torch.full((batch, s_q, num_heads), float("-inf"))
        for b, (o, lse) in enumerate(zip(outs, lses, strict=True)):
            out[b, : o.shape[0]] = o
            lse_all[b, : o.shape[0]] = lse
        lse_out = lse_all.transpose(1, 2).unsqueeze(-1)  # (B, N, S, 1)
        if input_layout == "BSH":
            result = out.reshape(batch, s_q, num_heads * d_v)
        elif input_layout == "BSND":
            result = out
        else:
            result = out.transpose(1, 2)
    attention_out = result.to(query.dtype).to(query.device).contiguous()
    if softmax_lse_flag:
        return attention_out, lse_out.to(query.device).contiguous()
    return attention_out, torch.zeros(1, dtype=torch.float32, device=query.device)
