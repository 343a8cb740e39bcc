"""On real accelerators (``tox -e hw``): these skip, with the reason, where the devices are not
present. The same tests serve Ascend NPUs (hw_npu) and CUDA GPUs (hw_cuda)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from harness import generate_token_ids
from reference_models import write_reference_model
from tandem_hw.accelerator_runtime import AcceleratorRuntime

from tandem.core.kernels.handle import KernelHandle
from tandem.core.kernels.handles import gated_activation
from tandem.core.kernels.reference.elementwise import rms_norm, rotary
from tandem.device import BoundContext, Device, KernelRegistry, bind_context, get_runtime

NEW_TOKENS = 32
# Failures xLLM pull request #1894's review saw on cold starts: duplicate kernel registration,
# null kernel stubs.
REGISTRATION_ERRORS = ("507028", "Kernel stub is null", "registration failed")


@pytest.fixture(scope="module", params=["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense Qwen3, and the family of the model that crashed in xLLM pull request #1894's
    review: a Qwen3.5 hybrid whose first request registers the linear-attention kernels lazily
    on every device."""
    architecture: str = request.param
    folder = tmp_path_factory.mktemp("device-model") / architecture
    write_reference_model(folder, architecture, head_dim=32)
    return folder


def test_tp2_single_process_and_multi_process_are_byte_identical(
    accelerator: str, model: Path
) -> None:
    single = generate_token_ids(model, "tp2-single-process", NEW_TOKENS, kind=accelerator)
    multi = generate_token_ids(model, "tp2-multi-process", NEW_TOKENS, kind=accelerator)
    assert single.token_ids == multi.token_ids


def test_first_use_kernel_registration_happens_once_per_device(accelerator: str) -> None:
    """Two threads per device on two devices, released together into their first forward
    kernels: each (kernel, device, dtype) is registered exactly once, and every thread gets
    the right answer (the regression test xLLM pull request #1894's review asked for)."""
    runtime = get_runtime(accelerator)
    assert isinstance(runtime, AcceleratorRuntime)
    registry: KernelRegistry[object] = KernelRegistry()
    devices = [Device(accelerator, 0), Device(accelerator, 1)]
    threads_per_device = 2
    barrier = threading.Barrier(len(devices) * threads_per_device)
    x = torch.randn(4, 8, 64)
    weight = torch.rand(64)
    errors: list[BaseException] = []

    def body(device: Device) -> None:
        try:
            runtime.bind(device)
            bind_context(BoundContext(runtime, registry))
            target = runtime.torch_device(device)
            xd, wd = x.to(target), weight.to(target)
            cos = torch.ones(4, 8, 32, device=target)
            sin = torch.zeros(4, 8, 32, device=target)
            handles = [KernelHandle("rms_norm", rms_norm), gated_activation("silu"),
                     KernelHandle("rotary", rotary)]  # fmt: skip
            barrier.wait(timeout=60)
            normed = handles[0](xd, wd, 1e-6)
            handles[1](torch.cat([xd, xd], -1))
            handles[2](xd, cos, sin)
            runtime.synchronize()
            torch.testing.assert_close(normed.cpu(), rms_norm(x, weight, 1e-6))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=body, args=(d,)) for d in devices for _ in range(threads_per_device)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert registry.registrations == 3 * len(devices)
    loads = {key: n for key, n in runtime.kernel_loads.items() if key[1] in devices}
    assert loads and all(n == 1 for n in loads.values()), loads


def test_three_cold_starts_have_no_registration_errors(accelerator: str, model: Path) -> None:
    command = [sys.executable, "-m", "tandem.server.cli.main", "generate", "--model", str(model),
               "--devices", f"{accelerator}:0,{accelerator}:1", "--single-process",
               "--prompt", "cold start", "--max-tokens", "8", "--ignore-eos"]  # fmt: skip
    for start in range(3):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"cold start {start}: {done.stderr[-3000:]}"
        found = [word for word in REGISTRATION_ERRORS if word in done.stderr]
        assert not found, f"cold start {start} logged {found}: {done.stderr[-3000:]}"


def test_pipeline_lanes_match_one_step_at_a_time(accelerator: str, model: Path) -> None:
    """Two pipeline lanes per device (their own streams and communicator sets) give the
    tokens of one step at a time."""
    one = generate_token_ids(model, "tp2-single-process", NEW_TOKENS, kind=accelerator)
    two = generate_token_ids(
        model, "tp2-single-process", NEW_TOKENS, ("--max-concurrency", "2"), kind=accelerator
    )
    assert two.token_ids == one.token_ids
