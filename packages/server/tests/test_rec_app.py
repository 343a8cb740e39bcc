"""The recommender's HTTP API under load, in-process (the real app over a real service): a
burst is admitted up to the places that can run plus those that may wait, and the rest is
told to come back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tandem.core import CacheConfig, EngineConfig, ModelLoadConfig
from tandem.core.config import RecConfig, SchedulerConfig
from tandem.core.demo.rec_demo_model import tiny_rec_spec, write_rec_demo_model
from tandem.core.faults import Fault, FaultConfig
from tandem.core.rec.service import RecService
from tandem.server.rec_app import RecMetrics, RecServerState, create_rec_app

from .burst import check_burst


@pytest.fixture(scope="module")
def rec_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rec_demo_model(tmp_path_factory.mktemp("rec"), tiny_rec_spec())


def test_a_burst_at_an_idle_recommender_fills_the_running_and_the_waiting_places(
    rec_model: Path,
) -> None:
    """--max-num-seqs 2 --max-waiting-requests 4: six of a burst of 30 are admitted (two to
    run, four to wait), not four (a bound on the waiting alone, while none runs yet). The
    first step is held for a while so that nothing finishes and frees a place before the
    whole burst has arrived."""
    hold = FaultConfig((Fault("forward_delay", rank=0, step=0, seconds=5.0),))
    service = RecService(
        EngineConfig(
            model=ModelLoadConfig(model=str(rec_model)),
            cache=CacheConfig(num_blocks=64, block_size=4),
            scheduler=SchedulerConfig(max_seqs_per_batch=2, max_waiting_requests=4),
            rec=RecConfig(max_batch_size=16),
            faults=hold,
        )
    )
    state = RecServerState(service=service, served_model_name="r", metrics=RecMetrics(service, "r"))
    app = create_rec_app(state)
    body = {"model": "r", "history": [[1, 2, 3]] * 5, "num_candidates": 3}

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=60) as c:
            answers = await check_burst(c, "/v1/recommendations", body, 6, "--max-num-seqs 2")
        assert all(len(r.json()["candidates"]) == 3 for r in answers if r.status_code == 200)

    try:
        asyncio.run(scenario())
        assert service.blocks.num_free_blocks == service.blocks.num_blocks
    finally:
        service.shutdown()
