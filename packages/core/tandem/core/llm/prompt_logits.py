"""The logits at every position of a prompt, through an idle engine's real input path: for
measurements that need the whole next-token distribution at each position (a quantized
model's KL divergence from the float one, agreement between dtypes, tests against a reference
model), which the API's top-k logprobs do not give."""

from __future__ import annotations

import torch

from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.kv.block_manager import BlockManager
from tandem.core.llm.engine import LLMEngine
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.llm.input_builder import build_forward_input
from tandem.core.llm.model_runner import ModelRunner
from tandem.core.llm.sampling_params import SamplingParams
from tandem.core.llm.scheduler import ScheduledSequence, SchedulerOutput
from tandem.core.worker.worker import Worker


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] logits, from one prefill step of a sequence with KV blocks and
    state slot 1 of its own. It bypasses the engine's pools and scheduler, so the engine must
    be idle (no request in flight) and run in this process (a thread executor)."""
    seq = engine.inputs.prepare("probe", prompt, SamplingParams(max_tokens=1))
    block_size = engine.config.cache.block_size
    blocks = -(-len(prompt) // block_size)
    manager = BlockManager(num_blocks=blocks, block_size=block_size, enable_prefix_cache=False)
    manager.allocate(seq, len(prompt), cached=[])
    seq.state_slot = 1
    out = SchedulerOutput(scheduled=[ScheduledSequence(seq, len(prompt), samples=True)])
    fi = build_forward_input(out, block_size=block_size)
    executor = engine.executor
    if not isinstance(executor, ThreadExecutor):
        raise TypeError("prompt_logits needs an engine whose workers run in this process")

    def run(worker: Worker[ForwardInput, SamplerOutput]) -> torch.Tensor:
        runner = worker.runner
        assert isinstance(runner, ModelRunner)
        return runner.prompt_logits(fi)

    return executor.call(0, run)
