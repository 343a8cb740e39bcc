"""A node other than node 0: it loads its shards and runs the steps node 0 sends, with no
engine, scheduler or server of its own."""

from __future__ import annotations

import logging

from tandem.core.config import EngineConfig
from tandem.core.executor.executor import create_executor
from tandem.core.worker.step_runner import OutT, RunnerFactory, StepT

logger = logging.getLogger(__name__)


def run_follower(config: EngineConfig, runner_factory: RunnerFactory[StepT, OutT]) -> None:
    executor = create_executor(config, runner_factory)
    logger.info(
        "node %d of %d is following node 0", config.parallel.node_rank, config.parallel.nnodes
    )
    try:
        executor.follow()
    finally:
        executor.shutdown()
