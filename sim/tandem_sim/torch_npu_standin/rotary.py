"""Rotary position embedding: ``npu_rotary_mul``, ``npu_apply_rotary_pos_emb`` and
``_npu_rotary_embedding``."""

from __future__ import annotations

import torch

from ._rules import (
    FLOATS,
    HALVES,
    NpuValueError,
    not_implemented,
    require,
    require_dtype,
    require_rank,
    require_same_dtype,
    same_device,
)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


_MUL = "npu_rotary_mul"
_MUL_DOC = (
    "torch_npu.npu_rotary_mul, op-plugin docs/zh/custom_APIs/torch_npu/"
    "torch_npu-npu_rotary_mul.md; schema op_plugin/config/op_plugin_functions.yaml"
)


def npu_rotary_mul(
    self: torch.Tensor,
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x * r1 + rotate(x) * r2`` (r1 = cos, r2 = sin); returns a new tensor.

    Schema: ``npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half',
    Tensor? rotate=None) -> Tensor``. Rules (op-plugin page, Atlas A2/A3 jit_compile=False):

    - input, r1, r2: 3 or 4 dims, float16 / bfloat16 / float32 (the stand-in requires one
      dtype for the three; the page lists them separately and is silent on mixing).
    - rotary_mode ``half``: rotate(x) = cat(-x2, x1) of the two halves of the last dim;
      ``interleave``: pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]). D even, D < 896.
    - r1/r2 broadcast to the input (the page lists 1S1D, BS1D, BSND, ... per layout); each of
      their dims equals the input's or is 1, and their last dim equals D.
    - ``rotate`` (2-D [D, D], "rotate(x) = x @ rotate") replaces the built-in rotation.
    - Output: the input's shape and dtype, computed in float32.
    """
    x = self
    same_device(_MUL, {"self": x, "r1": r1, "r2": r2, "rotate": rotate})
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        require_rank(_MUL, name, t, (3, 4), _MUL_DOC)
        require_dtype(_MUL, name, t, FLOATS, _MUL_DOC)
    require_same_dtype(_MUL, {"input": x, "r1": r1, "r2": r2}, _MUL_DOC)
    require(
        rotary_mode in ("half", "interleave"),
        _MUL,
        f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}",
        _MUL_DOC,
    )
    d = x.shape[-1]
    require(d % 2 == 0 and d < 896, _MUL, f"D must be even and < 896, got {d}", _MUL_DOC)
    for name, r in (("r1", r1), ("r2", r2)):
        ok = r.dim() == x.dim() and all(
            rs in (1, xs) for rs, xs in zip(r.shape, x.shape, strict=True)
        )
        require(
            ok and r.shape[-1] == d,
            _MUL,
            f"{name} {tuple(r.shape)} must broadcast to input {tuple(x.shape)} with D={d}",
            _MUL_DOC,
        )
    xf = x.float()
    if rotate is not None:
        require_rank(_MUL, "rotate", rotate, (2,), _MUL_DOC)
        require_dtype(_MUL, "rotate", rotate, FLOATS, _MUL_DOC)
        require(
            tuple(rotate.shape) == (d, d),
            _MUL,
            f"rotate must be [D, D] = ({d}, {d}), got {tuple(rotate.shape)}",
            _MUL_DOC,
        )
        rotated = xf @ rotate.float()
    elif rotary_mode == "half":
        rotated = _rotate_half(xf)
    else:
        rotated = _rotate_interleave(xf)
    return (xf * r1.float() + rotated * r2.float()).to(x.dtype)


_APPLY = "npu_apply_rotary_pos_emb"
_APPLY_DOC = (
    "torch_npu.npu_apply_rotary_pos_emb, op-plugin docs/zh/custom_APIs/torch_npu/"
    "torch_npu-apply_rotary_pos_emb.md; schema op_plugin/config/op_plugin_functions.yaml"
)


def npu_apply_rotary_pos_emb(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str = "BSND",
    rotary_mode: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE applied IN PLACE to query and key; returns ``(query, key)``.

    Schema: ``npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin,
    str layout='BSND', str rotary_mode='half') -> (Tensor, Tensor)``. The page writes a
    ``*`` before ``layout``; the binding (op_plugin_functions.yaml) has none, so layout and
    rotary_mode may also be passed by position here.

    Rules (op-plugin page, Atlas A2/A3 rows):

    - layout ``BSND`` (4-D) or ``TND`` (3-D); SBND/BNSD are Ascend 950 only and refused.
    - rotary_mode ``half`` only (``quarter``/``interleave`` are Ascend 950 only).
    - query, key, cos, sin: one dtype, bfloat16 / float16 / float32, not empty.
    - D (last dim) of query and key equal, 64 or 128; cos/sin D equal to each other and to
      query's (the page writes cos_d; with half rotation over the whole head it is D).
    - BSND: query (b, s, q_n, d), key (b, s, k_n, d), cos/sin (b, s, 1, d): B and S equal.
      TND: query (t, q_n, d), key (t, k_n, d), cos/sin (t, 1, d): T equal.
    - out = x * cos + rotate_half(x) * sin, in float32, rounded to the dtype, written back.
    """
    same_device(_APPLY, {"query": query, "key": key, "cos": cos, "sin": sin})
    if layout in ("SBND", "BNSD"):
        raise NpuValueError(
            f"{_APPLY}: layout {layout!r} is supported on Ascend 950DT only; Atlas A2/A3 take "
            f"'BSND' or 'TND' ({_APPLY_DOC})"
        )
    require(
        layout in ("BSND", "TND"),
        _APPLY,
        f"layout must be 'BSND' or 'TND', got {layout!r}",
        _APPLY_DOC,
    )
    if rotary_mode in ("quarter", "interleave"):
        raise NpuValueError(
            f"{_APPLY}: rotary_mode {rotary_mode!r} is supported on Ascend 950DT only; Atlas "
            f"A2/A3 take 'half' ({_APPLY_DOC})"
        )
    require(
        rotary_mode == "half",
        _APPLY,
        f"rotary_mode must be 'half', got {rotary_mode!r}",
        _APPLY_DOC,
    )
    rank = 4 if layout == "BSND" else 3
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        require_rank(_APPLY, name, t, (rank,), _APPLY_DOC)
        require_dtype(_APPLY, name, t, FLOATS, _APPLY_DOC)
        require(t.numel() > 0, _APPLY, f"{name} must not be empty", _APPLY_DOC)
    require_same_dtype(_APPLY, {"query": query, "key": key, "cos": cos, "sin": sin}, _APPLY_DOC)
    d = query.shape[-1]
    require(d in (64, 128), _APPLY, f"D must be 64 or 128, got {d}", _APPLY_DOC)
    lead = rank - 2
    for name, t in (("key", key), ("cos", cos), ("sin", sin)):
        require(
            tuple(t.shape[:lead]) == tuple(query.shape[:lead]) and t.shape[-1] == d,
            _APPLY,
            f"{name} {tuple(t.shape)} must share query's "
            f"{'B, S' if rank == 4 else 'T'} and D (query {tuple(query.shape)})",
            _APPLY_DOC,
        )
    for name, t in (("cos", cos), ("sin", sin)):
        require(t.shape[-2] == 1, _APPLY, f"{name}'s N must be 1, got {t.shape[-2]}", _APPLY_DOC)
    c, s = cos.float(), sin.float()
    for t in (query, key):
        tf = t.float()
        t.copy_((tf * c + _rotate_half(tf) * s).to(t.dtype))
    return query, key


_EMB = "_npu_rotary_embedding"
_EMB_DOC = (
    "ATB RopeOperation, hiascend CANN 8.0.RC3 ascendtbapi ascendtb_01_0091; schema and the "
    "cos/sin construction op-plugin op_plugin/ops/atb/RopeAtb.cpp"
)


def _npu_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> None:
    """RoPE from a ``[max_position, rot_dim]`` cos|sin cache, IN PLACE on query and key.

    Schema (op-plugin ``RopeAtb.cpp``)::

        _npu_rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key,
                              int head_size, Tensor cos_sin_cache, bool is_neox_style) -> ()

    The wrapper splits ``cos_sin_cache`` into its cos half and sin half along the last dim,
    widens them to rot_dim (neox: ``[c, c]``; otherwise each value repeated twice in place),
    picks the rows at ``positions`` and runs ATB's RopeOperation with rotaryCoeff 2 (neox:
    rotate the two halves of each head) or head_size (pairs (2i, 2i+1), GPT-J style).

    Rules (ATB RopeOperation page):

    - query [ntokens, hiddenSizeQ], key [ntokens, hiddenSizeK]: 2-D, float16 / bfloat16,
      one dtype; hidden sizes multiples of head_size. 3-D [T, N, D] is not the documented
      shape and is refused (``npu_apply_rotary_pos_emb`` with TND takes that).
    - cos/sin (here the cache) float16 / float32 / bfloat16. ATB takes headDim from cos's
      width, so the cache's rot_dim must equal head_size: partial rotary is refused.
    - positions: integer indices (int32 / int64; undocumented, index_select needs one of
      them), flattened to ntokens, each in [0, max_position).
    - Not modelled: the wrapper caches cos/sin from the FIRST cache it is given for the rest
      of the process (a module-level static); the stand-in reads the cache passed each call.
    """
    same_device(
        _EMB,
        {"positions": positions, "query": query, "key": key, "cos_sin_cache": cos_sin_cache},
    )
    for name, t in (("query", query), ("key", key)):
        require_rank(_EMB, name, t, (2,), _EMB_DOC)
        require_dtype(_EMB, name, t, HALVES, _EMB_DOC)
    require_same_dtype(_EMB, {"query": query, "key": key}, _EMB_DOC)
    require_dtype(_EMB, "cos_sin_cache", cos_sin_cache, FLOATS, _EMB_DOC)
    require_rank(_EMB, "cos_sin_cache", cos_sin_cache, (2,), _EMB_DOC)
    require_dtype(_EMB, "positions", positions, (torch.int32, torch.int64), _EMB_DOC)
    if not isinstance(is_neox_style, bool):
        raise not_implemented(_EMB, "a non-bool is_neox_style")
    require(head_size > 0 and head_size % 2 == 0, _EMB, "head_size must be even", _EMB_DOC)
    require(
        cos_sin_cache.shape[1] == head_size,
        _EMB,
        f"cos_sin_cache's width (rot_dim) must equal head_size={head_size}, got "
        f"{cos_sin_cache.shape[1]} (partial rotary is not supported: RopeOperation takes "
        f"headDim from cos)",
        _EMB_DOC,
    )
    pos = positions.flatten().to(torch.int64)
    tokens = pos.shape[0]
    for name, t in (("query", query), ("key", key)):
        require(
            t.shape[0] == tokens and t.shape[1] % head_size == 0,
            _EMB,
            f"{name} must be [ntokens={tokens}, heads*head_size], got {tuple(t.shape)}",
            _EMB_DOC,
        )
    if tokens and (int(pos.min()) < 0 or int(pos.max()) >= cos_sin_cache.shape[0]):
        raise NpuValueError(
            f"{_EMB}: positions must lie in [0, {cos_sin_cache.shape[0]}) ({_EMB_DOC})"
        )
    cos_half, sin_half = cos_sin_cache.float()[pos].chunk(2, dim=-1)
    if is_neox_style:
        cos = torch.cat((cos_half, cos_half), dim=-1)
        sin = torch.cat((sin_half, sin_half), dim=-1)
        rot = _rotate_half
    else:
        cos = cos_half.repeat_interleave(2, dim=-1)
        sin = sin_half.repeat_interleave(2, dim=-1)
        rot = _rotate_interleave
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for t in (query, key):
        tf = t.float().view(tokens, -1, head_size)
        t.copy_((tf * cos + rot(tf) * sin).reshape(t.shape).to(t.dtype))
