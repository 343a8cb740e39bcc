"""The KV cache an engine reserves: no more than its running sequences can occupy (and the
prefix cache's share), however much memory the budget would give, unless --num-blocks says."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.core.errors import ConfigError, ModelLoadError
from tandem.core.llm.sampling_params import SamplingParams

from ..conftest import EngineFactory


def test_the_cache_holds_what_max_seqs_of_max_model_len_can_use(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    # 3 sequences of 40 tokens in blocks of 16: 3 blocks each, 9 running, 18 with prefixes
    # cached. The 4 GiB budget would give the tiny model hundreds of thousands.
    engine = make_engine(demo_dir, num_blocks=None, max_seqs_per_batch=3, max_model_len=40)
    assert engine.block_manager.num_blocks == 18
    plain = make_engine(
        demo_dir,
        num_blocks=None,
        max_seqs_per_batch=3,
        max_model_len=40,
        enable_prefix_cache=False,
    )
    assert plain.block_manager.num_blocks == 9
    # Every sequence the engine admits still fits: three at the longest context at once.
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    outputs = plain.generate([list(range(1, 11))] * 5, params)
    assert [len(o.token_ids) for o in outputs] == [30] * 5


def test_an_explicit_block_count_is_kept(demo_dir: Path, make_engine: EngineFactory) -> None:
    engine = make_engine(demo_dir, num_blocks=500, max_seqs_per_batch=3, max_model_len=40)
    assert engine.block_manager.num_blocks == 500


def test_a_state_cache_too_small_for_a_snapshot_is_refused_before_the_weights_load(
    hybrid_dir: Path, tmp_path: Path, make_engine: EngineFactory
) -> None:
    """The refusal comes before any weight is read: here the weights are not even readable,
    and the error names --state-cache-mb, not them (a size that holds one gets to them)."""
    broken = tmp_path / "hybrid"
    broken.mkdir()
    for item in hybrid_dir.iterdir():
        if item.suffix == ".safetensors":
            (broken / item.name).write_bytes(b"not a checkpoint")
        else:
            (broken / item.name).symlink_to(item)
    with pytest.raises(ConfigError, match=r"--state-cache-mb 1e-06 holds no state snapshot"):
        make_engine(broken, state_cache_mb=1e-6)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        make_engine(broken, state_cache_mb=1.0)
