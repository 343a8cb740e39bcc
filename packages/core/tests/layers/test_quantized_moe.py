"""Routed experts with quantized weights (``layers/quantized_moe.py``), loaded from per-expert
checkpoint tensors as llm-compressor (int8 W8A8) and AutoGPTQ / AutoAWQ (4-bit) write them.

What is checked: the experts compute what their float weights dequantized compute (int8: with
the activations fake-quantized the same way, in float64; an independent reading of the
checkpoint, so a scale on the wrong row or a shard off by one shows); the CPU kernels over
weights packed at load give the torch reference's result bit for bit (int8); two
tensor-parallel ranks give one rank's result (int8: bit for bit, the dense row-parallel
contract; 4-bit: to float rounding, as float experts); and what cannot be served is refused
naming the tensor or the size.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from tandem.collectives import ProcessGroup, SingleRankGroup, create_inprocess_groups
from tandem.core.kernels.cpu.int4_linear import native_int4_linear
from tandem.core.kernels.cpu.int8_gemm import native_int8
from tandem.core.kernels.reference import quantized_moe as reference
from tandem.core.kernels.reference.fused_moe import combine, topk_softmax
from tandem.core.kernels.reference.int4_packing import AWQ_ORDER, pack_int4, unpack_int4
from tandem.core.layers import quantized_moe
from tandem.core.layers.quant_scheme import AWQ_LAYOUT, QuantScheme, W4A16Scheme, W8A8Scheme
from tandem.core.layers.quantized_moe import QuantizedMoeExperts
from tandem.core.models.gptq_solver import quantize_gptq
from tandem.core.models.w4a16_writer import gptq_tensors
from tandem.core.models.w8a8_writer import quantize_weight

from ..conftest import HeldTensor

HIDDEN, EXPERTS, TOP_K, INTER, TOKENS = 64, 8, 2, 64, 23
PARTS = ("gate_proj", "up_proj", "down_proj")
Tensors = dict[str, torch.Tensor]


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _float_experts(seed: int = 0, inter: int = INTER) -> dict[str, list[torch.Tensor]]:
    """Each part's float weight per expert: gate/up [I, H], down [H, I]."""
    gen = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * 0.2

    return {
        "gate_proj": [w(inter, HIDDEN) for _ in range(EXPERTS)],
        "up_proj": [w(inter, HIDDEN) for _ in range(EXPERTS)],
        "down_proj": [w(HIDDEN, inter) for _ in range(EXPERTS)],
    }


def _static_scale(expert: int, part: str) -> float:
    """Calibrated-looking scales that differ per expert and part; the down projection's
    inputs (silu(gate) * up) are smaller than the hidden states."""
    return (0.004 if part == "down_proj" else 0.02) * (1 + 0.1 * expert + 0.05 * len(part))


def _w8a8(weights: dict[str, list[torch.Tensor]], static: bool) -> Tensors:
    tensors: Tensors = {}
    for part, per_expert in weights.items():
        for e, w in enumerate(per_expert):
            q, scale = quantize_weight(w)
            tensors[f"{e}.{part}.weight"] = q
            tensors[f"{e}.{part}.weight_scale"] = scale
            if static:
                tensors[f"{e}.{part}.input_scale"] = torch.tensor([_static_scale(e, part)])
    return tensors


def _gptq(
    weights: dict[str, list[torch.Tensor]], group: int, sym: bool, act_order: bool = False
) -> Tensors:
    """GPTQ tensors; ``act_order``: each weight quantized in a random input order (g_idx a
    permutation's groups), as GPTQ with ``desc_act`` writes it; gate and up of an expert
    read the same inputs, so they share the order."""
    gen = torch.Generator().manual_seed(7)
    orders = {e: torch.randperm(HIDDEN, generator=gen) for e in range(EXPERTS)}
    tensors: Tensors = {}
    for part, per_expert in weights.items():
        for e, w in enumerate(per_expert):
            base = f"{e}.{part}."
            if not act_order:
                tensors.update(gptq_tensors(base + "weight", w, group, sym))
                continue
            down = part == "down_proj"
            perm = torch.randperm(w.shape[1], generator=gen) if down else orders[e]
            permuted = gptq_tensors(base + "weight", w[:, perm], group, sym)
            back = torch.argsort(perm)
            codes = unpack_int4(permuted[base + "qweight"], dim=0)[back]
            tensors[base + "qweight"] = pack_int4(codes, dim=0)
            tensors[base + "qzeros"] = permuted[base + "qzeros"]
            tensors[base + "scales"] = permuted[base + "scales"]
            tensors[base + "g_idx"] = permuted[base + "g_idx"][back]
    return tensors


def _awq(gptq: Tensors) -> Tensors:
    """Asymmetric GPTQ tensors in AutoAWQ's GEMM layout (packed along the outputs)."""
    out: Tensors = {}
    for name, t in gptq.items():
        kind = name.rpartition(".")[2]
        if kind == "qweight":
            out[name] = pack_int4(unpack_int4(t, dim=0), dim=1, order=AWQ_ORDER)
        elif kind == "qzeros":
            out[name] = pack_int4(unpack_int4(t, dim=1).long() + 1, dim=1, order=AWQ_ORDER)
        elif kind != "g_idx":
            out[name] = t
    return out


def _dequantized_4bit(
    weights: dict[str, list[torch.Tensor]], group: int, sym: bool
) -> dict[str, list[torch.Tensor]]:
    """The float weights the 4-bit checkpoint holds, from the writer's codes (not through the
    packing the layer reads)."""
    out: dict[str, list[torch.Tensor]] = {}
    for part, per_expert in weights.items():
        out[part] = []
        for w in per_expert:
            codes, zeros, scales = quantize_gptq(w, group, sym)
            size = w.shape[1] if group == -1 else group
            groups = torch.arange(w.shape[1]) // size
            deq = (codes.double() - zeros.double()[:, groups]) * scales.double()[:, groups]
            out[part].append(deq.float())
    return out


def _experts(
    tensors: Tensors, scheme: QuantScheme, group: ProcessGroup, inter: int = INTER
) -> QuantizedMoeExperts:
    experts = QuantizedMoeExperts(EXPERTS, HIDDEN, inter, "silu", group, scheme)
    for name, tensor in tensors.items():
        experts.load_checkpoint_tensor(name, HeldTensor(tensor), f"mlp.experts.{name}")
    assert experts.fully_loaded()
    experts.finish_loading("mlp.experts")
    return experts


def _routing(
    seed: int = 1, tokens: int = TOKENS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, ids = topk_softmax(torch.randn(tokens, EXPERTS, generator=gen), TOP_K, True)
    return x, weights, ids


def fake_quantize(h: torch.Tensor, static: float | None) -> torch.Tensor:
    """``h`` rounded to int8 codes of its rows' (or the static) scale and back, in float64."""
    if static is None:
        scale = h.abs().amax(-1, keepdim=True) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    else:
        scale = torch.tensor(static, dtype=torch.float64)
    return torch.round(h / scale).clamp(-128, 127) * scale


def _expected(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    dense: dict[str, list[torch.Tensor]],
    fake_quantize: Callable[[torch.Tensor, int, str], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Token by token in float64: sum over its experts of weight * down(silu(gate) * up),
    each projection's input passed through ``fake_quantize`` (int8 activations)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            e = int(ids[t, c])

            def q(h: torch.Tensor, part: str, e: int = e) -> torch.Tensor:
                return h if fake_quantize is None else fake_quantize(h, e, part)

            xt = x[t].double()
            gate = dense["gate_proj"][e].double() @ q(xt, "gate_proj")
            up = dense["up_proj"][e].double() @ q(xt, "up_proj")
            hidden = F.silu(gate) * up
            out[t] += weights[t, c].double() * (
                dense["down_proj"][e].double() @ q(hidden, "down_proj")
            )
    return out


def _int8_dense(tensors: Tensors) -> dict[str, list[torch.Tensor]]:
    """The float weights an int8 checkpoint holds: q * scale, read from its tensors."""
    return {
        part: [
            tensors[f"{e}.{part}.weight"].double() * tensors[f"{e}.{part}.weight_scale"].double()
            for e in range(EXPERTS)
        ]
        for part in PARTS
    }


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_int8_experts_compute_their_dequantized_weights_on_int8_activations(
    static: bool,
) -> None:
    tensors = _w8a8(_float_experts(), static)
    experts = _experts(tensors, W8A8Scheme(static=static), SingleRankGroup())
    x, weights, ids = _routing()
    got = experts(x, weights, ids)

    def fake(h: torch.Tensor, e: int, part: str) -> torch.Tensor:
        if not static:
            return fake_quantize(h, None)
        # gate and up are one fused matmul: the larger of their two scales.
        parts = ("gate_proj", "up_proj") if part != "down_proj" else (part,)
        return fake_quantize(h, max(_static_scale(e, p) for p in parts))

    expected = _expected(x, weights, ids, _int8_dense(tensors), fake)
    # float32 scaling of exact int32 sums against float64: a code of the down projection's
    # inputs may round the other way, one int8 step of one input; a misplaced scale or shard
    # moves whole outputs.
    assert (got.double() - expected).abs().max().item() <= 2e-3 * expected.abs().max().item()
    assert expected.abs().max().item() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_cpu_int8_kernels_give_the_reference_bit_for_bit(
    static: bool, dtype: torch.dtype
) -> None:
    """The native grouped kernel over every expert's packed weight (one call a projection)
    against the torch reference's per-expert steps over the plain stacked weights (the same
    activation kernel between them): bit for bit, the int32 sums being exact and every float
    step the reference's. Token counts from one (most experts empty) to enough rows per
    expert for several of the kernel's row tasks (64 rows each)."""
    kernels = native_int8()
    if kernels is None:
        pytest.skip("no CPU int8 kernel here (no compiler, or TANDEM_INT8=torch)")
    tensors = _w8a8(_float_experts(), static)
    scheme = W8A8Scheme(static=static)
    packed = _experts(tensors, scheme, SingleRankGroup())
    assert packed.pack_int8(kernels) == 2
    assert packed.pack_int8(kernels) == 0  # once
    assert packed.w13.packed is not None and packed.w13.packed.experts == EXPERTS
    assert packed.w13.weight.numel() == 0  # one copy: the packed one
    assert packed.packed_bytes() >= 3 * EXPERTS * INTER * HIDDEN
    plain = _experts(tensors, scheme, SingleRankGroup())
    plain._linear = reference.moe_int8_linear  # type: ignore[assignment]
    for tokens in (1, 3, TOKENS, 300):
        x, weights, ids = _routing(tokens=tokens)
        x = x.to(dtype)
        assert torch.equal(packed(x, weights, ids), plain(x, weights, ids)), tokens


def test_the_grouped_int8_kernel_refuses_offsets_that_do_not_cover_the_rows() -> None:
    """Offsets are read by the kernel where they lie: ones out of order, or not ending at the
    rows' count, would read or write past the rows, and are refused."""
    kernels = native_int8()
    if kernels is None:
        pytest.skip("no CPU int8 kernel here (no compiler, or TANDEM_INT8=torch)")
    experts = kernels.pack_experts(torch.ones(2, 64, HIDDEN, dtype=torch.int8))
    scales = torch.ones(2, 64, 1)
    rows = torch.randn(5, HIDDEN)
    good = torch.tensor([0, 2, 5])
    assert kernels.grouped_linear(rows, experts, good, scales, None).shape == (5, 64)
    for bad in ([0, 2, 4], [0, 2, 6], [1, 2, 5], [0, 3, 2]):
        with pytest.raises(ValueError, match="refused its arguments"):
            kernels.grouped_linear(rows, experts, torch.tensor(bad), scales, None)


GPTQ_CASES = {
    "gptq group 32 sym": (32, True, False),
    "gptq group 32 asym": (32, False, False),
    "gptq per channel": (-1, True, False),
    "gptq act order": (32, False, True),
}


def _four_bit(case: str) -> tuple[Tensors, W4A16Scheme, dict[str, list[torch.Tensor]]]:
    weights = _float_experts()
    if case == "awq group 32":
        scheme = W4A16Scheme(32, sym=False, desc_act=False, layout=AWQ_LAYOUT)
        return _awq(_gptq(weights, 32, False)), scheme, _dequantized_4bit(weights, 32, False)
    group, sym, act_order = GPTQ_CASES[case]
    scheme = W4A16Scheme(group, sym=sym, desc_act=act_order)
    tensors = _gptq(weights, group, sym, act_order)
    if act_order:
        # The dequantized weights of a permuted quantization: read back from the tensors.
        dense = {
            part: [_gptq_dequantized(tensors, f"{e}.{part}", sym) for e in range(EXPERTS)]
            for part in PARTS
        }
        return tensors, scheme, dense
    return tensors, scheme, _dequantized_4bit(weights, group, sym)


def _gptq_dequantized(tensors: Tensors, base: str, sym: bool) -> torch.Tensor:
    codes = unpack_int4(tensors[f"{base}.qweight"], dim=0).double()  # [K, N]
    groups = tensors[f"{base}.g_idx"].long()
    scales = tensors[f"{base}.scales"].double()[groups]
    zeros = 8.0 if sym else unpack_int4(tensors[f"{base}.qzeros"], dim=1).double()[groups] + 1
    return ((codes - zeros) * scales).t().float()


FOUR_BIT = [*GPTQ_CASES, "awq group 32"]


@pytest.mark.parametrize("case", FOUR_BIT)
def test_4bit_experts_compute_their_dequantized_weights(case: str) -> None:
    tensors, scheme, dense = _four_bit(case)
    experts = _experts(tensors, scheme, SingleRankGroup())
    x, weights, ids = _routing()
    got = experts(x, weights, ids)
    expected = _expected(x, weights, ids, dense)
    assert (got.double() - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    assert expected.abs().max().item() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["gptq group 32 asym", "gptq per channel", "awq group 32"])
def test_4bit_experts_take_one_grouped_call_without_reading_the_offsets_on_the_host(
    case: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU kernel each projection is one grouped call, given the routing's offsets
    tensor: the spans are never read on the host (a sync on an accelerator), and each
    expert's rows come out bit for bit as the per-expert steps' dense calls give them (the
    same tiles at these few rows an expert, ``test_int4_grouped.py``)."""
    kernel = native_int4_linear()
    if kernel is None or not kernel.grouped:
        pytest.skip("no CPU 4-bit kernel with the grouped call here")
    tensors, scheme, _ = _four_bit(case)
    experts = _experts(tensors, scheme, SingleRankGroup()).to(dtype)
    a, b = experts.w13.int4, experts.w2.int4
    assert a is not None and b is not None
    per_expert = functools.partial(reference.grouped_int4_linear, kernel.int4_linear)
    for tokens in (1, TOKENS):
        x, weights, ids = _routing(tokens=tokens)
        x, weights = x.to(dtype), weights.to(dtype)
        order, token, spans = reference.sort_by_expert(ids, EXPERTS)
        assert max(end - start for _, start, end in spans) <= kernel.kernel_rows[dtype]
        rows = x.index_select(0, token)
        hidden = experts._act(per_expert(rows, spans, a.qweight, a.scales, a.qzeros, None))
        out = per_expert(hidden, spans, b.qweight, b.scales, b.qzeros, None)
        want = combine(x, out, order, token, weights)
        with monkeypatch.context() as patched:
            patched.setattr(quantized_moe, "spans_of", _no_host_read)
            patched.setattr(quantized_moe, "sort_by_expert", _no_host_read)
            got = experts(x, weights, ids)
        assert torch.equal(got, want), tokens


def _no_host_read(*args: object) -> None:
    raise AssertionError("the experts read the routing's offsets on the host")


def _on_ranks(build: Callable[[ProcessGroup], torch.Tensor], size: int = 2) -> list[torch.Tensor]:
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(group: ProcessGroup) -> None:
        try:
            results[group.rank] = build(group)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [
        threading.Thread(target=rank, args=(g,))
        for g in create_inprocess_groups(size, timeout_s=30)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return [results[r] for r in range(size)]


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_int8_experts_over_two_ranks_give_one_ranks_result_bit_for_bit(
    static: bool, packed: bool
) -> None:
    """Each rank returns the whole result (no float reduce after it): the down projection's
    rows are quantized with the scales one rank would use and the int32 sums are reduced.
    Packed for the CPU kernel, each rank's gate/up projection is one grouped call and its
    down projection the per-expert steps that reduce between them."""
    kernels = native_int8()
    if packed and kernels is None:
        pytest.skip("no CPU int8 kernel here (no compiler, or TANDEM_INT8=torch)")
    tensors = _w8a8(_float_experts(), static)
    scheme = W8A8Scheme(static=static)
    x, weights, ids = _routing()
    whole = _experts(tensors, scheme, SingleRankGroup())(x, weights, ids)

    def rank(group: ProcessGroup) -> torch.Tensor:
        experts = _experts(tensors, scheme, group)
        assert not experts.partial_sums
        assert experts.w13.weight.shape == (EXPERTS, INTER, HIDDEN)  # half of 2 * INTER
        assert experts.w2.weight.shape == (EXPERTS, HIDDEN, INTER // 2)
        if packed:
            assert kernels is not None and experts.pack_int8(kernels) == 2
        out: torch.Tensor = experts(x, weights, ids)
        return out

    for result in _on_ranks(rank):
        assert torch.equal(result, whole)


@pytest.mark.parametrize("case", ["gptq group 32 asym", "gptq act order", "awq group 32"])
def test_4bit_experts_over_two_ranks_sum_to_one_ranks_result(case: str) -> None:
    tensors, scheme, _ = _four_bit(case)
    x, weights, ids = _routing()
    whole = _experts(tensors, scheme, SingleRankGroup())(x, weights, ids)

    def rank(group: ProcessGroup) -> torch.Tensor:
        experts = _experts(tensors, scheme, group)
        assert experts.partial_sums
        out: torch.Tensor = group.all_reduce(experts(x, weights, ids))
        return out

    for result in _on_ranks(rank):
        assert (result - whole).abs().max().item() <= 1e-5 * whole.abs().max().item()


class _Rank:
    """The coordinates a layer shards by (loading issues no collective)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


def _rank(rank: int, size: int) -> ProcessGroup:
    return _Rank(rank, size)  # type: ignore[return-value]


def test_a_group_straddling_two_ranks_is_refused_naming_the_size() -> None:
    """Groups of 32 over a down projection of 32 inputs: two ranks would hold 16 each."""
    with pytest.raises(ValueError, match="moe_intermediate_size 32 over 2") as caught:
        QuantizedMoeExperts(EXPERTS, HIDDEN, 32, "silu", _rank(0, 2), W4A16Scheme(32, True, False))
    assert "straddle two tensor-parallel ranks" in str(caught.value)


def test_a_rank_share_off_packed_words_is_refused() -> None:
    with pytest.raises(ValueError, match=r"per tensor-parallel rank \(12\) is not a multiple of 8"):
        QuantizedMoeExperts(EXPERTS, HIDDEN, 24, "silu", _rank(0, 2), W4A16Scheme(-1, True, False))


def test_stacked_expert_tensors_are_refused() -> None:
    experts = QuantizedMoeExperts(
        EXPERTS, HIDDEN, INTER, "silu", SingleRankGroup(), W8A8Scheme(False)
    )
    stacked = torch.zeros(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"mlp\.experts\.gate_up_proj is no expert tensor"):
        experts.load_checkpoint_tensor(
            "gate_up_proj", HeldTensor(stacked), "mlp.experts.gate_up_proj"
        )


def test_tensors_of_another_scheme_or_size_are_refused_naming_them() -> None:
    experts = QuantizedMoeExperts(
        EXPERTS, HIDDEN, INTER, "silu", SingleRankGroup(), W8A8Scheme(False)
    )
    scale = HeldTensor(torch.tensor([0.1]))
    with pytest.raises(ValueError, match=r"3\.up_proj\.input_scale is not a tensor of an expert"):
        experts.load_checkpoint_tensor(
            "3.up_proj.input_scale", scale, "mlp.experts.3.up_proj.input_scale"
        )
    wide = HeldTensor(torch.zeros(2 * INTER, HIDDEN, dtype=torch.int8))
    with pytest.raises(ValueError, match="moe_intermediate_size 64"):
        experts.load_checkpoint_tensor("3.up_proj.weight", wide, "mlp.experts.3.up_proj.weight")
    floats = HeldTensor(torch.zeros(INTER, HIDDEN))
    with pytest.raises(ValueError, match=r"is torch\.float32, the model expects torch\.int8"):
        experts.load_checkpoint_tensor("3.up_proj.weight", floats, "mlp.experts.3.up_proj.weight")
    assert not experts.fully_loaded()
