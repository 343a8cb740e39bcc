"""Prefix caching of a hybrid model under random traffic: shared system prompts of 30 to 2,000
tokens, follow-up turns that repeat the conversation so far, prefill chunks ending anywhere,
preemption, aborts and pipeline lanes. Every request that runs to its end gets the tokens it
gets alone without prefix caching; snapshots are hit; and when the load ends every slot is
free, no snapshot is pinned, and every block is free once the snapshots go."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import PipelineConfig
from tandem.core.demo.family_demo_model import Qwen3_5DemoSpec, write_qwen3_5_demo_model

from ..conftest import EngineFactory, assert_all_returned

SYSTEM_LENGTHS = (30, 150, 700, 2000)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two Gated DeltaNet layers and one gated full-attention layer, a 4,096-token context.
    spec = Qwen3_5DemoSpec(
        hidden_size=64, intermediate_size=128, num_layers=3, full_attention_interval=3,
        num_heads=2, num_kv_heads=1, head_dim=32, linear_key_head_dim=16,
        linear_value_head_dim=16, init_std=0.2,
    )  # fmt: skip
    return write_qwen3_5_demo_model(tmp_path_factory.mktemp("hybrid-prefix") / "m", spec)


class Traffic:
    """Waves of requests: new conversations on shared system prompts, and follow-up turns of
    the previous wave's finished ones; one request of each wave aborted after a random
    number of steps."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.systems = [self._tokens(n) for n in SYSTEM_LENGTHS]
        self.finished: dict[str, tuple[list[int], list[int]]] = {}

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 1990) for _ in range(n)]

    def wave(self, index: int, previous: list[str]) -> dict[str, tuple[list[int], SamplingParams]]:
        requests = {}
        for i in range(5):
            system = self.rng.choice(self.systems)
            requests[f"w{index}-new{i}"] = system + self._tokens(self.rng.randint(1, 40))
        for rid in previous:
            if rid in self.finished and self.rng.random() < 0.8:
                prompt, output = self.finished[rid]
                requests[f"w{index}-{rid}+"] = (
                    prompt + output + self._tokens(self.rng.randint(1, 9))
                )
        return {
            rid: (
                prompt,
                SamplingParams.greedy(max_tokens=self.rng.randint(1, 10), ignore_eos=True),
            )
            for rid, prompt in requests.items()
        }


def _serve(engine: LLMEngine, traffic: Traffic, waves: int) -> dict[str, list[int]]:
    """Run every wave to its end; the tokens of the requests that ran to their length."""
    done: dict[str, list[int]] = {}
    previous: list[str] = []
    for index in range(waves):
        wave = traffic.wave(index, previous)
        for rid, (prompt, params) in wave.items():
            engine.add_request(rid, prompt, params)
        victim = traffic.rng.choice(sorted(wave))
        abort_at = traffic.rng.randint(0, 6)
        steps = 0
        while engine.has_unfinished():
            if steps == abort_at:
                engine.abort(victim)
            for out in engine.step():
                if out.finished and out.finish_reason == "length":
                    done[out.request_id] = out.token_ids
                    traffic.finished[out.request_id] = (wave[out.request_id][0], out.token_ids)
            steps += 1
            assert steps < 5000, "the engine made no progress"
        previous = list(wave)
    return done


@pytest.mark.parametrize(
    ("budget", "num_blocks", "lanes", "interval"),
    [
        (2048, 1024, 1, 512),  # whole prompts in one step
        (96, 1024, 1, 128),  # chunks ending anywhere, snapshots inside long prompts
        (64, 140, 2, 0),  # the longest prompts share 140 blocks, two lanes
    ],
)
def test_random_shared_prefix_traffic_gets_the_tokens_of_each_request_alone(
    model: Path, make_engine: EngineFactory, budget: int, num_blocks: int, lanes: int,
    interval: int,
) -> None:  # fmt: skip
    engine = make_engine(
        model,
        num_blocks=num_blocks,
        block_size=16,
        max_tokens_per_batch=budget,
        max_seqs_per_batch=8,
        state_snapshot_interval=interval,
        pipeline=PipelineConfig(max_concurrency=lanes),
    )
    traffic = Traffic(seed=budget)
    done = _serve(engine, traffic, waves=3)
    alone = make_engine(model, num_blocks=1024, enable_prefix_cache=False)
    for rid, tokens in done.items():
        prompt, _ = traffic.finished[rid]
        params = SamplingParams.greedy(max_tokens=len(tokens), ignore_eos=True)
        assert alone.generate([prompt], params)[0].token_ids == tokens, rid
    stats = engine.stats
    assert stats.state_snapshot_hits >= 5, stats
    assert stats.prefix_cache_hits > 0
    assert_all_returned(engine)


def test_a_preempted_sequence_resumes_from_its_own_state(
    model: Path, make_engine: EngineFactory
) -> None:
    """Two long prompts that outgrow the blocks together: the newer one is preempted, its slot
    kept as a snapshot of what it had computed, and it resumes from there once the other
    is done (its blocks freed last, so they are still cached), with the tokens it gets alone."""
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 1990) for _ in range(600)] for _ in range(2)]
    params = SamplingParams.greedy(max_tokens=8, ignore_eos=True)
    # The first step computes one prompt and 100 tokens of the other, which then needs more
    # blocks than the 70 leave.
    engine = make_engine(model, num_blocks=70, max_tokens_per_batch=700, max_seqs_per_batch=2)
    outs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.state_snapshot_hits > 0
    alone = make_engine(model, num_blocks=100, enable_prefix_cache=False)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in outs] == expected
    assert_all_returned(engine)
