"""Everything that serves a recommender, built from the engine config: executor (workers with
pipeline lanes), block pool, fixed-steps scheduler and engine loop. Combinations that cannot
work stop here, before anything is loaded."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tandem.core.config import EngineConfig
from tandem.core.errors import ConfigError
from tandem.core.executor.executor import create_lane_executor
from tandem.core.kv.block_manager import BlockManager
from tandem.core.models.rec_config import RecModelConfig, load_rec_config
from tandem.core.rec.engine import RecEngine
from tandem.core.rec.fixed_steps_scheduler import FixedStepsScheduler, rec_capacity
from tandem.core.rec.request import RecResult, make_rec_request
from tandem.core.rec.runner import RecRunnerFactory
from tandem.core.worker.step_runner import MemoryFootprint
from tandem.device.sync import Promise

logger = logging.getLogger(__name__)


def check_rec_config(config: EngineConfig, model: RecModelConfig) -> None:
    rounds = config.rec.max_decode_rounds
    if rounds is not None and rounds != model.max_decode_rounds:
        raise ConfigError(
            f"--max-decode-rounds {rounds} does not fit the model: {model.num_codebooks} "
            f"codebook levels are one prefill and {model.max_decode_rounds} decode rounds; "
            "leave the flag out to take the model's"
        )
    if config.speculative is not None:
        raise ConfigError(
            "--speculative-config does not apply to a recommender (its beam search decodes "
            "a fixed number of rounds); serve it without the flag"
        )
    if config.cache.enable_prefix_cache and config.cache.num_blocks is None:
        # Not an error: nothing to share between histories; say so once.
        logger.info("prefix caching does not apply to a recommender; ignoring it")


@dataclass(frozen=True)
class RecStats:
    num_waiting: int
    num_batches_in_flight: int
    # Fraction of KV blocks reserved by batches (1 = full).
    kv_cache_usage: float
    # What rank 0's weights and KV cache take.
    memory: MemoryFootprint


class RecService:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = load_rec_config(Path(config.model.model))
        check_rec_config(config, self.model_config)
        self.beam_width = config.rec.beam_width or self.model_config.beam_width
        self.executor = create_lane_executor(config, RecRunnerFactory(self.model_config))
        try:
            self.blocks = BlockManager(
                self.executor.num_blocks, config.cache.block_size, enable_prefix_cache=False
            )
            self.scheduler = FixedStepsScheduler(
                self.blocks,
                max_batch_size=config.rec.max_batch_size,
                max_concurrency=config.pipeline.max_concurrency,
                max_decode_rounds=self.model_config.max_decode_rounds,
                capacity=rec_capacity(config),
            )
            self.engine = RecEngine(
                self.executor,
                self.scheduler,
                step_timeout_s=config.parallel.timeout_s,
                health_timeout_s=config.parallel.health_timeout_s,
                kv_exhaust_step=config.faults.kv_exhaust_step(),
            )
        except BaseException:
            self.executor.shutdown()
            raise
        logger.info(
            "recommender ready: %d blocks of %d items, %d pipeline lanes, batches of %d, "
            "%d requests at once (%s), %d beams",
            self.executor.num_blocks,
            config.cache.block_size,
            config.pipeline.max_concurrency,
            config.rec.max_batch_size,
            self.scheduler.capacity.running,
            self.scheduler.capacity.running_why,
            self.beam_width,
        )

    def submit(
        self, history: list[list[int]], num_candidates: int, request_id: str | None = None
    ) -> Promise[RecResult]:
        """Raises InvalidRequestError (HTTP 400) for a request that can never be served,
        EngineOverloadedError (503) while as many as can run and may wait are in already."""
        request = make_rec_request(
            history, num_candidates, self.model_config, self.beam_width, request_id
        )
        return self.engine.submit(request)[0]

    def submit_many(self, requests: list[tuple[list[list[int]], int]]) -> list[Promise[RecResult]]:
        """(history, num_candidates) pairs queued together: they are batched in order, by
        ``--rec-max-batch-size``, however many lanes there are (so the results do not depend
        on the pipeline width); admitted or refused together, as ``submit``."""
        made = [make_rec_request(h, k, self.model_config, self.beam_width) for h, k in requests]
        return self.engine.submit(*made)

    def stats(self) -> RecStats:
        """A snapshot of the service's state, for the server's metrics."""
        return RecStats(
            num_waiting=self.scheduler.num_waiting,
            num_batches_in_flight=self.scheduler.num_in_flight,
            kv_cache_usage=self.blocks.usage,
            memory=self.executor.memory,
        )

    @property
    def dead(self) -> str | None:
        """Why the service can no longer serve, once a step or the loop failed."""
        return self.engine.dead

    def refuse_new(self, reason: str) -> None:
        """Shutting down: refuse new requests, fail the waiting ones (in-flight batches end)."""
        self.engine.refuse_new(reason)

    def check_health(self) -> None:
        self.engine.check_health()
        self.executor.check_health()

    def shutdown(self) -> None:
        self.engine.stop()
        self.executor.shutdown()
