"""Which topologies can have pipeline lanes (several steps in flight per worker).

Its own module because the factory asks before anything loads and the thread executor asks
again when built directly (tests, the simulator); the factory imports that executor."""

from __future__ import annotations

from tandem.core.config import EngineConfig
from tandem.core.errors import ConfigError
from tandem.core.parallel.topology import Mode, Topology


def check_lanes_fit(config: EngineConfig, topology: Topology) -> None:
    """ConfigError unless ``topology`` can have pipeline lanes."""
    if config.pipeline.serialize_forward and topology.world_size > 1:
        # Each rank's lock would be taken by its lanes in whatever order they arrive: rank 0
        # running lane A's forward waits in a collective for rank 1, whose lock lane B holds
        # while it waits for rank 0's lane B. A deadlock, not a measurement.
        raise ConfigError(
            "--serialize-forward serializes one worker's lanes and cannot be used with "
            "tensor parallelism (ranks would take the lock in different lane orders and "
            "deadlock); drop it, or measure with one device"
        )
    if topology.mode is not Mode.SINGLE_PROCESS:
        raise ConfigError(
            "pipeline lanes (--max-concurrency > 1, or serving a recommender) run in "
            "single-process mode: TANDEM_ENABLE_SINGLE_PROCESS=1 instead of "
            "--master-node-addr"
        )
    if topology.nnodes > 1:
        raise ConfigError(
            "pipeline lanes (--max-concurrency > 1, or a recommender) serve one node; "
            "drop --nnodes or use --max-concurrency 1 with an LLM"
        )
