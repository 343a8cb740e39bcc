"""The KV cache a recommender reserves: no more than the requests it can run at once can occupy
(each one history of at most max_history items, whatever its beam width), however much
memory the budget would give, unless --num-blocks says."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandem.core import CacheConfig, EngineConfig, ModelLoadConfig
from tandem.core.config import PipelineConfig, RecConfig, SchedulerConfig
from tandem.core.demo.rec_demo_model import tiny_rec_spec, write_rec_demo_model
from tandem.core.rec.service import RecService

# tiny_rec_spec: histories of up to 32 items; in blocks of 4, 8 blocks each.
PER_REQUEST = 8


@pytest.fixture(scope="module")
def rec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rec_demo_model(tmp_path_factory.mktemp("rec"), tiny_rec_spec())


def _num_blocks(
    folder: Path, num_blocks: int | None = None, max_num_seqs: int = 64, beam_width: int = 0
) -> int:
    service = RecService(
        EngineConfig(
            model=ModelLoadConfig(model=str(folder)),
            cache=CacheConfig(num_blocks=num_blocks, block_size=4),
            scheduler=SchedulerConfig(max_seqs_per_batch=max_num_seqs),
            pipeline=PipelineConfig(max_concurrency=2),
            rec=RecConfig(max_batch_size=3, beam_width=beam_width),
        )
    )
    try:
        # Every request the scheduler lets run at once still gets its blocks: the longest
        # histories, more of them than can run.
        longest = [[1, 2, 3]] * service.model_config.max_history
        promises = service.submit_many([(longest, 2)] * 9)
        assert all(len(p.result(timeout=60).candidates) == 2 for p in promises)
        assert service.blocks.num_free_blocks == service.blocks.num_blocks
        return service.blocks.num_blocks
    finally:
        service.shutdown()


def test_the_cache_holds_what_the_requests_in_flight_can_use(
    rec_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Two lanes of batches of 3: 6 requests at once, 48 blocks. The 4 GiB budget would give
    # the tiny model hundreds of thousands.
    with caplog.at_level(logging.INFO, logger="tandem.core.kv.kv_cache"):
        assert _num_blocks(rec_dir) == 6 * PER_REQUEST
    line = next(r.getMessage() for r in caplog.records if "KV cache on" in r.getMessage())
    assert "48 blocks" in line and "6 requests" in line, line
    assert "--max-concurrency 2 batches of --rec-max-batch-size 3" in line, line
    assert "32 history items (the model's max_history)" in line, line
    assert "the memory budget would allow" in line, line
    # --max-num-seqs below the lanes' batches bounds the requests in flight, and the cache.
    assert _num_blocks(rec_dir, max_num_seqs=4) == 4 * PER_REQUEST
    # A request's beams share its history's blocks: wider beams take no more.
    assert _num_blocks(rec_dir, beam_width=32) == 6 * PER_REQUEST


def test_an_explicit_block_count_is_kept(rec_dir: Path) -> None:
    assert _num_blocks(rec_dir, num_blocks=500) == 500
