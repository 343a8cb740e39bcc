"""Quantization ops: ``npu_quantize``, ``npu_dynamic_quant``, ``npu_trans_quant_param``,
``npu_quant_matmul`` (W8A8), ``npu_convert_weight_to_int4pack`` and
``npu_weight_quant_batchmatmul`` (W4A16), as vllm-ascend calls them
(``vllm_ascend/quantization/methods/w8a8_dynamic.py``, ``w8a8_static.py``, ``w8a16.py``,
``w4a16.py``).

Rules are those the op-plugin pages give for Atlas A2/A3 (the 910B/910C this engine serves);
Atlas inference-card and Ascend 950 variants are not modelled. Integer products are exact
(int8 values multiplied in float64, exact below 2^53), then scaled in float32 and rounded once
to the output dtype.
"""

from __future__ import annotations

import torch

from ._rules import (
    HALVES,
    NpuDtypeError,
    not_implemented,
    require,
    require_dtype,
    require_int,
    require_rank,
    require_tensor,
    same_device,
)

_PAGES = "op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-"
_QUANTIZE_DOC = f"torch_npu.npu_quantize, {_PAGES}npu_quantize.md"
_DYNAMIC_DOC = f"torch_npu.npu_dynamic_quant, {_PAGES}npu_dynamic_quant.md"
_TRANS_DOC = (
    f"torch_npu.npu_trans_quant_param, {_PAGES}npu_trans_quant_param.md; bit layout "
    "hicann/ops-nn quant/trans_quant_param_v2/README.md"
)
_QMM_DOC = (
    f"torch_npu.npu_quant_matmul, {_PAGES}npu_quant_matmul.md; int32 output "
    "hicann/ops-nn matmul/quant_batch_matmul_v4/docs/aclnnQuantMatmulV5.md"
)
_PACK_DOC = (
    f"torch_npu.npu_convert_weight_to_int4pack, {_PAGES}npu_convert_weight_to_int4pack.md; "
    "hicann/ops-nn matmul/convert_weight_to_int4_pack/docs/aclnnConvertWeightToINT4Pack.md"
)
_WQBMM_DOC = f"torch_npu.npu_weight_quant_batchmatmul, {_PAGES}npu_weight_quant_batchmatmul.md"

_INT8_RANGE = (-128, 127)
_RANGES = {torch.int8: _INT8_RANGE, torch.uint8: (0, 255), torch.int32: (-(2**31), 2**31 - 1)}
# npu_quantize's ``dtype`` (div_mode True) and the tensor dtype it returns.
_QUANTIZE_OUT = {
    torch.qint8: torch.int8,
    torch.int8: torch.int8,
    torch.quint8: torch.uint8,
    torch.int32: torch.int32,
}
_ZERO_POINT_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.bfloat16)
_INT4_MIN, _INT4_MAX, _NIBBLES = -8, 7, 8
# The largest K and N the matmul pages allow.
_MAX_DIM = 65535
# The deq-scale int64 of npu_trans_quant_param: the float32's top 19 bits in bits 0-31, a
# 9-bit offset in bits 37-45, bit 46 set.
_SCALE_BITS, _FLAG_BIT, _OFFSET_SHIFT, _OFFSET_MASK = 0xFFFFE000, 1 << 46, 37, 0x1FF


def _saturate(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round half to even and saturate to ``dtype``: the pages are silent on both; this is
    the rounding of the other Ascend quantizers' formulas (``round``) and of vLLM's."""
    low, high = _RANGES[dtype]
    return torch.round(values).clamp_(low, high).to(dtype)


def npu_quantize(
    self: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    dtype: torch.dtype,
    axis: int = 1,
    div_mode: bool = True,
) -> torch.Tensor:
    """``self / scales + zero_points`` (``div_mode`` True) or ``self * scales + zero_points``
    (False), to ``dtype``.

    Schema: ``npu_quantize(self, scales, zero_points, dtype, axis=1, div_mode=True)``. Rules
    (Atlas A2/A3):

    - self: float32 / float16 / bfloat16, any shape; may be empty or non-contiguous.
    - div_mode True: scales float32 or bfloat16; zero_points None, int8, uint8, int32 or
      bfloat16; dtype qint8, quint8 or int32; axis in [-self.dim(), self.dim() - 1] and
      unused where scales and zero_points hold one value each. The page gives no shape rule
      for scales here; the stand-in takes 1-D of size 1 or ``self.shape[axis]`` (the
      ``div_mode`` False rule), broadcast along ``axis``.
    - div_mode False: scales and zero_points self's dtype; axis -2 picks the second-to-last
      axis, any larger value the last; dtype qint8 or int8 (quint4x2 not implemented).
    - Result: ``dtype`` (qint8 as a torch.int8 tensor, the page's examples), self's shape.
      Rounding (half to even) and saturation are the stand-in's choice; the page is silent.
    """
    op = "npu_quantize"
    require_tensor(op, "scales", scales)
    same_device(op, {"self": self, "scales": scales, "zero_points": zero_points})
    require_dtype(op, "self", self, (torch.float32, *HALVES), _QUANTIZE_DOC)
    if div_mode:
        require_dtype(op, "scales", scales, (torch.float32, torch.bfloat16), _QUANTIZE_DOC)
        if zero_points is not None:
            require_dtype(op, "zero_points", zero_points, _ZERO_POINT_DTYPES, _QUANTIZE_DOC)
        if dtype not in _QUANTIZE_OUT or dtype is torch.int8:
            raise NpuDtypeError(
                f"{op}: dtype must be qint8, quint8 or int32 with div_mode=True, got {dtype} "
                f"({_QUANTIZE_DOC})"
            )
        require(
            -self.dim() <= axis < max(self.dim(), 1),
            op,
            f"axis must be in [{-self.dim()}, {self.dim() - 1}], got {axis}",
            _QUANTIZE_DOC,
        )
        dim = axis % self.dim() if self.dim() else 0
    else:
        require_dtype(op, "scales", scales, (self.dtype,), _QUANTIZE_DOC)
        if dtype is torch.quint4x2:
            raise not_implemented(op, "dtype quint4x2 (eight int4 codes per int32)")
        if dtype not in (torch.qint8, torch.int8):
            raise NpuDtypeError(
                f"{op}: dtype must be qint8 or int8 with div_mode=False, got {dtype} "
                f"({_QUANTIZE_DOC})"
            )
        require(axis >= -2, op, f"axis must be -2 or more, got {axis}", _QUANTIZE_DOC)
        dim = self.dim() - 2 if axis == -2 else self.dim() - 1
    require_rank(op, "scales", scales, (1,), _QUANTIZE_DOC)
    size = self.shape[dim] if self.dim() else 1
    require(
        scales.numel() in (1, size),
        op,
        f"scales must hold 1 or {size} values (self's size along axis), got {scales.numel()}",
        _QUANTIZE_DOC,
    )
    if zero_points is not None:
        require(
            tuple(zero_points.shape) == tuple(scales.shape),
            op,
            "zero_points must have scales' shape",
            _QUANTIZE_DOC,
        )
    view = [1] * self.dim()
    if self.dim():
        view[dim] = -1
    s = scales.float().reshape(view)
    q = self.float() / s if div_mode else self.float() * s
    if zero_points is not None:
        q = q + zero_points.float().reshape(view)
    return _saturate(q, _QUANTIZE_OUT[dtype])


def npu_dynamic_quant(
    input: torch.Tensor,
    *,
    smooth_scales: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    dst_type: torch.dtype | None = None,
    quant_mode: str = "pertoken",
    dst_type_max: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric quantization: ``scale = rowMax(|x * smooth_scales|) / 127``,
    ``y = round(x * smooth_scales / scale)``; returns ``(y, scale)``.

    Schema: ``npu_dynamic_quant(input, *, smooth_scales=None, group_index=None,
    dst_type=None, quant_mode="pertoken", dst_type_max=0.0) -> (Tensor, Tensor)``. Rules
    (Atlas A2/A3):

    - input: float16 or bfloat16 only, more than one dimension.
    - smooth_scales: input's dtype (single-op mode), 1-D of input's last size.
    - dst_type: None or int8 (quint4x2 not implemented); group_index (MoE) not implemented.
    - quant_mode and dst_type_max: not supported on A2/A3 (the page), so only "pertoken"
      and 0.0 are taken.
    - y: int8, input's shape; scale: float32, input's shape without its last dim.
    - A row of zeros: the page's formula divides by a zero scale; the stand-in returns
      codes 0 and scale 0 (what dequantizes back to the row).
    """
    op = "npu_dynamic_quant"
    require_tensor(op, "input", input)
    same_device(op, {"input": input, "smooth_scales": smooth_scales})
    require_dtype(op, "input", input, HALVES, _DYNAMIC_DOC)
    require(input.dim() > 1, op, "input must have more than one dimension", _DYNAMIC_DOC)
    if group_index is not None:
        raise not_implemented(op, "group_index (MoE smooth scales per expert)")
    if dst_type is torch.quint4x2:
        raise not_implemented(op, "dst_type quint4x2 (eight int4 codes per int32)")
    if dst_type not in (None, torch.int8):
        raise NpuDtypeError(f"{op}: dst_type must be int8 or quint4x2, got {dst_type}")
    require(
        quant_mode == "pertoken" and dst_type_max == 0.0,
        op,
        "quant_mode and dst_type_max are Ascend 950 parameters, not supported on A2/A3",
        _DYNAMIC_DOC,
    )
    x = input.float()
    if smooth_scales is not None:
        require_dtype(op, "smooth_scales", smooth_scales, (input.dtype,), _DYNAMIC_DOC)
        require(
            tuple(smooth_scales.shape) == (input.shape[-1],),
            op,
            f"smooth_scales must be 1-D of input's last size {input.shape[-1]}",
            _DYNAMIC_DOC,
        )
        x = x * smooth_scales.float()
    scale = x.abs().amax(dim=-1) / _INT8_RANGE[1]
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return _saturate(x / safe.unsqueeze(-1), torch.int8), scale


def npu_trans_quant_param(scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """A float32 scale (and offset) as the int64 "deq scale" the matmul ops read.

    Schema: ``npu_trans_quant_param(scale, offset=None) -> Tensor``. Bit layout
    (TransQuantParamV2): the float32's bits masked to its top 19 (``& 0xFFFFE000``) in
    bits 0-31, bit 46 set, and the offset rounded, clamped to [-256, 255] and kept as 9 bits
    in bits 37-45. Scale and offset: float32, 1-D (or 2-D (1, n)).
    """
    op = "npu_trans_quant_param"
    require_dtype(op, "scale", scale, (torch.float32,), _TRANS_DOC)
    require_rank(op, "scale", scale, (1, 2), _TRANS_DOC)
    bits = scale.contiguous().view(torch.int32).long() & _SCALE_BITS
    out = bits | _FLAG_BIT
    if offset is not None:
        require_dtype(op, "offset", offset, (torch.float32,), _TRANS_DOC)
        o = torch.round(offset.float()).clamp(-256, 255).long() & _OFFSET_MASK
        out = out | (o.reshape(-1) << _OFFSET_SHIFT).reshape(out.shape)
    return out.reshape(-1)


def _deq_scale(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scale and offset an ``npu_trans_quant_param`` int64 holds."""
    scale = (packed & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    raw = (packed >> _OFFSET_SHIFT) & _OFFSET_MASK
    offset = torch.where(raw > 255, raw - 512, raw).float()
    return scale, offset


# npu_quant_matmul's dtype table for A2/A3 (x1 = x2 = int8): the output dtype, then the
# scale, offset, bias and pertoken_scale dtypes each row allows (None: the argument absent).
_F32, _BF16, _I64, _I32 = torch.float32, torch.bfloat16, torch.int64, torch.int32
_QMM_TABLE: list[tuple[torch.dtype, set[object], set[object], set[object], set[object]]] = [
    (torch.float16, {_I64, _F32}, {None}, {_I32, None}, {None}),
    (torch.int8, {_I64, _F32}, {_F32, None}, {_I32, None}, {None}),
    (torch.bfloat16, {_F32, _BF16}, {None}, {_I32, _BF16, _F32, None}, {_F32, None}),
    (torch.float16, {_F32}, {None}, {_I32, _BF16, _F32, None}, {_F32}),
    (torch.int32, {_F32, _BF16}, {None}, {_I32, None}, {None}),
]


def _dtype_of(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def _transposed_or_contiguous(op: str, arg: str, t: torch.Tensor, doc: str) -> None:
    require(
        t.is_contiguous() or t.transpose(-1, -2).is_contiguous(),
        op,
        f"{arg} must be contiguous or a transpose of its last two axes of a contiguous tensor",
        doc,
    )


def _check_qmm_dtypes(
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    pertoken_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.dtype,
) -> None:
    got = (scale.dtype, _dtype_of(offset), _dtype_of(bias), _dtype_of(pertoken_scale))
    for row_out, *allowed in _QMM_TABLE:
        if row_out is out and all(g in a for g, a in zip(got, allowed, strict=True)):
            return
    names = ("scale", "offset", "bias", "pertoken_scale")
    listed = ", ".join(f"{n}={g}" for n, g in zip(names, got, strict=True))
    raise NpuDtypeError(
        f"npu_quant_matmul: no supported dtype combination for output_dtype={out} with "
        f"{listed} ({_QMM_DOC}, table 2)"
    )


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    offset: torch.Tensor | None = None,
    pertoken_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = None,
    group_sizes: list[int] | None = None,
) -> torch.Tensor:
    """int8 ``x1 @ x2``, exact in int32, then dequantized.

    Schema: ``npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None,
    bias=None, output_dtype=None, group_sizes=None) -> Tensor``. Formulas: without bias
    ``x1 @ x2 * scale (* pertoken_scale) + offset``; int32 bias ``(x1 @ x2 + bias) * scale
    (* pertoken_scale) + offset``; float bias ``x1 @ x2 * scale (* pertoken_scale) + bias``;
    int32 output ``x1 @ x2 (+ bias)`` with every scale ignored (aclnnQuantMatmulV5). Rules
    (Atlas A2/A3):

    - x1 [..., m, k], x2 [..., k, n]: int8 (int4 as int32 not implemented), 2 to 6 dims,
      ND, not empty; k and n at most 65535. A weight stored [n, k] is passed as its
      transposed view (x2 may be the transpose of its last two axes of a contiguous
      tensor; so may x1).
    - scale: 1-D (1,) or (n,), float32 / int64 (``npu_trans_quant_param``'s) / bfloat16.
      offset: float32 1-D (1,) or (n,). pertoken_scale: float32 1-D (m,). bias: 1-D (n,),
      or (batch, 1, n) for a 3-D output; int32 / bfloat16 / float16 / float32.
    - output_dtype: None (int8), int8, float16, bfloat16 or int32; the combination of
      dtypes must be a row of the page's table 2.
    - The scales are applied in float32 in the formula's order and the result rounded once
      (int8: half to even and saturated, the page being silent).
    """
    op = "npu_quant_matmul"
    same_device(
        op,
        {
            "x1": x1,
            "x2": x2,
            "scale": scale,
            "offset": offset,
            "pertoken": pertoken_scale,
            "bias": bias,
        },
    )
    if group_sizes is not None:
        raise not_implemented(op, "group_sizes (per-group int4 scales)")
    for name, t in (("x1", x1), ("x2", x2)):
        require_rank(op, name, t, range(2, 7), _QMM_DOC)
        require(t.numel() > 0, op, f"{name} must not be empty", _QMM_DOC)
        _transposed_or_contiguous(op, name, t, _QMM_DOC)
    if x1.dtype is not x2.dtype:
        raise NpuDtypeError(f"{op}: x1 and x2 must share one dtype ({_QMM_DOC})")
    require_dtype(op, "x1", x1, (torch.int8, torch.int32), _QMM_DOC)
    if x1.dtype is torch.int32:
        raise not_implemented(op, "int4 inputs (x1, x2 int32, eight codes a word)")
    out = torch.int8 if output_dtype is None else output_dtype
    _check_qmm_dtypes(scale, offset, pertoken_scale, bias, out)
    m, k = x1.shape[-2:]
    n = x2.shape[-1]
    require(x2.shape[-2] == k, op, f"x1's k ({k}) and x2's ({x2.shape[-2]}) differ", _QMM_DOC)
    require(
        k <= _MAX_DIM and n <= _MAX_DIM,
        op,
        "x1's and x2's last dims are at most 65535",
        _QMM_DOC,
    )
    require_rank(op, "scale", scale, (1,), _QMM_DOC)
    require(scale.numel() in (1, n), op, f"scale must be (1,) or ({n},)", _QMM_DOC)
    if offset is not None:
        require_rank(op, "offset", offset, (1,), _QMM_DOC)
        require(offset.numel() in (1, n), op, f"offset must be (1,) or ({n},)", _QMM_DOC)
    if pertoken_scale is not None:
        require(
            tuple(pertoken_scale.shape) == (m,),
            op,
            f"pertoken_scale must be 1-D ({m},), got {tuple(pertoken_scale.shape)}",
            _QMM_DOC,
        )
    acc = torch.matmul(x1.double(), x2.double())
    if bias is not None:
        three = bias.dim() == 3 and acc.dim() == 3 and tuple(bias.shape[1:]) == (1, n)
        require(
            tuple(bias.shape) == (n,) or three,
            op,
            f"bias must be ({n},), or (batch, 1, {n}) for a 3-D output",
            _QMM_DOC,
        )
    int_bias = bias is not None and bias.dtype is torch.int32
    if int_bias:
        assert bias is not None
        acc = acc + bias.double()
    if out is torch.int32:
        return acc.to(torch.int32)
    if scale.dtype is torch.int64:
        s, packed_offset = _deq_scale(scale)
        offset = packed_offset if out is torch.int8 else None
    else:
        s = scale.float()
    y = acc.float() * s
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().unsqueeze(-1)
    if offset is not None:
        y = y + offset.float()
    if bias is not None and not int_bias:
        y = y + bias.float()
    return _saturate(y, torch.int8) if out is torch.int8 else y.to(out)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """int32 values in [-8, 7] -> int32 words of eight 4-bit values each along the last dim.

    Schema: ``npu_convert_weight_to_int4pack(weight, inner_k_tiles=0) -> Tensor``. Rules:
    weight int32, 2-D ((k, n) or (n, k)), contiguous (non-contiguous unsupported), not
    empty, its last dim a multiple of 8, every value in [-8, 7]; ``inner_k_tiles`` reserved.
    Output int32 (d0, d1 / 8), ND.

    Nibble order: the pages say only "packed compactly, interleaved"; the stand-in puts
    value 8j + i of a row in bits 4i..4i+3 of word j (two's-complement nibbles, the first
    value lowest, as vllm-ascend's ``w4a16.py`` assumes when it views int8 pairs as int32).
    Only ``npu_weight_quant_batchmatmul`` reads the words, and it reads them in that order.
    """
    op = "npu_convert_weight_to_int4pack"
    require_int(op, "inner_k_tiles", inner_k_tiles)
    require_dtype(op, "weight", weight, (torch.int32,), _PACK_DOC)
    require_rank(op, "weight", weight, (2,), _PACK_DOC)
    require(weight.is_contiguous(), op, "weight must be contiguous", _PACK_DOC)
    require(weight.numel() > 0, op, "weight must not be empty", _PACK_DOC)
    require(
        weight.shape[-1] % _NIBBLES == 0,
        op,
        f"weight's last dim must be a multiple of 8, got {weight.shape[-1]}",
        _PACK_DOC,
    )
    require(
        int(weight.min()) >= _INT4_MIN and int(weight.max()) <= _INT4_MAX,
        op,
        "weight's values must lie in int4's range [-8, 7]",
        _PACK_DOC,
    )
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight.device)
    nibbles = (weight & 0xF).reshape(weight.shape[0], -1, _NIBBLES) << shifts
    # Disjoint bit fields: their sum is their bitwise or (wrapping into the sign bit).
    return nibbles.sum(-1, dtype=torch.int32)


def _unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """``npu_convert_weight_to_int4pack``'s words (d0, d1 / 8) -> int32 values (d0, d1)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF
    signed = torch.where(nibbles > _INT4_MAX, nibbles - 16, nibbles)
    return signed.flatten(-2)


def _int4_weight(weight: torch.Tensor, k: int) -> torch.Tensor:
    """The int4 weight (k, n) an int32 ``weight`` holds: (k, n / 8) packed along n, or the
    transposed view (k / 8, n) of a (n, k / 8) packed along k."""
    op = "npu_weight_quant_batchmatmul"
    if weight.is_contiguous():
        require(weight.shape[0] == k, op, f"weight must be ({k}, n / 8) packed int4", _WQBMM_DOC)
        return _unpack_int4(weight)
    require(
        weight.t().is_contiguous() and weight.shape[0] * _NIBBLES == k,
        op,
        f"a transposed int4 weight must be the (k / 8, n) view of a contiguous (n, {k} / 8)",
        _WQBMM_DOC,
    )
    return _unpack_int4(weight.t()).t()


def _antiquant_groups(
    scale: torch.Tensor, k: int, n: int, group_size: int
) -> tuple[torch.Tensor, int]:
    """antiquant_scale's values as (groups, n) and the inputs each group covers."""
    op = "npu_weight_quant_batchmatmul"
    shape = tuple(scale.shape)
    if group_size == 0:
        require(
            shape in ((1,), (1, 1), (n,), (1, n)),
            op,
            f"antiquant_scale must be (1,), (1, 1), ({n},) or (1, {n}) without a group size, "
            f"got {shape}",
            _WQBMM_DOC,
        )
        return scale.reshape(1, -1), k
    require(
        32 <= group_size <= k - 1 and group_size % 32 == 0,
        op,
        f"antiquant_group_size must be a multiple of 32 in [32, k - 1 = {k - 1}], got {group_size}",
        _WQBMM_DOC,
    )
    groups = -(-k // group_size)
    require(
        shape == (groups, n),
        op,
        f"per-group antiquant_scale must be ({groups}, {n}), got {shape}",
        _WQBMM_DOC,
    )
    return scale, group_size


def _check_wqbmm_bias(x: torch.Tensor, bias: torch.Tensor, n: int) -> None:
    op = "npu_weight_quant_batchmatmul"
    want = torch.float32 if x.dtype is torch.bfloat16 else torch.float16
    require_dtype(op, "bias", bias, (want,), f"{_WQBMM_DOC}: bias float32 for bfloat16 x")
    require(bias.is_contiguous(), op, "bias must be contiguous", _WQBMM_DOC)
    require(tuple(bias.shape) in ((n,), (1, n)), op, f"bias must be ({n},) or (1, {n})", _WQBMM_DOC)


def npu_weight_quant_batchmatmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    antiquant_scale: torch.Tensor,
    antiquant_offset: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    antiquant_group_size: int = 0,
    inner_precise: int = 0,
) -> torch.Tensor:
    """``x @ ((weight + antiquant_offset) * antiquant_scale) + bias``.

    Schema: ``npu_weight_quant_batchmatmul(x, weight, antiquant_scale,
    antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
    antiquant_group_size=0, inner_precise=0) -> Tensor``. Rules (Atlas A2/A3):

    - x: (m, k), float16 or bfloat16 (a transposed view allowed); not empty.
    - weight: int8 (k, n), or int4 packed by ``npu_convert_weight_to_int4pack`` as int32
      (k, n / 8), or the transposed view of a packed (n, k / 8); k and n in [1, 65535].
    - antiquant_scale: x's dtype (int64 not implemented); per tensor (1,) / (1, 1), per
      channel (n,) / (1, n), per group (ceil(k / antiquant_group_size), n).
      antiquant_offset: antiquant_scale's shape and dtype.
    - antiquant_group_size: 0, or for per-group scales a multiple of 32 in [32, k - 1].
    - bias: (n,) or (1, n), contiguous; float32 for bfloat16 x, float16 for float16 x.
    - quant_scale / quant_offset (int8 output): not implemented. inner_precise 0 or 1.
    - Output: x's dtype. The weight is formed as the formula says, rounded once to x's dtype
      (the "high precision" mode; the page gives no order), and the product summed in
      float32 and rounded once.
    """
    op = "npu_weight_quant_batchmatmul"
    same_device(
        op,
        {
            "x": x,
            "weight": weight,
            "antiquant_scale": antiquant_scale,
            "antiquant_offset": antiquant_offset,
            "bias": bias,
        },
    )
    group_size = require_int(op, "antiquant_group_size", antiquant_group_size)
    require(
        require_int(op, "inner_precise", inner_precise) in (0, 1),
        op,
        "inner_precise must be 0 or 1",
        _WQBMM_DOC,
    )
    if quant_scale is not None or quant_offset is not None:
        raise not_implemented(op, "quant_scale / quant_offset (int8 output)")
    require_dtype(op, "x", x, HALVES, _WQBMM_DOC)
    require_rank(op, "x", x, (2,), _WQBMM_DOC)
    require_rank(op, "weight", weight, (2,), _WQBMM_DOC)
    require(x.numel() > 0 and weight.numel() > 0, op, "inputs must not be empty", _WQBMM_DOC)
    require_dtype(op, "weight", weight, (torch.int8, torch.int32), _WQBMM_DOC)
    if antiquant_scale.dtype is torch.int64:
        raise not_implemented(op, "an int64 antiquant_scale (int8 weights, per channel)")
    require_dtype(op, "antiquant_scale", antiquant_scale, (x.dtype,), _WQBMM_DOC)
    k = x.shape[1]
    w = weight.int() if weight.dtype is torch.int8 else _int4_weight(weight, k)
    require(w.shape[0] == k, op, f"weight's k ({w.shape[0]}) is not x's ({k})", _WQBMM_DOC)
    n = w.shape[1]
    require(k <= _MAX_DIM and n <= _MAX_DIM, op, "k and n must be at most 65535", _WQBMM_DOC)
    scale, per_group = _antiquant_groups(antiquant_scale, k, n, group_size)
    w = w.float()
    if antiquant_offset is not None:
        require_dtype(op, "antiquant_offset", antiquant_offset, (x.dtype,), _WQBMM_DOC)
        require(
            antiquant_offset.shape == antiquant_scale.shape,
            op,
            "antiquant_offset must have antiquant_scale's shape",
            _WQBMM_DOC,
        )
        w = w + antiquant_offset.float().reshape(scale.shape).repeat_interleave(per_group, 0)[:k]
    w = (w * scale.float().repeat_interleave(per_group, 0)[:k]).to(x.dtype)
    out = x.float() @ w.float()
    if bias is not None:
        _check_wqbmm_bias(x, bias, n)
        out = out + bias.float().reshape(n)
    return out.to(x.dtype)
