"""A new device and its collectives as plugins, the worked example of ``docs/extending.md``:
a test-only distribution (written here, found through its ``entry_points.txt`` like any
installed package) declares a ``toy`` device runtime and a ``toybus`` collective backend, and
``tandem generate --devices toy:0,toy:1 --single-process`` serves on them with nothing in
Tandem naming either: the device kind is known, ``--local-collectives`` offers the backend,
"auto" picks it for toy devices, and greedy tokens equal the CPU path's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import write_plugin_distribution

from tandem.core.demo.demo_model import tiny_spec, write_demo_model

PLUGIN = '''"""A toy device: host memory, the CPU kernels, its own collective backend."""

from tandem.collectives.backends import LocalGroups
from tandem.collectives.inprocess import create_inprocess_groups
from tandem.device import Device
from tandem.device.cpu import CpuRuntime


class ToyRuntime(CpuRuntime):
    kind = "toy"

    def bind(self, device):
        if device.kind != "toy":
            raise ValueError(f"the toy runtime cannot bind {device}")
        super().bind(Device("cpu", device.index))
        self._local.device = device

    def torch_device(self, device):
        return Device("cpu", device.index).torch_device()


class Communicators:
    """What the executor holds: abort releases blocked ranks, close frees the set."""

    def __init__(self, communicator):
        self._communicator = communicator

    def abort(self, reason):
        self._communicator.abort(reason)

    def close(self):
        print("toybus: closed", flush=True)


class ToyBus:
    name = "toybus"
    device_kind = "toy"
    torch_dist_backend = "gloo"
    opened = 0

    def check(self, device_kind):
        if device_kind != "toy":
            raise ValueError(f"toybus serves toy devices, not {device_kind}")

    def local_groups(self, devices, runtime, timeout_s):
        groups = create_inprocess_groups(len(devices), timeout_s=timeout_s)
        print(f"toybus: {len(devices)} ranks", flush=True)
        return LocalGroups(list(groups), Communicators(groups[0].communicator))

    def process_group(self, device, runtime, rank, size, timeout_s):
        raise NotImplementedError("toybus is single-process")
'''

ENTRY_POINTS = """[tandem.device_runtimes]
toy = toy_device:ToyRuntime

[tandem.collective_backends]
toybus = toy_device:ToyBus
"""

PROMPTS = ["5,17,300,42", "11,3,250,8,61"]


def _generate(model: Path, env: dict[str, str], *extra: str) -> tuple[list[list[int]], str]:
    cmd = [sys.executable, "-m", "tandem.server.cli.main", "generate", "--model", str(model),
           "--num-blocks", "64", "--max-tokens", "6", "--ignore-eos", "--json", *extra]  # fmt: skip
    for prompt in PROMPTS:
        cmd += ["--prompt-token-ids", prompt]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return [json.loads(line)["token_ids"] for line in lines], done.stdout + done.stderr


def test_a_device_and_its_backend_plug_in_through_entry_points(tmp_path: Path) -> None:
    site = write_plugin_distribution(tmp_path, "toy_device", PLUGIN, ENTRY_POINTS)
    model = write_demo_model(tmp_path / "model", tiny_spec())
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cpu, _ = _generate(model, env)
    toy, log = _generate(model, env, "--devices", "toy:0,toy:1", "--single-process")
    assert toy == cpu
    assert "toybus: 2 ranks" in log and "toybus: closed" in log
    help_text = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "generate", "--help"],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    ).stdout  # fmt: skip
    assert "toybus" in help_text


def test_an_unknown_device_kind_names_what_is_installed(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "model", tiny_spec())
    done = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "generate", "--model", str(model),
         "--devices", "toy:0", "--prompt", "hi"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "unknown device kind 'toy'" in done.stderr and "cpu" in done.stderr
