"""The models' kernels resolve through the process-global kernel registry."""

from __future__ import annotations

import importlib.util
import logging
import threading
from pathlib import Path

import pytest
import torch

from tandem.core.kernels import handles
from tandem.core.kernels.process_once import ProcessOnce
from tandem.core.kernels.reference import elementwise as reference
from tandem.core.kernels.reference.paged_attention import reference_decode, reference_prefill
from tandem.core.kernels.triton import loading
from tandem.core.layers.norm import RMSNorm
from tandem.core.models.decoder import DecoderForCausalLM
from tandem.device import Device, KernelKey, process_kernel_registry


def test_the_models_kernels_go_through_the_process_registry() -> None:
    registry = process_kernel_registry()
    before = len(registry)
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8, dtype=torch.float64)
    out = norm(x)
    assert out.shape == x.shape
    assert registry.lookup(KernelKey("rms_norm", Device("cpu", 0), "torch.float64")) is not None
    assert len(registry) >= before


def test_a_worker_uses_the_registry_it_is_given_even_when_empty(demo_dir: Path) -> None:
    """An empty registry has length 0; it must still be the one the worker's kernels use."""
    from tandem.collectives import SingleRankGroup
    from tandem.core.config import CacheConfig, EngineConfig, ModelLoadConfig
    from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
    from tandem.core.llm.model_runner import LLMRunnerFactory, ModelRunner
    from tandem.core.models.config_json import load_model_config
    from tandem.core.worker.worker import Worker
    from tandem.device import KernelRegistry

    own: KernelRegistry[object] = KernelRegistry()
    config = EngineConfig(
        model=ModelLoadConfig(model=str(demo_dir)), cache=CacheConfig(num_blocks=8)
    )
    model_config = load_model_config(demo_dir)
    worker: Worker[ForwardInput, SamplerOutput] = Worker(
        Device("cpu", 0), SingleRankGroup(), config, LLMRunnerFactory(model_config),
        kernel_registry=own,
    )  # fmt: skip

    def on_a_worker_thread() -> None:
        # A thread of its own: binding is per thread and must not leak into other tests.
        worker.init_device()
        worker.load_model()
        runner = worker.runner
        assert isinstance(runner, ModelRunner)
        assert isinstance(runner.model, DecoderForCausalLM)
        runner.model.norm(torch.randn(2, model_config.hidden_size))

    thread = threading.Thread(target=on_a_worker_thread)
    thread.start()
    thread.join(60)
    assert own.lookup(KernelKey("rms_norm", Device("cpu", 0), "torch.float32")) is not None


def test_accelerators_get_the_triton_kernels_where_triton_imports() -> None:
    """Run in both environments: the suite's, without Triton (the references), and
    ``tox -e triton``'s (the Triton kernels, for CUDA and NPU alike; never for CPU)."""
    norm, decode = handles.rms_norm(), handles.paged_attention_decode(64)
    prefill = handles.paged_attention_prefill(128)
    has_triton = importlib.util.find_spec("triton") is not None
    # As CudaRuntime and NpuRuntime list them (torch_npu does not import here).
    for families in (("triton",), ("torch_npu", "triton")):
        chosen = (
            norm.choose(families, torch.bfloat16),
            decode.choose(families, torch.float16),
            prefill.choose(families, torch.float32),
        )
        if has_triton:
            from tandem.core.kernels.triton import norms, paged_attention, paged_prefill

            triton = (norms.rms_norm, paged_attention.paged_decode, paged_prefill.paged_prefill)
            assert chosen == triton
        else:
            assert chosen == (reference.rms_norm, reference_decode, reference_prefill)
        assert norm.choose(families, torch.float64) is reference.rms_norm


def test_triton_can_be_turned_off_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TANDEM_TRITON", "0")
    with caplog.at_level(logging.INFO, logger=loading.__name__):
        assert loading._usable() is False
    assert "TANDEM_TRITON=0" in caplog.text


def test_without_triton_the_accelerators_are_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def missing(name: str) -> None:
        raise ImportError(name)

    usable = ProcessOnce(lambda: loading._usable(missing))
    with caplog.at_level(logging.WARNING, logger=loading.__name__):
        assert [usable(), usable()] == [False, False]
    assert caplog.text.count("Triton is not installed") == 1
