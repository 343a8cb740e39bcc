"""The KV cache an engine reserves: no more than its running sequences can occupy (and the
prefix cache's share), however much memory the budget would give, unless --num-blocks says."""

from __future__ import annotations

from pathlib import Path

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
