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


def test_a_failing_step_fails_its_requests_only(
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
    failed = engine.step()  # the injected fault: a and b were both in this step
    assert {(o.request_id, o.finish_reason) for o in failed} == {("a", "error"), ("b", "error")}
    assert all("device fault injected" in (o.error or "") for o in failed)
    assert outs and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    [ok] = engine.generate(["hello again"], SamplingParams.greedy(max_tokens=3))
    assert ok.finish_reason == "length"


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
