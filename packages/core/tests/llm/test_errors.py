"""Bad input and failures: clear errors, and the engine keeps serving everything else."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.core import (
    EngineDeadError,
    InvalidRequestError,
    LLMEngine,
    ModelLoadError,
    RequestOutput,
    SamplingParams,
)
from tandem.core.executor.thread_executor import ThreadExecutor
from tandem.core.llm.forward_input import ForwardInput, SamplerOutput
from tandem.core.worker.step_runner import LaneState


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_lists_supported(
    demo_dir: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    folder = _copy_model(demo_dir, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        make_engine(folder)
    message = str(err.value)
    assert "MambaForCausalLM" in message
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in message


@pytest.mark.parametrize(
    ("remove", "expected"),
    [
        ("config.json", "no config.json"),
        ("model.safetensors", "no \\*.safetensors"),
        ("tokenizer.json", "no tokenizer.json"),
    ],
)
def test_missing_files(
    demo_dir: Path,
    tmp_path: Path,
    make_engine: Callable[..., LLMEngine],
    remove: str,
    expected: str,
) -> None:
    folder = _copy_model(demo_dir, tmp_path / "m")
    (folder / remove).unlink()
    with pytest.raises(ModelLoadError, match=expected):
        make_engine(folder)


def test_missing_folder(make_engine: Callable[..., LLMEngine], tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_engine(tmp_path / "nowhere")


@pytest.mark.parametrize("damage", ["garbage", "cut short"])
def test_an_unreadable_weight_file_is_named_with_what_to_do(
    demo_dir: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine], damage: str
) -> None:
    folder = _copy_model(demo_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"not a checkpoint" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is not a readable safetensors"):
        make_engine(folder)


def test_missing_tensor_is_named(
    demo_dir: Path, tmp_path: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy_model(demo_dir, tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.down_proj\.weight"):
        make_engine(folder)


def test_bad_requests_fail_alone_and_the_engine_keeps_serving(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir, max_model_len=64, num_blocks=32, block_size=4)
    good = engine.add_request("good", "hello world", SamplingParams.greedy(max_tokens=8))
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        engine.add_request("long", list(range(1, 70)), SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_tokens must be at least 1"):
        engine.add_request("zero", "hi", SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"in \[0, 512\)"):
        engine.add_request("oov", [5, 100000], SamplingParams())
    with pytest.raises(InvalidRequestError, match="more than the whole cache"):
        # 32 blocks of 4 = 128 slots, but the context cap is 64: fits. Tighter engine below.
        tight = make_engine(demo_dir, num_blocks=2, block_size=4)
        tight.add_request("big", "hello world", SamplingParams(max_tokens=50))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(good, "again", SamplingParams())
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert finished[0].finish_reason == "length" and len(finished[0].token_ids) == 8


def test_generation_stops_at_the_context_limit(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir, max_model_len=16)
    prompt = list(range(10, 20))
    [out] = engine.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True))
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 16


def test_a_failing_step_fails_every_request_naming_the_rank_and_the_engine_stops(
    demo_dir: Path, make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(demo_dir)
    executor = engine.executor
    assert isinstance(executor, ThreadExecutor)
    runner = executor.workers[0].runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(fi: ForwardInput, state: LaneState) -> SamplerOutput | None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fault injected by the test")
        result: SamplerOutput | None = real(fi, state)
        return result

    monkeypatch.setattr(runner, "execute", flaky)
    engine.add_request("a", "hello world", SamplingParams.greedy(max_tokens=5))
    outs = engine.step()  # prefill of "a"
    engine.add_request("b", "late", SamplingParams.greedy(max_tokens=5))
    engine.add_request("c", "later", SamplingParams.greedy(max_tokens=5))
    failed = engine.step()  # the injected fault
    assert {(o.request_id, o.finish_reason) for o in failed} == {
        ("a", "error"),
        ("b", "error"),
        ("c", "error"),
    }
    for out in failed:
        assert out.error is not None
        assert "rank 0 (cpu:0) failed: RuntimeError: device fault injected" in out.error
    assert outs and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.dead is not None and "rank 0" in engine.dead
    with pytest.raises(EngineDeadError, match="device fault injected"):
        engine.check_health()
    with pytest.raises(EngineDeadError, match="device fault injected"):
        engine.add_request("d", "x", SamplingParams())


def test_a_request_whose_batch_part_cannot_be_built_fails_alone(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    """The adversarial case: a value that passed no check breaks the batch's tensors; only
    its request fails, the others in the batch run on and the engine lives."""
    engine = make_engine(demo_dir)
    greedy = SamplingParams.greedy(max_tokens=4, ignore_eos=True)
    bad = SamplingParams(max_tokens=4, temperature=1.0)
    engine.add_request("good1", "hello world", greedy)
    engine.add_request("bad", "hello world", bad)
    engine.add_request("good2", "the model", greedy)
    bad.top_k = 2**63  # past every check, as a bug would let it through
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert finished["bad"].finish_reason == "error"
    assert "could not be batched" in (finished["bad"].error or "")
    assert finished["good1"].finish_reason == finished["good2"].finish_reason == "length"
    solo = make_engine(demo_dir).generate(["hello world", "the model"], greedy)
    assert [finished["good1"].token_ids, finished["good2"].token_ids] == [o.token_ids for o in solo]
    assert engine.dead is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sampling_values_are_range_checked_to_fit_their_tensors() -> None:
    for field, value in [
        ("top_k", 2**63), ("top_k", -2), ("max_tokens", 2**40), ("seed", 2**64),
        ("stop_token_ids", [2**63]), ("temperature", True), ("temperature", "0.5"),
        ("temperature", float("nan")), ("top_p", 0.0), ("logprobs", 21),
    ]:  # fmt: skip
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**{field: value})  # type: ignore[arg-type]
        assert err.value.param == field


def test_a_dead_worker_fails_every_request_instead_of_hanging(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir)
    executor = engine.executor
    assert isinstance(executor, ThreadExecutor)
    engine.add_request("a", "hello", SamplingParams.greedy(max_tokens=50))
    engine.add_request("b", "world", SamplingParams.greedy(max_tokens=50))
    engine.step()

    # The worker thread goes away (as a crashed device thread would).
    executor._threads[0].stop()
    assert not executor._threads[0].is_alive()
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.finish_reason == "error" for o in outs)
    with pytest.raises(EngineDeadError):
        engine.add_request("c", "x", SamplingParams())
