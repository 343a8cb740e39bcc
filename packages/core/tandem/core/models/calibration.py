"""The calibration statistics GPTQ needs: for each decoder projection, the sum of x x^T over
the calibration tokens of its input activations x (GPTQ's Hessian up to a factor of 2), from
the float model run by Tandem itself in float32 on the calibration samples.

The fused layers that share an input share the statistics: q, k and v (``qkv_proj``), gate
and up (``gate_up_proj``, a shared expert's too), and a Gated DeltaNet's qkv, z, b and a
(``in_proj_qkvz``; b and a in ``in_proj_ba`` where the layer keeps them apart, with the same
sums, as it has the same input). Every layer's activations come from the float model (GPTQ
with ``true_sequential`` re-runs each layer on its quantized predecessors' outputs instead;
here the writer records ``true_sequential: false``).

The routed experts of a mixture-of-experts layer get theirs one by one: expert e's gate and up
share the sum over the hidden states routed to it (a token counted once for each expert it
chose; the routing weights scale the experts' outputs, not their inputs), its down projection
the sum over the intermediate activations act(gate) * up it computed for them. An expert no
calibration token was routed to gets none (the writer rounds it to nearest and says how many
of each layer's experts did).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.core import CacheConfig, EngineConfig, LLMEngine, ModelLoadConfig
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.layers.fused_moe import FusedMoeExperts
from tandem.core.layers.quantized_linear import QuantizableLinear
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.model_runner import ModelRunner
from tandem.core.llm.prompt_logits import prompt_logits
from tandem.core.llm.tokenizer import Tokenizer
from tandem.core.worker.worker import Worker

logger = logging.getLogger(__name__)

# Our fused modules, and the checkpoint projections each computes from the same input.
_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
    # With b and a too where the layer fuses them (the float model calibrated always does);
    # where it keeps ``in_proj_ba`` apart, both record the same sums (one input).
    "linear_attn.in_proj_qkvz": (
        "linear_attn.in_proj_qkv",
        "linear_attn.in_proj_z",
        "linear_attn.in_proj_b",
        "linear_attn.in_proj_a",
    ),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    "linear_attn.out_proj": ("linear_attn.out_proj",),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "mlp.shared_expert.down_proj": ("mlp.shared_expert.down_proj",),
}
_MODULE = re.compile(r"^layers\.(\d+)\.(" + "|".join(re.escape(m) for m in _PARTS) + r")$")
# A layer's routed experts.
_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts$")


def calibration_samples(model: Path, text: str, count: int, length: int) -> list[list[int]]:
    """Up to ``count`` samples of ``length`` tokens each, cut from ``text`` in order (the
    last one may be shorter)."""
    tokens = Tokenizer(model).encode(text)
    samples = [tokens[i : i + length] for i in range(0, len(tokens), length)][:count]
    samples = [s for s in samples if len(s) > 1]
    if not samples:
        raise ValueError("the calibration text gives no tokens")
    return samples


def expert_statistics_bytes(modules: list[FusedMoeExperts]) -> int:
    """What the routed experts' sums take at most: per expert a [H, H] and an [I, I] float64."""
    return sum(m.num_experts * (m.hidden_size**2 + m.local_size**2) * 8 for m in modules)


def collect_hessians(
    model: Path, samples: list[list[int]], free_bytes: Callable[[], int] | None = None
) -> dict[str, torch.Tensor]:
    """Sum of x x^T (float64 [K, K]) of each projection's inputs over every sample's tokens,
    keyed by the projection's checkpoint name without ``.weight``
    (``model.layers.3.self_attn.q_proj``, ``model.layers.3.mlp.experts.7.up_proj``); none
    for a routed expert no sample's token was routed to, nor for any routed expert where
    their sums would take more than half of the memory free once the model is loaded
    (``free_bytes()``, default: the device's, as the KV cache sizing reads it, the page cache
    counted free; a large MoE's: Qwen3-30B-A3B's take ~235 GB), which the writer then rounds
    to nearest."""
    longest = max(map(len, samples))
    engine = LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(model), dtype="float32"),
            cache=CacheConfig(num_blocks=-(-longest // 16) + 4),
        )
    )
    sums: dict[str, torch.Tensor] = {}

    def accumulate(name: str, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).double()
        product = rows.t() @ rows
        sums[name] = sums[name] + product if name in sums else product

    def accumulate_experts(layer: str, expert: int, x: torch.Tensor, hidden: torch.Tensor) -> None:
        accumulate(f"model.layers.{layer}.mlp.experts.{expert}.gate_proj", x)
        accumulate(f"model.layers.{layer}.mlp.experts.{expert}.down_proj", hidden)

    def install(worker: Worker[ForwardInput, SamplerOutput]) -> list[Callable[[], None]]:
        runner = worker.runner
        assert isinstance(runner, ModelRunner)
        removers = []
        routed = [m for m in runner.model.modules() if isinstance(m, FusedMoeExperts)]
        needed = expert_statistics_bytes(routed)
        if free_bytes is not None:
            free = free_bytes()
        else:
            assert worker.runtime is not None
            free = worker.runtime.memory_info(worker.device).free_bytes
        calibrate_experts = needed <= free // 2
        if not calibrate_experts:
            logger.warning(
                "calibration: the routed experts' statistics would take %.1f GiB, more than "
                "half of the %.1f GiB of memory free; their weights are rounded to nearest",
                needed / 2**30,
                free / 2**30,
            )
        for name, module in runner.model.named_modules():
            if _MODULE.match(name) and isinstance(module, QuantizableLinear):
                removers.append(_record_inputs(module, functools.partial(accumulate, name)))
            experts = _EXPERTS.match(name)
            if calibrate_experts and experts and isinstance(module, FusedMoeExperts):
                record = functools.partial(accumulate_experts, experts.group(1))
                removers.append(_record_expert_inputs(module, record))
        return removers

    executor = engine.executor
    if not isinstance(executor, ThreadExecutor):
        raise TypeError("calibration runs the model in this process (a thread executor)")
    try:
        removers = executor.call(0, install)
        for number, sample in enumerate(samples, 1):
            prompt_logits(engine, sample)
            if number % 16 == 0 or number == len(samples):
                logger.info("calibration: %d of %d samples", number, len(samples))
        for remove in removers:
            remove()
    finally:
        engine.shutdown()
    out: dict[str, torch.Tensor] = {}
    for name, total in sums.items():
        if name.startswith("model."):  # a routed expert's: gate and up share their input
            out[name] = total
            if name.endswith(".gate_proj"):
                out[name.removesuffix("gate_proj") + "up_proj"] = total
            continue
        match = _MODULE.match(name)
        assert match is not None
        for part in _PARTS[match.group(2)]:
            out[f"model.layers.{match.group(1)}.{part}"] = total
    return out


def _record_inputs(
    module: QuantizableLinear, record: Callable[[torch.Tensor], None]
) -> Callable[[], None]:
    """Pass every input of ``module``'s matmul to ``record``; returns the undo. The matmul,
    not the forward: a shared expert's down projection is called through ``partial``, which
    forward hooks never see."""
    plain = module.matmul

    def matmul(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        record(x)
        return plain(x, bias)

    # An instance attribute shadows the method until it is deleted. A gate/up layer that
    # fuses its activation (``silu_matmul``) is kept on the plain matmul meanwhile.
    module.__dict__["matmul"] = matmul
    module.__dict__["silu_matmul"] = lambda x: None

    def undo() -> None:
        del module.__dict__["matmul"]
        del module.__dict__["silu_matmul"]

    return undo


def _record_expert_inputs(
    module: FusedMoeExperts, record: Callable[[int, torch.Tensor, torch.Tensor], None]
) -> Callable[[], None]:
    """Pass each expert's routed input rows and their intermediate activations to ``record``
    (expert, rows [n, H], activations [n, I]) on every forward of ``module``, for the experts
    that got rows; returns the undo."""
    plain = module.forward

    def forward(
        x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        rows, counts, hidden = module.routed_inputs(x, topk_ids)
        sizes = counts.tolist()
        pairs = zip(torch.split(rows, sizes), torch.split(hidden, sizes), strict=True)
        for expert, (r, h) in enumerate(pairs):
            if r.shape[0]:
                record(expert, r, h)
        out: torch.Tensor = plain(x, topk_weights, topk_ids)
        return out

    # The one-call route (``routed``) would bypass ``forward``: kept off meanwhile.
    module.__dict__["forward"] = forward
    module.__dict__["routed"] = lambda *args: None

    def undo() -> None:
        del module.__dict__["forward"]
        del module.__dict__["routed"]

    return undo
