"""The ``tandem`` command as a user runs it: a real subprocess each time."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tandem.core.demo.pretrained import stories260k_folder
from tandem.server.cli.chat_args import chat_config_from_args
from tandem.server.cli.engine_args import engine_config_from_args
from tandem.server.cli.main import build_parser
from tandem.server.cli.serve import apply_model_tag

from .cli_runner import make_demo_model, tandem


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_make_demo_model_is_reproducible(demo: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert tandem("make-demo-model", str(again)).returncode == 0
    assert _digest(again) == _digest(demo)
    names = set(_digest(demo))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((demo / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    assert "im_start" in json.loads((demo / "tokenizer_config.json").read_text())["chat_template"]


def test_generate_json_contract(demo: Path) -> None:
    result = tandem(
        "generate",
        "--model",
        str(demo),
        "--prompt",
        "hello world",
        "--prompt-token-ids",
        "5,6,7",
        "--prompt",
        "λ",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    for record in records:
        assert set(record) == {
            "prompt_token_ids", "token_ids", "text", "finish_reason", "num_cached_tokens"
        }  # fmt: skip
        assert len(record["token_ids"]) == 6 and record["finish_reason"] == "length"
    assert records[1]["prompt_token_ids"] == [5, 6, 7]
    # Greedy by default: the same command gives the same tokens.
    again = tandem(
        "generate",
        "--model",
        str(demo),
        "--prompt",
        "hello world",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    )
    assert json.loads(again.stdout.splitlines()[0])["token_ids"] == records[0]["token_ids"]
    assert "tokens/s" in result.stderr


def test_generate_reports_logprobs_as_json(demo: Path) -> None:
    """Each generated token's logprob and top candidates, and the prompt's; fed back as a
    prompt, the generated tokens get the logprobs generation reported."""
    common = ["--model", str(demo), "--dtype", "float32", "--json", "--ignore-eos"]
    result = tandem("generate", *common, "--prompt-token-ids", "5,6,7", "--max-tokens", "4",
                    "--logprobs", "2", "--prompt-logprobs", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    generated = record["logprobs"]
    assert [p["token_id"] for p in generated] == record["token_ids"]
    for position in generated:
        (first, first_lp), (_, second_lp) = position["top"]
        # Greedy: the chosen token is the first candidate.
        assert position["token_id"] == first and position["logprob"] == first_lp
        assert 0.0 >= first_lp >= second_lp
    prompt = record["prompt_logprobs"]
    assert prompt[0] is None and [p["token_id"] for p in prompt[1:]] == [6, 7]
    assert all(len(p["top"]) == 1 for p in prompt[1:])
    ids = ",".join(str(t) for t in [5, 6, 7, *record["token_ids"]])
    again = tandem("generate", *common, "--prompt-token-ids", ids, "--max-tokens", "1",
                   "--prompt-logprobs", "0")  # fmt: skip
    assert again.returncode == 0, again.stderr
    replayed = json.loads(again.stdout)["prompt_logprobs"][3:]
    assert [p["token_id"] for p in replayed] == record["token_ids"]
    for ours, theirs in zip(replayed, generated, strict=True):
        assert ours["logprob"] == pytest.approx(theirs["logprob"], abs=1e-3)
    assert "logprobs" not in json.loads(again.stdout)


@pytest.mark.parametrize(
    ("kind", "architecture"),
    [("qwen3_5", "Qwen3_5ForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")],
)
def test_family_demo_models_are_written_and_served(
    kind: str, architecture: str, tmp_path: Path
) -> None:
    folder = tmp_path / kind
    made = tandem("make-demo-model", "--kind", kind, str(folder))
    assert made.returncode == 0, made.stderr
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == [architecture]
    # As the released Qwen3.5 checkpoints: peers that read it keep the state in float32 too.
    assert written.get("mamba_ssm_dtype") == ("float32" if kind == "qwen3_5" else None)
    result = tandem("generate", "--model", str(folder), "--prompt", "hello world", "--json",
                    "--max-tokens", "5", "--ignore-eos", "--max-tokens-per-batch", "4",
                    "--num-blocks", "64")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) == 5


def test_an_unknown_preset_of_a_kind_is_refused(tmp_path: Path) -> None:
    result = tandem("make-demo-model", "--kind", "rec", "--preset", "bench", str(tmp_path / "x"))
    assert result.returncode == 2
    assert "--kind rec has the presets demo, not 'bench'" in result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "/nonexistent/model", "--prompt", "x"], "does not exist"),
        (["--prompt", "x", "--block-size", "0"], "--block-size must be >= 1"),
        (["--prompt", "x", "--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be in"),
        (["--prompt", "x", "--logprobs", "21", "--json"], "logprobs must be in [0, 20], got 21"),
        (["--prompt", "x", "--prompt-logprobs", "1"], "are printed with --json"),
        ([], "at least one --prompt"),
        (["--prompt-token-ids", "1,x"], "comma-separated integers"),
        (["--prompt", "x", "--speculative-config", "{"], "--speculative-config is not valid"),
        (
            [
                "--prompt",
                "x",
                "--speculative-config",
                '{"method": "eagle", "num_speculative_tokens": 1}',
            ],
            "method 'eagle' (not served yet) is not supported; supported: 'ngram', 'mtp'",
        ),
        (
            [
                "--prompt",
                "x",
                "--speculative-config",
                '{"method": "mtp", "num_speculative_tokens": 1}',
            ],
            "(config.json has no mtp_num_hidden_layers); use method 'ngram'",
        ),
    ],
)
def test_bad_input_gets_a_message_not_a_traceback(
    demo: Path, args: list[str], expected: str
) -> None:
    if "--model" not in args:
        args = ["--model", str(demo), *args]
    result = tandem("generate", *args)
    assert result.returncode != 0
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_a_vllm_launch_line_maps_onto_the_config(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    line = (
        f"serve /models/qwen3 --served-model-name qwen q3 --max-model-len 8192 "
        f"--max-num-seqs 32 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.8 "
        f"--no-enable-prefix-caching --chat-template {template} --enable-auto-tool-choice "
        f"--tool-call-parser hermes --reasoning-parser qwen3 --trust-remote-code --seed 7 -tp 2 "
        f"--dtype half"
    )
    args = build_parser().parse_args(line.split())
    apply_model_tag(args)
    config = engine_config_from_args(args)
    assert config.model.model == "/models/qwen3" and args.served_model_name == ["qwen", "q3"]
    assert (config.model.max_model_len, config.model.seed) == (8192, 7)
    assert config.scheduler.max_seqs_per_batch == 32
    assert config.scheduler.max_tokens_per_batch == 4096
    assert config.cache.max_memory_utilization == 0.8
    assert config.cache.enable_prefix_cache is False
    assert config.parallel.tensor_parallel_size == 2 and config.model.dtype == "float16"
    chat = chat_config_from_args(args)
    assert chat.chat_template == template.read_text()
    assert (chat.tool_call_parser, chat.reasoning_parser) == ("hermes", "qwen3")


def test_serve_without_a_model_serves_the_bundled_one() -> None:
    args = build_parser().parse_args(["serve", "--enable-prefix-caching"])
    apply_model_tag(args)
    assert engine_config_from_args(args).model.model == str(stories260k_folder())


def test_a_server_prefaults_its_kv_cache_and_generate_does_not() -> None:
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).cache.prefault_kv_cache
    lazy = parser.parse_args(["serve", "--no-prefault-kv-cache"])
    assert engine_config_from_args(lazy).cache.prefault_kv_cache is False
    offline = parser.parse_args(["generate", "--prompt", "x"])
    assert engine_config_from_args(offline).cache.prefault_kv_cache is False
    told = parser.parse_args(["generate", "--prompt", "x", "--prefault-kv-cache"])
    assert engine_config_from_args(told).cache.prefault_kv_cache is True


def test_bench_serve_refuses_a_negative_shared_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    serve = ["bench", "serve", "--base-url", "http://127.0.0.1:1"]
    assert build_parser().parse_args(serve).shared_prefix_len == 0
    assert build_parser().parse_args([*serve, "--shared-prefix-len", "64"]).shared_prefix_len == 64
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*serve, "--shared-prefix-len", "-1"])
    assert exited.value.code == 2
    assert "argument --shared-prefix-len: must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["/a", "--model", "/b"], "two models named"),
        (["--chat-template", "/no/such/template.jinja"], "no such file"),
        (["--tool-call-parser", "pythonic"], "invalid choice"),
    ],
)
def test_bad_serve_flags_get_a_message(args: list[str], expected: str) -> None:
    result = tandem("serve", *args, timeout=60)
    assert result.returncode != 0
    assert expected in result.stderr and "Traceback" not in result.stderr
