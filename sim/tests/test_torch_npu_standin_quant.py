"""The torch_npu stand-in's quantization ops against plain torch computations written here, and
each documented refusal."""

from __future__ import annotations

import pytest
import torch
from tandem_sim import torch_npu_standin as npu

torch.manual_seed(0)

M, K, N = 5, 64, 24


def codes(*shape: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, dtype=torch.int8)


def exact_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] times int8 [K, N] in int64: exact."""
    return a.long() @ b.long()


# ---- npu_quantize ----------------------------------------------------------------------------


def test_quantize_divides_rounds_half_to_even_and_saturates() -> None:
    x = torch.tensor([[0.25, 0.75, -0.25, 100.0, -100.0]], dtype=torch.bfloat16)
    q = npu.npu_quantize(x, torch.tensor([0.5]), None, torch.qint8, axis=-1, div_mode=True)
    assert q.dtype is torch.int8
    assert q.tolist() == [[0, 2, 0, 127, -128]]


def test_quantize_per_row_scales_along_axis_zero() -> None:
    x = torch.randn(M, K, dtype=torch.float16)
    scales = torch.rand(M) + 0.01
    q = npu.npu_quantize(x, scales, None, torch.qint8, axis=0, div_mode=True)
    want = torch.round(x.float() / scales[:, None]).clamp(-128, 127).to(torch.int8)
    assert torch.equal(q, want)


def test_quantize_multiply_mode_with_zero_points() -> None:
    x = torch.randn(3, K, dtype=torch.bfloat16)
    scales = (torch.rand(K) + 0.5).bfloat16()
    zeros = torch.full((K,), 2.0, dtype=torch.bfloat16)
    q = npu.npu_quantize(x, scales, zeros, torch.int8, axis=-1, div_mode=False)
    want = torch.round(x.float() * scales.float() + 2).clamp(-128, 127).to(torch.int8)
    assert torch.equal(q, want)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("int64 self", TypeError),
        ("float16 scales, div mode", TypeError),
        ("int8 dtype, div mode", TypeError),
        ("scales of another size", ValueError),
        ("axis out of range", ValueError),
        ("quint4x2", NotImplementedError),
    ],
)
def test_quantize_refusals(case: str, error: type[Exception]) -> None:
    x = torch.randn(M, K, dtype=torch.bfloat16)
    args: dict[str, object] = {
        "self": x, "scales": torch.tensor([0.1]), "zero_points": None,
        "dtype": torch.qint8, "axis": -1, "div_mode": True,
    }  # fmt: skip
    if case == "int64 self":
        args["self"] = torch.ones(M, K, dtype=torch.int64)
    elif case == "float16 scales, div mode":
        args["scales"] = torch.tensor([0.1], dtype=torch.float16)
    elif case == "int8 dtype, div mode":
        args["dtype"] = torch.int8
    elif case == "scales of another size":
        args["scales"] = torch.rand(3)
    elif case == "axis out of range":
        args["axis"] = 2
    else:
        args.update(dtype=torch.quint4x2, div_mode=False, scales=torch.ones(K).bfloat16())
    with pytest.raises(error):
        npu.npu_quantize(**args)  # type: ignore[arg-type]


# ---- npu_dynamic_quant -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dynamic_quant_scales_each_row_by_its_absmax(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, K, dtype=dtype)
    x[1, 2] = 0
    q, scale = npu.npu_dynamic_quant(x)
    assert (q.dtype, scale.dtype, tuple(scale.shape)) == (torch.int8, torch.float32, (2, 3))
    want_scale = x.float().abs().amax(-1) / 127
    assert torch.equal(scale, want_scale)
    safe = torch.where(want_scale == 0, 1.0, want_scale)
    assert torch.equal(q, torch.round(x.float() / safe[..., None]).to(torch.int8))
    assert int(q[1, 2].abs().max()) == 0


def test_dynamic_quant_with_smooth_scales() -> None:
    x = torch.randn(M, K, dtype=torch.float16)
    smooth = (torch.rand(K) + 0.5).half()
    q, scale = npu.npu_dynamic_quant(x, smooth_scales=smooth)
    h = x.float() * smooth.float()
    assert torch.equal(scale, h.abs().amax(-1) / 127)
    assert torch.equal(q, torch.round(h / scale[:, None]).to(torch.int8))


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("float32 input", TypeError),
        ("1-D input", ValueError),
        ("pertensor mode", ValueError),
        ("group index", NotImplementedError),
        ("smooth scales of another dtype", TypeError),
    ],
)
def test_dynamic_quant_refusals(case: str, error: type[Exception]) -> None:
    x = torch.randn(M, K, dtype=torch.float16)
    with pytest.raises(error):
        if case == "float32 input":
            npu.npu_dynamic_quant(x.float())
        elif case == "1-D input":
            npu.npu_dynamic_quant(x[0])
        elif case == "pertensor mode":
            npu.npu_dynamic_quant(x, quant_mode="pertensor")
        elif case == "group index":
            npu.npu_dynamic_quant(
                x, smooth_scales=torch.ones(1, K).half(), group_index=torch.tensor([M])
            )
        else:
            npu.npu_dynamic_quant(x, smooth_scales=torch.ones(K))


# ---- npu_quant_matmul ------------------------------------------------------------------------


def test_quant_matmul_int32_output_is_the_exact_sum_and_ignores_the_scale() -> None:
    a, w = codes(M, K), codes(N, K)
    out = npu.npu_quant_matmul(a, w.t(), torch.tensor([3.0]), output_dtype=torch.int32)
    assert out.dtype is torch.int32
    assert torch.equal(out.long(), exact_product(a, w.t()))
    bias = torch.randint(-1000, 1000, (N,), dtype=torch.int32)
    out = npu.npu_quant_matmul(a, w.t(), torch.ones(1), bias=bias, output_dtype=torch.int32)
    assert torch.equal(out.long(), exact_product(a, w.t()) + bias.long())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_matmul_per_token_and_per_channel_scales(dtype: torch.dtype) -> None:
    a, w = codes(M, K), codes(N, K)
    scale, pertoken = torch.rand(N) * 0.01, torch.rand(M) * 0.01
    bias = torch.randn(N)
    out = npu.npu_quant_matmul(
        a, w.t(), scale, pertoken_scale=pertoken, bias=bias, output_dtype=dtype
    )
    want = exact_product(a, w.t()).float() * scale * pertoken[:, None] + bias
    assert out.dtype is dtype
    assert torch.equal(out, want.to(dtype))


def test_quant_matmul_int64_deq_scale_with_int32_bias_to_float16() -> None:
    a, w = codes(M, K), codes(K, N)
    scale = torch.rand(N) * 0.01
    deq = npu.npu_trans_quant_param(scale)
    assert deq.dtype is torch.int64 and int(deq[0]) >> 46 == 1
    bias = torch.randint(-100, 100, (N,), dtype=torch.int32)
    out = npu.npu_quant_matmul(a, w, deq, bias=bias, output_dtype=torch.float16)
    # The deq scale keeps the float32's top 19 bits.
    kept = (scale.view(torch.int32) & -8192).view(torch.float32)
    want = (exact_product(a, w) + bias.long()).float() * kept
    assert torch.equal(out, want.half())


def test_quant_matmul_int8_output_with_offset_saturates() -> None:
    a, w = codes(M, K), codes(K, N)
    out = npu.npu_quant_matmul(a, w, torch.tensor([0.5]), offset=torch.tensor([1.0]))
    want = (exact_product(a, w).float() * 0.5 + 1).round().clamp(-128, 127).to(torch.int8)
    assert torch.equal(out, want)


def test_quant_matmul_batched_with_three_dimensional_bias() -> None:
    a, w = codes(2, M, K), codes(2, K, N)
    bias = torch.randint(-5, 5, (2, 1, N), dtype=torch.int32)
    out = npu.npu_quant_matmul(a, w, torch.ones(N), bias=bias, output_dtype=torch.bfloat16)
    want = (torch.matmul(a.double(), w.double()) + bias.double()).float()
    assert torch.equal(out, want.bfloat16())


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("float16 x1", TypeError),
        ("x1 and x2 of two dtypes", TypeError),
        ("1-D x1", ValueError),
        ("k mismatch", ValueError),
        ("float16 scale", TypeError),
        ("scale of another size", ValueError),
        ("2-D pertoken scale", ValueError),
        ("pertoken scale with int32 output", TypeError),
        ("float16 output without pertoken scale, float32 bias", TypeError),
        ("non-contiguous weight", ValueError),
        ("k above 65535", ValueError),
        ("int4 inputs", NotImplementedError),
    ],
)
def test_quant_matmul_refusals(case: str, error: type[Exception]) -> None:
    a, w = codes(M, K), codes(N, K).t()
    scale: torch.Tensor = torch.rand(N)
    kwargs: dict[str, object] = {"output_dtype": torch.bfloat16}
    if case == "float16 x1":
        a = a.half()
    elif case == "x1 and x2 of two dtypes":
        w = w.int()
    elif case == "1-D x1":
        a = a[0]
    elif case == "k mismatch":
        a = codes(M, K + 1)
    elif case == "float16 scale":
        scale = scale.half()
    elif case == "scale of another size":
        scale = torch.rand(N + 1)
    elif case == "2-D pertoken scale":
        kwargs["pertoken_scale"] = torch.rand(M, 1)
    elif case == "pertoken scale with int32 output":
        kwargs.update(pertoken_scale=torch.rand(M), output_dtype=torch.int32)
    elif case == "float16 output without pertoken scale, float32 bias":
        kwargs.update(bias=torch.randn(N), output_dtype=torch.float16)
    elif case == "non-contiguous weight":
        w = codes(N, 2 * K)[:, ::2].t()
    elif case == "k above 65535":
        a, w = codes(1, 65536), codes(65536, 8)
        scale = torch.rand(8)
    else:
        a, w = a.int(), w.int()
        kwargs["output_dtype"] = torch.float16
    with pytest.raises(error):
        npu.npu_quant_matmul(a, w, scale, **kwargs)  # type: ignore[arg-type]


# ---- npu_convert_weight_to_int4pack / npu_weight_quant_batchmatmul -------------------------


def test_int4pack_puts_value_eight_j_plus_i_in_nibble_i_of_word_j() -> None:
    values = torch.tensor([[1, -1, 2, -8, 7, 0, 3, -2, 5, 5, 5, 5, 5, 5, 5, 5]], dtype=torch.int32)
    words = npu.npu_convert_weight_to_int4pack(values)
    assert words.shape == (1, 2) and words.dtype is torch.int32
    want = sum((v & 0xF) << (4 * i) for i, v in enumerate(values[0, :8].tolist()))
    assert int(words[0, 0]) & 0xFFFFFFFF == want
    assert int(words[0, 1]) & 0xFFFFFFFF == 0x55555555


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("int8 weight", TypeError),
        ("3-D weight", ValueError),
        ("last dim not a multiple of 8", ValueError),
        ("value out of int4 range", ValueError),
        ("non-contiguous weight", ValueError),
    ],
)
def test_int4pack_refusals(case: str, error: type[Exception]) -> None:
    w = torch.randint(-8, 8, (K, N), dtype=torch.int32)
    bad = {
        "int8 weight": w.to(torch.int8),
        "3-D weight": w.reshape(2, K // 2, N),
        "last dim not a multiple of 8": w[:, :12].contiguous(),
        "value out of int4 range": w + 8,
        "non-contiguous weight": w.t(),
    }[case]
    with pytest.raises(error):
        npu.npu_convert_weight_to_int4pack(bad)


def _dequantized(
    w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> torch.Tensor:
    rows = (
        w.float() + offset.float().repeat_interleave(group, 0)
    ) * scale.float().repeat_interleave(group, 0)
    return rows.to(scale.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 0])
def test_weight_quant_batchmatmul_dequantizes_int4_then_multiplies(
    dtype: torch.dtype, group: int
) -> None:
    k, n = 128, 48
    w = torch.randint(-8, 8, (k, n), dtype=torch.int32)
    groups = k // group if group else 1
    scale = (torch.rand(groups, n) * 0.1).to(dtype)
    offset = torch.randint(-3, 4, (groups, n)).to(dtype)
    x = torch.randn(M, k, dtype=dtype)
    bias = torch.randn(n, dtype=torch.float32 if dtype is torch.bfloat16 else dtype)
    packed = npu.npu_convert_weight_to_int4pack(w)
    out = npu.npu_weight_quant_batchmatmul(
        x, packed, scale, offset, bias=bias, antiquant_group_size=group
    )
    weight = _dequantized(w, scale, offset, group or k)
    want = (x.float() @ weight.float() + bias.float()).to(dtype)
    assert out.dtype is dtype
    assert torch.equal(out, want)


def test_weight_quant_batchmatmul_reads_a_transposed_packed_weight() -> None:
    k, n = 64, 16
    w = torch.randint(-8, 8, (n, k), dtype=torch.int32)
    packed = npu.npu_convert_weight_to_int4pack(w).t()
    scale = torch.rand(1, n).half()
    x = torch.randn(M, k).half()
    out = npu.npu_weight_quant_batchmatmul(x, packed, scale)
    want = (x.float() @ (w.t().float() * scale.float()).half().float()).half()
    assert torch.equal(out, want)


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("float32 x", TypeError),
        ("scale of another dtype", TypeError),
        ("group size not a multiple of 32", ValueError),
        ("group size of the whole k", ValueError),
        ("per-group scale of the wrong shape", ValueError),
        ("offset of another shape", ValueError),
        ("float16 bias for bfloat16 x", TypeError),
        ("k mismatch", ValueError),
        ("quant scale", NotImplementedError),
    ],
)
def test_weight_quant_batchmatmul_refusals(case: str, error: type[Exception]) -> None:
    k, n = 128, 16
    x = torch.randn(M, k, dtype=torch.bfloat16)
    packed = npu.npu_convert_weight_to_int4pack(torch.randint(-8, 8, (k, n), dtype=torch.int32))
    scale = torch.rand(k // 32, n).bfloat16()
    kwargs: dict[str, object] = {"antiquant_group_size": 32}
    if case == "float32 x":
        x = x.float()
    elif case == "scale of another dtype":
        scale = scale.half()
    elif case == "group size not a multiple of 32":
        kwargs["antiquant_group_size"] = 48
    elif case == "group size of the whole k":
        kwargs["antiquant_group_size"] = k
        scale = scale[:1]
    elif case == "per-group scale of the wrong shape":
        scale = torch.rand(k // 64, n).bfloat16()
    elif case == "offset of another shape":
        kwargs["antiquant_offset"] = torch.zeros(1, n).bfloat16()
    elif case == "float16 bias for bfloat16 x":
        kwargs["bias"] = torch.zeros(n).half()
    elif case == "k mismatch":
        x = torch.randn(M, k + 32, dtype=torch.bfloat16)
    else:
        kwargs["quant_scale"] = torch.ones(n)
    with pytest.raises(error):
        npu.npu_weight_quant_batchmatmul(x, packed, scale, **kwargs)  # type: ignore[arg-type]
