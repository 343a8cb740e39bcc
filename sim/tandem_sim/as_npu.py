"""Run Tandem's own command line on CPU as if on Ascend NPUs: ``python -m tandem_sim.as_npu
generate --devices npu:0,npu:1 ...`` (or ``serve``).

Everything of the engine is the real one (one process, a worker thread per device, the
executor, the kernel registry, the HCCL backend) except what only a card has, which stands in:

- the device runtime is the simulator's fake NPU (``fake_runtime.py``) on real threads: kernels
  registered once per (kernel, device), in-order streams, tensors in host memory;
- ``torch_npu`` is the stand-in of its fused ops (``torch_npu_standin/``, each op's rules
  transcribed from torch_npu's documentation), so the registry resolves the ``torch_npu``
  family as on a card;
- the Triton kernels run under Triton's interpreter (the tensors are host memory);
- libhccl is the C stand-in (``standin/collectives.c``, built here with the system compiler
  unless ``HCCL_SO_PATH`` names a library).

It refuses to run where a real torch_npu is installed: there, run ``tandem`` itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path

from tandem.device import Device, MemoryInfo, get_runtime, register_runtime
from tandem.device.sync import REAL_SYNC
from tandem_sim.fake_runtime import DEVICE_COUNT, FakeNpuRuntime
from tandem_sim.standin_library import StandinUnavailable, build_standin_library

logger = logging.getLogger(__name__)

STANDIN_MODULE = "tandem_sim.torch_npu_standin"
# Both families an NpuRuntime lists, in its order.
KERNEL_FAMILIES = ("torch_npu", "triton")


class RealTorchNpu(RuntimeError):
    pass


def host_share() -> MemoryInfo:
    """Each fake device's memory: an equal share of the host's, where its tensors live."""
    host = get_runtime("cpu").memory_info(Device("cpu", 0))
    return MemoryInfo(
        total_bytes=host.total_bytes // DEVICE_COUNT, free_bytes=host.free_bytes // DEVICE_COUNT
    )


def install(build_dir: Path | None = None) -> None:
    """Make this process's npu devices the stand-ins; call before the engine starts."""
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is not None:
        raise RealTorchNpu(
            "a real torch_npu is installed here: serve on the NPUs with tandem itself; "
            "tandem_sim.as_npu stands in for them on machines without"
        )
    sys.modules["torch_npu"] = importlib.import_module(STANDIN_MODULE)
    if "HCCL_SO_PATH" not in os.environ:
        folder = build_dir or Path(tempfile.gettempdir()) / "tandem-standin"
        os.environ["HCCL_SO_PATH"] = str(build_standin_library(folder))
    memory = host_share()
    register_runtime(
        "npu",
        lambda: FakeNpuRuntime(REAL_SYNC, kernel_families=KERNEL_FAMILIES, memory=memory),
    )
    logger.info(
        "npu devices stand in on CPU: fake runtime, torch_npu stand-in, Triton interpreted, "
        "HCCL stand-in %s",
        os.environ["HCCL_SO_PATH"],
    )


def main(argv: list[str] | None = None) -> int:
    try:
        install()
    except (RealTorchNpu, StandinUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from tandem.server.cli.main import main as tandem_main

    return tandem_main(argv)


if __name__ == "__main__":
    sys.exit(main())
