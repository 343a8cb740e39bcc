"""The Triton fused MoE against the torch reference (``reference/fused_moe.py``), under
Triton's interpreter: experts with no tokens, one token and more rows than a row tile, top-k
1 and 2 (a token's experts given in either order), a single decode token, both row-tile
heights, every activation; and that the wrapper never reads a value back to the host.

Error analysis. Both sides compute the same rounded steps, so each is bounded against the
exact value (float64, from the same stored inputs) by forward error analysis, and the two
differ by at most the sum of their bounds (``moe_bound``). Per (token, choice) row, with u
the float32 unit roundoff, rho the data dtype's (a rounding to nearest moves v by at most
rho |v| plus eta, half the subnormal spacing; Triton's interpreter truncates float32 to
bfloat16, so its rho is doubled there) and E the error carried in:
- gate and up: a float32 sum of H products is within (H + 1) u sum |x| |w| of exact in any
  order (Higham, sec. 3.1; the products of float16/bfloat16 values are exact in float32),
  then stored: E + rho (|v| + E) + eta;
- the activation, off by at most 1.13 E_gate from its Lipschitz constant (max |silu'| <
  1.1, max |gelu'| < 1.13 for both forms) plus 8 u (|act| + |gate|) from the float32
  formulas (as in ``test_elementwise.py``), stored; its product with up, stored;
- down: sum |w| E_hidden plus the float32 sum's (I + 1) u sum |w| |hidden|, stored;
- the routing weight is rounded to the dtype identically on both sides; the product with it
  stored, and the token's rows added in expert order, each addition stored.
In float32 the bound is also held to 1e-4 of max(1, |ref|). Worst-case sums are loose (the
measured errors are a few hundredths of the bound in float32 and float16), so in float16 the
test also asks that the results be mostly equal (``mostly_identical``: under 2 % of the
elements differ; measured 0.3 %, against about half when one rounding is left out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.core.kernels.reference import fused_moe as reference
from tandem.core.kernels.triton import fused_moe as triton_moe

from ..cpu.rounding import mostly_identical, unit_roundoff, within

U32 = unit_roundoff(torch.float32)
LIPSCHITZ = 1.13
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
# Ops that wait for the device: a value read back (item, tolist, int()), an output sized by
# data (nonzero, unique, masked_select), or bincount, which on CUDA reads its largest index
# back to size the output.
HOST_SYNCS = (
    "aten._local_scalar_dense",
    "aten.item",
    "aten.nonzero",
    "aten.unique",
    "aten._unique2",
    "aten.masked_select",
    "aten.bincount",
    "aten.repeat_interleave",
)


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def side_error(case: Case, activation: str, rho: float) -> torch.Tensor:
    """A bound on |one side's result - exact| per output element, with ``rho`` per rounding
    to the data dtype (the module docstring derives each step)."""
    x, w13, w2, topk_weights, topk_ids = case
    dtype = x.dtype
    eta = torch.finfo(dtype).tiny * torch.finfo(dtype).eps / 2

    def stored(err: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return err + rho * (value.abs() + err) + eta

    hidden, inter = x.shape[1], w2.shape[2]
    xs = x.double()
    w_up = w13.double()[topk_ids]  # [T, k, 2I, H]
    gate_up = torch.einsum("th,tkih->tki", xs, w_up)
    magnitude = torch.einsum("th,tkih->tki", xs.abs(), w_up.abs())
    e_gate_up = stored((hidden + 1) * U32 * magnitude, gate_up)
    (gate, up), (e_gate, e_up) = gate_up.chunk(2, -1), e_gate_up.chunk(2, -1)
    act = ACTIVATIONS[activation](gate)
    formula = 8 * U32 * (act.abs() + gate.abs() + (LIPSCHITZ + 1) * e_gate)
    e_act = stored(LIPSCHITZ * e_gate + formula, act)
    h = act * up
    e_h = stored(act.abs() * e_up + up.abs() * e_act + e_act * e_up, h)
    w_down = w2.double()[topk_ids].abs()  # [T, k, H, I]
    out = torch.einsum("tki,tkhi->tkh", h, w2.double()[topk_ids])
    e_sum = (inter + 1) * U32 * torch.einsum("tki,tkhi->tkh", h.abs() + e_h, w_down)
    e_out = stored(torch.einsum("tki,tkhi->tkh", e_h, w_down) + e_sum, out)
    weight = topk_weights.to(dtype).double().unsqueeze(-1)
    e_scaled = stored(weight.abs() * e_out, weight * out)
    # Added in expert order (the token's sorted rows), each partial sum stored.
    by_expert = topk_ids.argsort(dim=1).unsqueeze(-1).expand_as(e_scaled)
    scaled, e_scaled = (weight * out).gather(1, by_expert), e_scaled.gather(1, by_expert)
    total, error = scaled[:, 0], e_scaled[:, 0]
    for j in range(1, topk_ids.shape[1]):
        total = total + scaled[:, j]
        error = stored(error + e_scaled[:, j], total)
    return error


def moe_bound(case: Case, activation: str) -> torch.Tensor:
    """|kernel - reference| <= the sum of their bounds against the exact value."""
    rho = unit_roundoff(case[0].dtype)
    kernel_rho = 2 * rho if case[0].dtype is torch.bfloat16 else rho
    return side_error(case, activation, rho) + side_error(case, activation, kernel_rho)


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Top-k ids: with 20 tokens and 6 experts, top-2 sends 18 rows to expert 0 and 19 to
    expert 3 (more than one 16-row tile each), one to each of experts 1, 2 and 5, none to
    4; top-1 sends 18 to expert 0, one to each of 2 and 5, none to the others. Odd tokens
    list their experts in descending order. Other sizes are drawn at random."""
    if (tokens, experts) != (20, 6):
        return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    first = torch.zeros(tokens, dtype=torch.int64)
    first[18], first[19] = 2, 5
    second = torch.full((tokens,), 3, dtype=torch.int64)
    second[0] = 1
    if top_k == 1:
        return first.unsqueeze(1)
    ids = torch.stack((first, second), dim=1)
    ids[1::2] = ids[1::2].flip(1)
    return ids


def make_case(dtype: torch.dtype, tokens: int, experts: int, top_k: int, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 48, 40  # neither a multiple of the 32-wide K tiles nor the 64-wide N
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    ids = routing(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return x, w13, w2, weights, ids


def check(dtype: torch.dtype, tokens: int, experts: int, top_k: int, activation: str) -> None:
    case = make_case(dtype, tokens, experts, top_k, tokens + top_k)
    want = reference.fused_moe(*case, activation)
    got = triton_moe.fused_moe(*case, activation)
    within(got, want, moe_bound(case, activation))
    if dtype is torch.float32:
        error = (got.double() - want.double()).abs()
        assert bool((error <= 1e-4 * want.double().abs().clamp_min(1.0)).all())
    if dtype is torch.float16:
        mostly_identical(got, want)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_experts_with_none_one_and_many_rows(dtype: torch.dtype, top_k: int) -> None:
    check(dtype, 20, 6, top_k, "silu")


@pytest.mark.parametrize(
    ("tokens", "experts", "activation"),
    [
        (1, 8, "gelu"),  # one decode token: two experts of one row, six of none
        (20, 2, "gelu_pytorch_tanh"),  # 40 rows over 2 experts: 64-row tiles
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_and_tall_tiles(
    dtype: torch.dtype, tokens: int, experts: int, activation: str
) -> None:
    check(dtype, tokens, experts, 2, activation)


class RecordOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every aten op dispatched while active (under the interpreter a launch adds the copies
    it makes of its tensors: ``copy_``, ``set_``; none reads a value)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def host_syncs(fn: Callable[..., torch.Tensor], *args: torch.Tensor | str) -> set[str]:
    with RecordOps() as recorder:
        fn(*args)
    return {op for op in recorder.ops if op.startswith(HOST_SYNCS)}


def test_the_wrapper_never_waits_on_the_device() -> None:
    """Routing, grid and launches use shapes and device tensors only. The recorder sees the
    reference's ``nonzero`` (its active experts, read back by ``tolist``), so it would see
    ours."""
    args: tuple[torch.Tensor | str, ...] = (*make_case(torch.float32, 20, 6, 2, 0), "silu")
    assert host_syncs(triton_moe.fused_moe, *args) == set()
    assert "aten.nonzero" in host_syncs(reference.fused_moe, *args)
