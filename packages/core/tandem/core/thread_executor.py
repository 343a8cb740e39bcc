"""Workers as threads of the engine's process: the ForwardInput object itself goes to each
worker, and rank 0's output comes back as Python objects, with no serialization."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from tandem.collectives import SingleRankGroup
from tandem.core.config import EngineConfig
from tandem.core.errors import ConfigError, EngineDeadError
from tandem.core.forward_input import ForwardInput, SamplerOutput
from tandem.core.models.model_config import ModelConfig
from tandem.core.worker import Worker
from tandem.core.worker_thread import WorkerThread
from tandem.device import parse_devices

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ThreadExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        try:
            devices = parse_devices(config.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if len(devices) != 1:
            raise ConfigError(
                f"--device names {len(devices)} devices; this build serves one device per "
                "engine (tensor parallelism is not available yet)"
            )
        device = devices[0]
        self._worker = Worker(device, SingleRankGroup(), config, model_config)
        self._thread = WorkerThread(name=f"tandem-worker-{device}")
        self._closed = False
        try:
            self._call(self._worker.init_device)
            self._call(self._worker.load_model)
            self._num_blocks = self._call(self._worker.determine_num_blocks)
            self._call(lambda: self._worker.init_kv_cache(self._num_blocks))
        except BaseException:
            self.shutdown()
            raise

    def _call(self, fn: Callable[[], T]) -> T:
        return self._thread.wait(self._thread.submit(fn))

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def execute_model(self, fi: ForwardInput) -> SamplerOutput:
        out = self._thread.wait(self._thread.submit(lambda: self._worker.execute_model(fi)))
        if out is None:
            raise RuntimeError("rank 0 returned no sampler output")
        return out

    def check_health(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise EngineDeadError("the worker thread is not running")

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._thread.stop()
