"""N-gram speculative decoding through the engine: greedy output identical to plain decoding
with drafts accepted, in one process and with two tensor-parallel ranks; stops, lengths,
preemption, prefix caching and chunked prefill keep working; every block is free at the end;
what cannot be verified position by position gets no drafts; unsupported setups are refused."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from reference_models import write_reference_model

from tandem.core import LLMEngine, SamplingParams
from tandem.core.config import ParallelConfig, PipelineConfig, SpeculativeConfig
from tandem.core.errors import ConfigError
from tandem.core.llm.drafting import Drafter
from tandem.core.llm.prompt_logits import prompt_logits
from tandem.core.llm.sequence import TokenSequence
from tandem.core.models.mtp_training import (
    TrainableHead,
    load_reference_model,
    reference_drafts,
    text_config,
)
from tandem.core.models.mtp_writer import initial_head, write_mtp_head

EngineFactory = Callable[..., LLMEngine]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
# Token-id prompts that repeat themselves, so n-grams find drafts in the prompt at once.
PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [40, 41, 42, 43, 40, 41, 42],
    [100, 3, 200, 3, 100, 3, 200],
    [11, 12, 13],
]


def _tokens(engine: LLMEngine, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [list(out.token_ids) for out in engine.generate(list(PROMPTS), params)]


def _pair(
    make_engine: EngineFactory,
    model: Path,
    params: SamplingParams | list[SamplingParams],
    **kw: Any,
) -> tuple[list[list[int]], list[list[int]], LLMEngine]:
    """Tokens without and with speculation, and the speculating engine (run to the end)."""
    plain = _tokens(make_engine(model, **kw), params)
    engine = make_engine(model, speculative=SPEC, **kw)
    return plain, _tokens(engine, params), engine


def _all_free(engine: LLMEngine) -> bool:
    if engine.snapshots is not None:
        engine.snapshots.clear()  # a hybrid's prefix cache: state snapshots hold blocks
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("max_tokens", [1, 9, 40])
def test_greedy_tokens_are_identical_and_drafts_are_accepted(
    demo_dir: Path, make_engine: EngineFactory, max_tokens: int
) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain, spec, engine = _pair(make_engine, demo_dir, params)
    assert spec == plain
    assert all(len(t) == max_tokens for t in spec)  # never past max_tokens
    stats = engine.stats
    if max_tokens > 1:
        assert stats.spec_num_accepted_tokens > 0
        assert stats.spec_num_draft_tokens >= stats.spec_num_accepted_tokens
        assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    else:
        assert stats.spec_num_drafts == 0  # one token to emit: nothing to draft
    assert _all_free(engine)


def test_tensor_parallel_ranks_in_one_process_give_the_same_tokens(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _tokens(make_engine(demo_dir), params)
    tp2 = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    engine = make_engine(demo_dir, speculative=SPEC, parallel=tp2)
    assert _tokens(engine, params) == plain
    assert engine.stats.spec_num_accepted_tokens > 0


def test_small_budgets_preemption_and_chunked_prefill_keep_the_tokens(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    """Ten blocks of 4 tokens for four sequences of up to 13 + 30 tokens: sequences are
    preempted and recomputed; a budget of 6 tokens a step chunks prompts and cuts drafts."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = {"num_blocks": 14, "block_size": 4, "max_tokens_per_batch": 6}
    plain, spec, engine = _pair(make_engine, demo_dir, params, **kw)
    assert spec == plain
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.spec_num_accepted_tokens > 0
    assert _all_free(engine)


def test_prefix_cache_hits_keep_the_tokens(demo_dir: Path, make_engine: EngineFactory) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine = make_engine(demo_dir, speculative=SPEC, block_size=4)
    first = _tokens(engine, params)
    # The same prompts again: their full blocks come from the cache.
    again = engine.generate(list(PROMPTS), params)
    assert [list(o.token_ids) for o in again] == first
    assert any(o.num_cached_tokens > 0 for o in again)
    assert first == _tokens(make_engine(demo_dir, block_size=4), params)
    assert _all_free(engine)


def test_stop_tokens_and_strings_end_where_plain_decoding_ends(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    """Each output token of a plain run, made a stop token, ends the speculative run at the
    same token; the same for stop strings (a stop inside an accepted run: test_step_results)."""
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain_engine = make_engine(demo_dir)
    spec_engine = make_engine(demo_dir, speculative=SPEC)
    reference = plain_engine.generate([PROMPTS[0]], base)[0]
    stops = sorted(set(reference.token_ids[2:]))[:6]
    texts = [reference.text[i : i + 3] for i in (4, 9) if reference.text[i : i + 3].strip()]
    variants = [SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[t]) for t in stops]
    variants += [SamplingParams(max_tokens=24, temperature=0.0, stop=[t]) for t in texts]
    for params in variants:
        plain = plain_engine.generate([PROMPTS[0]], params)[0]
        spec = spec_engine.generate([PROMPTS[0]], params)[0]
        assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == (
            plain.token_ids,
            plain.text,
            plain.finish_reason,
            plain.stop_reason,
        ), params
    assert spec_engine.stats.spec_num_accepted_tokens > 0
    assert _all_free(spec_engine)


def test_requests_with_per_token_sampling_state_get_no_drafts(
    demo_dir: Path, make_engine: EngineFactory
) -> None:
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5),
        SamplingParams(max_tokens=12, temperature=0.0, logit_bias={7: 1.0}),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.2),
    ]
    plain, spec, engine = _pair(make_engine, demo_dir, params)
    assert spec == plain
    assert engine.stats.spec_num_drafts == 0


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_accepted_drafts_carry_the_logprobs_plain_decoding_gives(
    demo_dir: Path, make_engine: EngineFactory, temperature: float
) -> None:
    """Requests asking for logprobs get drafts; each token, accepted draft or sampled, has the
    logprob and top candidates plain decoding gives at its position (random requests: the
    logprobs of whatever was drawn, under the model's own distribution there)."""
    params = SamplingParams(
        max_tokens=24, temperature=temperature, logprobs=3, ignore_eos=True, seed=3
    )
    plain_engine = make_engine(demo_dir)
    spec_engine = make_engine(demo_dir, speculative=SPEC)
    spec = spec_engine.generate(list(PROMPTS), params)
    assert spec_engine.stats.spec_num_accepted_tokens > 0
    for prompt, out in zip(PROMPTS, spec, strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 24
        # Plain decoding's view of the same tokens: the prompt and the output so far, scored.
        tokens = list(prompt) + list(out.token_ids)
        expected = prompt_logits(plain_engine, tokens[:-1]).log_softmax(-1)[len(prompt) - 1 :]
        for k, (token, got) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert got.token_id == token
            assert got.logprob == pytest.approx(expected[k, token].item(), abs=1e-4), k
            top = expected[k].topk(3)
            assert [t for t, _ in got.top] == top.indices.tolist(), k
            assert [v for _, v in got.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_seeded_random_requests_reproduce(demo_dir: Path, make_engine: EngineFactory) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=11)
    engine = make_engine(demo_dir, speculative=SPEC)
    first = _tokens(engine, params)
    assert _tokens(engine, params) == first
    assert _tokens(make_engine(demo_dir, speculative=SPEC), params) == first
    assert engine.stats.spec_num_drafts > 0


LANES = PipelineConfig(max_concurrency=2)


class LaunchLog:
    """What each decode batch launched beside steps in flight (pipeline lanes) verifies, and
    whether it collides with them: a sequence whose rejected drafts a step in flight rolls
    back must wait for it (its state row is being copied), and two steps in flight must not
    keep their verify states in the same scratch rows."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.verifying = 0
        # Rollbacks carried by a batch for sequences it does not run.
        self.rollbacks_of_others = 0
        self.collisions: list[str] = []
        scheduler = engine.scheduler
        self._schedule_decodes = scheduler.schedule_decodes
        scheduler.schedule_decodes = self  # type: ignore[method-assign]

    def __call__(self, exclude: set[str], max_seqs: int) -> Any:
        out = self._schedule_decodes(exclude, max_seqs)
        self.verifying += sum(bool(e.draft_token_ids) for e in out.scheduled)
        slots = {e.seq.state_slot for e in out.scheduled}
        self.rollbacks_of_others += sum(dst not in slots for _, dst in out.rollbacks)
        for flight in self.engine.in_flight.steps:
            rolled_back = {dst for _, dst in flight.out.rollbacks}
            busy_scratch = {r for e in flight.out.scheduled for r in e.scratch_rows}
            for entry in out.scheduled:
                if entry.seq.state_slot in rolled_back:
                    self.collisions.append(f"{entry.seq.request_id}: row rolled back in flight")
                if busy_scratch & set(entry.scratch_rows):
                    self.collisions.append(f"{entry.seq.request_id}: scratch rows in use")
        return out


@pytest.mark.parametrize("max_tokens", [9, 40])
def test_pipeline_lanes_verify_drafts_and_keep_the_tokens(
    demo_dir: Path, make_engine: EngineFactory, max_tokens: int
) -> None:
    """With two steps in flight (--max-concurrency 2), the decode batches launched beside
    each other carry drafts too, and the tokens are plain decoding's."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain = _tokens(make_engine(demo_dir), params)
    engine = make_engine(demo_dir, speculative=SPEC, pipeline=LANES)
    log = LaunchLog(engine)
    assert _tokens(engine, params) == plain
    assert log.verifying > 0 and engine.stats.spec_num_accepted_tokens > 0
    assert _all_free(engine)


def _rejected(engine: LLMEngine) -> int:
    stats = engine.stats
    return stats.spec_num_draft_tokens - stats.spec_num_accepted_tokens


class OracleDrafter(Drafter):
    """Drafts from a plain run's greedy tokens, wrong at a chosen place: the verification
    accepts exactly 0, 1, .., K of them in turn (a random tiny model repeats itself too
    rarely for n-grams to get drafts accepted at every position). Rolling a hybrid's state
    back is then exercised after every possible number of accepted drafts."""

    def __init__(self, config: SpeculativeConfig, plain: dict[tuple[int, ...], list[int]]):
        super().__init__(config, uses_processor=lambda seq: False)
        self._plain = plain
        self._turn = 0

    def drafts(self, seq: TokenSequence, budget: int) -> tuple[int, ...]:
        room = min(budget, seq.max_output_tokens - seq.num_output_tokens) - 1
        room = min(room, self.config.num_speculative_tokens)
        if room <= 0:
            return ()
        done = seq.num_output_tokens
        truth = self._plain[tuple(seq.prompt_token_ids)][done : done + room]
        accept = self._turn % (room + 1)
        self._turn += 1
        if accept < len(truth):
            truth[accept] = (truth[accept] + 1) % 300
        return tuple(truth)


def _with_oracle(
    make_engine: EngineFactory, model: Path, params: SamplingParams, **kw: Any
) -> tuple[list[list[int]], list[list[int]], LLMEngine]:
    plain = _tokens(make_engine(model, **kw), params)
    engine = make_engine(model, speculative=SPEC, **kw)
    engine.scheduler.drafter = OracleDrafter(
        SPEC, {tuple(p): t for p, t in zip(PROMPTS, plain, strict=True)}
    )
    return plain, _tokens(engine, params), engine


def _accepted_at_every_position(engine: LLMEngine) -> bool:
    return all(n > 0 for n in engine.stats.spec_accepted_per_position)


@pytest.mark.parametrize("max_tokens", [9, 40])
def test_hybrid_greedy_tokens_are_identical_with_drafts_accepted_and_rejected(
    hybrid_dir: Path, make_engine: EngineFactory, max_tokens: int
) -> None:
    """A hybrid's linear-attention states go back to the last accepted draft: a rejected
    draft left in the conv or recurrent state would change every token after it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain, spec, engine = _with_oracle(make_engine, hybrid_dir, params)
    assert spec == plain
    assert _accepted_at_every_position(engine) and _rejected(engine) > 0
    assert _all_free(engine)


def test_hybrid_ngram_drafts_keep_the_tokens(hybrid_dir: Path, make_engine: EngineFactory) -> None:
    """The n-gram proposer's own drafts (on this random model, rejected)."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, spec, engine = _pair(make_engine, hybrid_dir, params)
    assert spec == plain
    assert engine.stats.spec_num_drafts > 0


def test_hybrid_tensor_parallel_ranks_in_one_process_give_the_same_tokens(
    hybrid_dir: Path, make_engine: EngineFactory
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tp2 = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    plain, spec, engine = _with_oracle(make_engine, hybrid_dir, params, parallel=tp2)
    assert spec == plain
    assert _accepted_at_every_position(engine) and _rejected(engine) > 0


def test_hybrid_preemption_and_chunked_prefill_keep_the_tokens(
    hybrid_dir: Path, make_engine: EngineFactory
) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = {"num_blocks": 12, "block_size": 4, "max_tokens_per_batch": 8}
    plain, spec, engine = _with_oracle(make_engine, hybrid_dir, params, **kw)
    assert spec == plain
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.spec_num_accepted_tokens > 0 and _rejected(engine) > 0
    assert _all_free(engine)


@pytest.mark.parametrize("budget", [2048, 16])
def test_hybrid_pipeline_lanes_roll_back_without_sharing_rows(
    hybrid_dir: Path, make_engine: EngineFactory, budget: int
) -> None:
    """Two steps in flight on pipeline lanes, each verifying drafts of its own sequences:
    neither uses the other's scratch rows, no sequence runs while a step in flight rolls
    its state back, and the tokens are plain decoding's. With 16 tokens a step, a full step
    verifies beside prefill chunks and the decode batch after it, half the sequences, carries
    the rollbacks of all (the case that failed before their owners were kept busy)."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = {"max_tokens_per_batch": budget}
    plain = _tokens(make_engine(hybrid_dir, **kw), params)
    engine = make_engine(hybrid_dir, speculative=SPEC, pipeline=LANES, **kw)
    engine.scheduler.drafter = OracleDrafter(
        SPEC, {tuple(p): t for p, t in zip(PROMPTS, plain, strict=True)}
    )
    log = LaunchLog(engine)
    assert _tokens(engine, params) == plain
    assert log.verifying > 0 and not log.collisions, log.collisions[:3]
    assert _accepted_at_every_position(engine) and _rejected(engine) > 0
    assert budget != 16 or log.rollbacks_of_others > 0  # the case the rule is for
    assert _all_free(engine)


def test_hybrid_next_turns_start_from_states_kept_after_rollbacks(
    hybrid_dir: Path, make_engine: EngineFactory
) -> None:
    """Each request's state at its end becomes a prefix-cache snapshot; the next turn (its
    prompt and answer, then more) starts from it. A snapshot kept from a row whose last step
    rejected drafts must hold the rolled-back state, or the next turn's tokens differ."""
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = {"block_size": 4}
    spec_engine = make_engine(hybrid_dir, speculative=SPEC, **kw)
    plain_engine = make_engine(hybrid_dir, enable_prefix_cache=False, **kw)
    oracle = OracleDrafter(SPEC, {})
    spec_engine.scheduler.drafter = oracle
    turns = [list(p) for p in PROMPTS]
    for turn in range(3):
        plain = [list(o.token_ids) for o in plain_engine.generate(turns, params)]
        oracle._plain.update({tuple(t): p for t, p in zip(turns, plain, strict=True)})
        spec = spec_engine.generate(turns, params)
        assert [list(o.token_ids) for o in spec] == plain, turn
        if turn:
            assert all(o.num_cached_tokens > 0 for o in spec)
        turns = [t + list(o.token_ids) + [7, 8] for t, o in zip(turns, spec, strict=True)]
    assert spec_engine.scheduler.snapshot_hits > 0
    assert _accepted_at_every_position(spec_engine) and _rejected(spec_engine) > 0


MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=1)
# Three drafts a step: the head's second and third run on its own outputs (lookahead blocks).
MTP3 = SpeculativeConfig(method="mtp", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def mtp_dir(hybrid_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny hybrid with a multi-token-prediction head (``mtp.*``) started from its last
    full-attention layer (untrained: its drafts are mostly rejected)."""
    folder = tmp_path_factory.mktemp("hybrid-mtp") / "model"
    shutil.copytree(hybrid_dir, folder)
    write_mtp_head(folder, initial_head(folder, seed=3))
    return folder


@pytest.fixture(scope="module")
def moe_mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5-MoE with a head: its layer is a sparse MoE block too."""
    folder = tmp_path_factory.mktemp("moe-mtp") / "model"
    write_reference_model(folder, "Qwen3_5MoeForCausalLM")
    write_mtp_head(folder, initial_head(folder, seed=3))
    return folder


def reference_chain(model: Any, head: TrainableHead, token_ids: list[int], count: int) -> list[int]:
    """The head's first ``count`` drafts after ``token_ids`` (whose last token was just
    sampled), with transformers' layer over the whole sequence each time: the first at the
    position before the last token (``reference_drafts``), each next one a position further
    with the draft before it as input and the head's own output in place of the model's
    hidden state."""
    ids = torch.tensor([token_ids])
    embed = model.get_input_embeddings()
    drafts: list[int] = []
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        embeds = embed(ids[:, 1:])
        for _ in range(count):
            out = head(embeds, hidden)[:, -1:]
            draft = model.lm_head(out).argmax(-1)
            drafts.append(int(draft))
            embeds = torch.cat([embeds, embed(draft)], dim=1)
            hidden = torch.cat([hidden, out], dim=1)
    return drafts


def _check_head_drafts(folder: Path, seen: list[tuple[list[int], tuple[int, ...]]]) -> None:
    """Each draft is transformers' Qwen3.5 layer run as the head over the whole sequence so
    far, at the position before its last token; later drafts as ``reference_chain``."""
    model = load_reference_model(folder)
    head = TrainableHead(text_config(model))
    head.load_head({k: v.float() for k, v in initial_head(folder, seed=3).items()})
    for tokens, drafts in seen:
        assert reference_drafts(model, head, tokens)[-1] == drafts[0], len(tokens)
        if len(drafts) > 1:
            assert reference_chain(model, head, tokens, len(drafts)) == list(drafts), tokens


@pytest.mark.parametrize(("max_tokens", "spec"), [(1, MTP), (24, MTP), (24, MTP3)])
def test_mtp_drafts_keep_greedy_tokens(
    mtp_dir: Path, make_engine: EngineFactory, max_tokens: int, spec: SpeculativeConfig
) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    plain = _tokens(make_engine(mtp_dir), params)
    engine = make_engine(mtp_dir, speculative=spec)
    assert _tokens(engine, params) == plain
    if max_tokens > 1:
        assert engine.stats.spec_num_drafts > 0
    assert _all_free(engine)


class RecordingDrafter(Drafter):
    """The engine's own drafter, noting the head drafts it hands out with the tokens the
    sequence had."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config, uses_processor=lambda seq: False)
        self.seen: list[tuple[list[int], tuple[int, ...]]] = []
        # Drafts handed out shorter than the request and the step's budget allowed.
        self.short = 0

    def drafts(self, seq: TokenSequence, budget: int) -> tuple[int, ...]:
        out = super().drafts(seq, budget)
        if out:
            self.seen.append((list(seq.token_ids), out))
            room = min(budget, seq.max_output_tokens - seq.num_output_tokens) - 1
            self.short += len(out) < min(self.config.num_speculative_tokens, room)
        return out

    def longest(self) -> int:
        return max(len(drafts) for _, drafts in self.seen)


@pytest.mark.parametrize(
    ("kind", "spec"), [("dense", MTP), ("moe", MTP), ("dense", MTP3), ("moe", MTP3)]
)
def test_mtp_drafts_are_the_heads_prediction_over_the_whole_sequence(
    mtp_dir: Path,
    moe_mtp_dir: Path,
    make_engine: EngineFactory,
    kind: str,
    spec: SpeculativeConfig,
) -> None:
    """Each draft equals the head run over the whole sequence so far (transformers' layer):
    so the head's KV cache holds every earlier position, filled across prefill chunks (a
    budget of 5 tokens a step) and verify steps, with rejected positions recomputed; with
    three drafts, the later ones chain the head on its own outputs at positions whose KV
    lies in blocks past the step (4-token blocks: they often start a new one); greedy
    tokens stay those of plain decoding."""
    folder = mtp_dir if kind == "dense" else moe_mtp_dir
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = {"max_tokens_per_batch": 16, "block_size": 4}
    if spec is MTP:
        kw["max_tokens_per_batch"] = 5
    plain = _tokens(make_engine(folder, **kw), params)
    engine = make_engine(folder, speculative=spec, **kw)
    recorder = RecordingDrafter(spec)
    engine.scheduler.drafter = recorder
    assert _tokens(engine, params) == plain
    assert len(recorder.seen) > 20
    # Every chain is as long as the request allows: the lookahead blocks were there.
    assert recorder.longest() == spec.num_speculative_tokens and recorder.short == 0
    _check_head_drafts(folder, recorder.seen)
    assert _all_free(engine)


def test_mtp_chains_under_block_pressure_keep_the_tokens(
    mtp_dir: Path, make_engine: EngineFactory
) -> None:
    """With the pool too small for every sequence's lookahead blocks (and preempting for
    their next tokens), the drafts made are still the head's chain and greedy tokens plain
    decoding's."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = {"block_size": 4, "num_blocks": 26}
    plain = _tokens(make_engine(mtp_dir, **kw), params)
    engine = make_engine(mtp_dir, speculative=MTP3, **kw)
    recorder = RecordingDrafter(MTP3)
    engine.scheduler.drafter = recorder
    assert _tokens(engine, params) == plain
    assert recorder.longest() == 3
    _check_head_drafts(mtp_dir, recorder.seen)
    assert _all_free(engine)


@pytest.mark.parametrize("spec", [MTP, MTP3])
def test_mtp_drafts_on_pipeline_lanes_are_the_heads_prediction(
    mtp_dir: Path, make_engine: EngineFactory, spec: SpeculativeConfig
) -> None:
    """Each lane's step runs the head on its own sequences: drafts stay the head's
    prediction over the whole sequence, and greedy tokens plain decoding's."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = _tokens(make_engine(mtp_dir), params)
    engine = make_engine(mtp_dir, speculative=spec, pipeline=LANES)
    recorder = RecordingDrafter(spec)
    engine.scheduler.drafter = recorder
    log = LaunchLog(engine)
    assert _tokens(engine, params) == plain
    assert log.verifying > 0 and len(recorder.seen) > 10
    _check_head_drafts(mtp_dir, recorder.seen)


@pytest.mark.parametrize("spec", [MTP, MTP3])
def test_mtp_drafts_on_two_ranks_follow_the_sampled_tokens(
    mtp_dir: Path, make_engine: EngineFactory, spec: SpeculativeConfig
) -> None:
    """Tensor-parallel ranks run the head on rank 0's sampled tokens (only rank 0 samples)
    and, for later drafts, its accepted counts: with random sampling, every draft is still
    the head's prediction after the token drawn."""
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=5)
    tp2 = ParallelConfig(devices="cpu:0,cpu:1", single_process=True)
    engine = make_engine(mtp_dir, speculative=spec, parallel=tp2)
    recorder = RecordingDrafter(spec)
    engine.scheduler.drafter = recorder
    _tokens(engine, params)
    assert len(recorder.seen) > 10
    _check_head_drafts(mtp_dir, recorder.seen)


def test_mtp_setups_that_cannot_work_are_refused(
    hybrid_dir: Path, demo_dir: Path, mtp_dir: Path, make_engine: EngineFactory
) -> None:
    for folder in (hybrid_dir, demo_dir):
        with pytest.raises(ConfigError, match=r"has none .*use method 'ngram'"):
            make_engine(folder, speculative=MTP)
