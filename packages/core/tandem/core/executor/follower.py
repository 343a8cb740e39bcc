"""A node other than node 0: it loads its shards and runs the steps node 0 sends, with no
engine, scheduler or server of its own."""

from __future__ import annotations

import logging
from pathlib import Path

from tandem.core.config import EngineConfig
from tandem.core.executor.executor import create_executor
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.registry import model_class

logger = logging.getLogger(__name__)


def run_follower(config: EngineConfig) -> None:
    model_config = ModelConfig.from_folder(Path(config.model.model))
    model_class(model_config.architecture)
    executor = create_executor(config, model_config)
    logger.info(
        "node %d of %d is following node 0", config.parallel.node_rank, config.parallel.nnodes
    )
    try:
        executor.follow()
    finally:
        executor.shutdown()
