"""The calibration statistics GPTQ needs: for each decoder projection, the sum of x x^T over
the calibration tokens of its input activations x (GPTQ's Hessian up to a factor of 2), from
the float model run by Tandem itself in float32 on the calibration samples.

The fused layers that share an input share the statistics: q, k and v (``qkv_proj``), and
gate and up (``gate_up_proj``). Every layer's activations come from the float model (GPTQ
with ``true_sequential`` re-runs each layer on its quantized predecessors' outputs instead;
here the writer records ``true_sequential: false``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.core import CacheConfig, EngineConfig, LLMEngine, ModelLoadConfig
from tandem.core.executor.thread_executor import ThreadExecutor
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
}
_MODULE = re.compile(r"^layers\.(\d+)\.(" + "|".join(re.escape(m) for m in _PARTS) + r")$")


def calibration_samples(model: Path, text: str, count: int, length: int) -> list[list[int]]:
    """Up to ``count`` samples of ``length`` tokens each, cut from ``text`` in order (the
    last one may be shorter)."""
    tokens = Tokenizer(model).encode(text)
    samples = [tokens[i : i + length] for i in range(0, len(tokens), length)][:count]
    samples = [s for s in samples if len(s) > 1]
    if not samples:
        raise ValueError("the calibration text gives no tokens")
    return samples


def collect_hessians(model: Path, samples: list[list[int]]) -> dict[str, torch.Tensor]:
    """Sum of x x^T (float64 [K, K]) of each projection's inputs over every sample's tokens,
    keyed by the projection's checkpoint name without ``.weight``
    (``model.layers.3.self_attn.q_proj``)."""
    longest = max(map(len, samples))
    engine = LLMEngine(
        EngineConfig(
            model=ModelLoadConfig(model=str(model), dtype="float32"),
            cache=CacheConfig(num_blocks=-(-longest // 16) + 4),
        )
    )
    sums: dict[str, torch.Tensor] = {}

    def accumulate(name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        product = x.t() @ x
        sums[name] = sums[name] + product if name in sums else product

    def install(worker: Worker[ForwardInput, SamplerOutput]) -> list[Any]:
        runner = worker.runner
        assert isinstance(runner, ModelRunner)
        hooks = []
        for name, module in runner.model.named_modules():
            if _MODULE.match(name):
                hook = module.register_forward_pre_hook(
                    lambda m, a, name=name: accumulate(name, m, a)
                )
                hooks.append(hook)
        return hooks

    executor = engine.executor
    if not isinstance(executor, ThreadExecutor):
        raise TypeError("calibration runs the model in this process (a thread executor)")
    try:
        hooks = executor.call(0, install)
        for number, sample in enumerate(samples, 1):
            prompt_logits(engine, sample)
            if number % 16 == 0 or number == len(samples):
                logger.info("calibration: %d of %d samples", number, len(samples))
        for hook in hooks:
            hook.remove()
    finally:
        engine.shutdown()
    out: dict[str, torch.Tensor] = {}
    for name, total in sums.items():
        match = _MODULE.match(name)
        assert match is not None
        for part in _PARTS[match.group(2)]:
            out[f"model.layers.{match.group(1)}.{part}"] = total
    return out
