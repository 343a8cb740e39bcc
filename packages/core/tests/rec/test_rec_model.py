"""The generative recommender: constrained beam search against exhaustive scoring, identical
candidates across pipeline widths and tensor parallelism, and what is refused at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.collectives import SingleRankGroup
from tandem.core import CacheConfig, EngineConfig, ModelLoadConfig
from tandem.core.config import ParallelConfig, PipelineConfig, RecConfig
from tandem.core.demo.rec_demo_model import RecDemoSpec, tiny_rec_spec, write_rec_demo_model
from tandem.core.errors import ConfigError, InvalidRequestError
from tandem.core.models.rec_config import is_rec_folder, load_rec_config
from tandem.core.models.rec_loader import load_rec_model
from tandem.core.rec.catalog import load_catalog
from tandem.core.rec.request import RecResult
from tandem.core.rec.service import RecService


@pytest.fixture(scope="module")
def rec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rec_demo_model(tmp_path_factory.mktemp("rec"), tiny_rec_spec())


def _histories(folder: Path, count: int) -> list[list[list[int]]]:
    catalog = load_catalog(folder, load_rec_config(folder).codebook_size).items
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(count):
        picks = torch.randint(0, catalog.shape[0], (1 + (5 * i) % 23,), generator=gen)
        out.append(catalog[picks].tolist())
    return out


def _config(folder: Path, width: int = 1, devices: str = "cpu:0", **rec: int) -> EngineConfig:
    return EngineConfig(
        model=ModelLoadConfig(model=str(folder)),
        cache=CacheConfig(num_blocks=64, block_size=4),
        pipeline=PipelineConfig(max_concurrency=width),
        parallel=ParallelConfig(devices=devices, single_process=devices.count(",") > 0),
        rec=RecConfig(max_batch_size=3, **rec),
    )


def _serve(config: EngineConfig, histories: list[list[list[int]]]) -> list[RecResult]:
    service = RecService(config)
    try:
        # Queued together, so every width forms the same batches (and shapes).
        promises = service.submit_many([(h, 1 + i % 5) for i, h in enumerate(histories)])
        results = [p.result(timeout=60) for p in promises]
        assert service.blocks.num_free_blocks == service.blocks.num_blocks
        return results
    finally:
        service.shutdown()


def test_demo_folder_is_a_recommender_and_written_byte_identically(tmp_path: Path) -> None:
    a = write_rec_demo_model(tmp_path / "a", tiny_rec_spec())
    b = write_rec_demo_model(tmp_path / "b", tiny_rec_spec())
    assert is_rec_folder(a)
    for name in ("config.json", "model.safetensors", "catalog.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_beam_search_as_wide_as_the_catalog_is_exhaustive_search(tmp_path: Path) -> None:
    """With a beam per item, the constrained beam search must return exactly the top items
    by summed log-probability over every item of the catalog."""
    spec = RecDemoSpec(
        num_codebooks=3, codebook_size=4, hidden_size=16, num_heads=2, head_dim=8,
        intermediate_size=32, num_encoder_layers=1, num_decoder_layers=1, max_history=8,
        num_items=40, beam_width=64,
    )  # fmt: skip
    folder = write_rec_demo_model(tmp_path / "small", spec)
    history = _histories(folder, 2)[1]  # 6 items
    config = _config(folder)
    result = _serve(config, [history])  # num_candidates = 1 for the first request
    service_result = result[0]
    # Exhaustive: score every catalog item with the model directly.
    mc = load_rec_config(folder)
    model = load_rec_model(folder, mc, SingleRankGroup(), torch.float32, torch.device("cpu"))
    items = load_catalog(folder, mc.codebook_size).items
    with torch.inference_mode():
        h = torch.tensor([history])
        mask = torch.ones(1, len(history), dtype=torch.bool)
        cross = model.cross_key_values(model.encode(h, mask))
        scores = torch.zeros(items.shape[0])
        for level in range(mc.num_codebooks):
            codes = items[:, :level].unsqueeze(0)  # every item's prefix as one beam
            logp = torch.log_softmax(model.decode(codes, cross, mask).float(), -1)[0]
            scores += logp[torch.arange(items.shape[0]), items[:, level]]
    best = int(scores.argmax())
    assert service_result.candidates == [tuple(items[best].tolist())]
    assert service_result.scores[0] == pytest.approx(float(scores[best]), abs=1e-4)
    # And the full ranking with more candidates.
    service = RecService(config)
    try:
        ranked = service.submit(history, num_candidates=10).result(timeout=60)
    finally:
        service.shutdown()
    order = scores.argsort(descending=True)[:10]
    assert ranked.candidates == [tuple(items[i].tolist()) for i in order.tolist()]
    assert ranked.scores == pytest.approx([float(scores[i]) for i in order], abs=1e-4)


def test_candidates_are_catalog_items_ranked_by_score(rec_dir: Path) -> None:
    results = _serve(_config(rec_dir), _histories(rec_dir, 6))
    catalog = load_catalog(rec_dir, load_rec_config(rec_dir).codebook_size)
    for i, result in enumerate(results):
        assert len(result.candidates) == 1 + i % 5
        assert bool(catalog.contains(torch.tensor(result.candidates)).all())
        assert result.scores == sorted(result.scores, reverse=True)
        assert len(set(result.candidates)) == len(result.candidates)


def test_results_identical_across_pipeline_widths_and_tensor_parallelism(rec_dir: Path) -> None:
    histories = _histories(rec_dir, 11)
    reference = _serve(_config(rec_dir, width=1), histories)
    for width in (2, 4):
        got = _serve(_config(rec_dir, width=width), histories)
        assert [r.candidates for r in got] == [r.candidates for r in reference]
        assert [r.scores for r in got] == [r.scores for r in reference]
    for width in (1, 2):
        tp2 = _serve(_config(rec_dir, width=width, devices="cpu:0,cpu:1"), histories)
        assert [r.candidates for r in tp2] == [r.candidates for r in reference]
        # Two partial sums add in another order than one matmul: equal to float rounding.
        for a, b in zip(tp2, reference, strict=True):
            assert a.scores == pytest.approx(b.scores, abs=1e-4)


def test_bad_requests_are_refused_with_the_field(rec_dir: Path) -> None:
    service = RecService(_config(rec_dir))
    try:
        mc = service.model_config
        cases = [
            ([], 3, "non-empty"),
            ([[1, 2]], 3, f"list of {mc.num_codebooks} semantic ids"),
            ([[1, 2, mc.codebook_size]], 3, "outside"),
            ([[1, 2, "x"]], 3, "non-integer"),
            ([[1, 2, 3]] * (mc.max_history + 1), 3, "at most"),
            ([[1, 2, 3]], 0, "num_candidates"),
        ]
        for history, k, message in cases:
            with pytest.raises(InvalidRequestError, match=message):
                service.submit(history, k)  # type: ignore[arg-type]
        # Still serving after every refusal.
        assert service.submit([[1, 2, 3]], 2).result(timeout=30).candidates
    finally:
        service.shutdown()


def test_combinations_that_cannot_work_stop_at_start_up(rec_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--max-decode-rounds 5 does not fit the model"):
        RecService(_config(rec_dir, max_decode_rounds=5))
    multi = _config(rec_dir)
    multi = EngineConfig(
        model=multi.model,
        cache=multi.cache,
        parallel=ParallelConfig(devices="cpu:0,cpu:1", master_node_addr="127.0.0.1:1"),
    )
    with pytest.raises(ConfigError, match="single-process mode"):
        RecService(multi)
    nodes = EngineConfig(
        model=multi.model,
        cache=multi.cache,
        parallel=ParallelConfig(
            devices="cpu:0", single_process=True, nnodes=2, master_node_addr="127.0.0.1:1"
        ),
    )
    with pytest.raises(ConfigError, match="serve one node"):
        RecService(nodes)


def test_each_lane_shares_one_copy_of_the_weights(rec_dir: Path) -> None:
    service = RecService(_config(rec_dir, width=4))
    try:
        worker = service.executor.workers[0]  # type: ignore[attr-defined]
        assert len(worker.lanes) == 4
        params = list(worker.runner.model.parameters())
        # One model object for every lane: lanes differ in threads and state only.
        assert len({id(p) for p in params}) == len(params)
        assert len({id(s.state) for s in worker.lanes}) == 4
        assert len({id(s.stager) for s in worker.lanes}) == 4
    finally:
        service.shutdown()


def test_request_larger_than_the_pool_fails_at_once(rec_dir: Path) -> None:
    config = _config(rec_dir)
    small = EngineConfig(
        model=config.model, cache=CacheConfig(num_blocks=2, block_size=4), rec=config.rec
    )
    service = RecService(small)
    try:
        with pytest.raises(InvalidRequestError, match="needs 3 KV blocks and the cache has 2"):
            service.submit([[1, 2, 3]] * 9, 2)
        assert len(service.submit([[1, 2, 3]], 1).result(timeout=30).scores) == 1
    finally:
        service.shutdown()
