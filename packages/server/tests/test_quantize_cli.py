"""``tandem quantize`` as a user runs it: a real subprocess, then the folder it wrote served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli_runner import make_demo_model, tandem


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory)


def test_quantize_writes_a_folder_that_generates(demo: Path, tmp_path: Path) -> None:
    dst = tmp_path / "w8a8"
    result = tandem("--log-level", "INFO", "quantize", str(demo), str(dst), "--scheme", "w8a8")
    assert result.returncode == 0, result.stderr
    assert "quantize: model.safetensors (1 of 1 files)" in result.stderr
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in dst.iterdir()}
    out = tandem(
        "generate", "--model", str(dst), "--prompt", "hello", "--max-tokens", "4", "--json"
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.splitlines()[0])["token_ids"]) == 4


def test_quantize_w4a16_writes_a_gptq_folder_that_generates(demo: Path, tmp_path: Path) -> None:
    dst = tmp_path / "w4a16"
    args = ("--scheme", "w4a16", "--group-size", "64", "--no-sym")
    result = tandem("quantize", str(demo), str(dst), *args)
    assert result.returncode == 0, result.stderr
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"]) == ("gptq", 4, 64, False)
    out = tandem(
        "generate", "--model", str(dst), "--prompt", "hello", "--max-tokens", "4", "--json"
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.splitlines()[0])["token_ids"]) == 4


def test_quantize_w4a16_with_calibration_runs_gptq_in_activation_order(
    demo: Path, tmp_path: Path
) -> None:
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    dst = tmp_path / "gptq"
    args = ("--scheme", "w4a16", "--group-size", "32", "--act-order")
    calibration = ("--calibration", str(text), "--calibration-samples", "4")
    result = tandem("--log-level", "INFO", "quantize", str(demo), str(dst), *args, *calibration)
    assert result.returncode == 0, result.stderr
    assert "calibrating on 4 samples" in result.stderr
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert (qc["desc_act"], qc["true_sequential"]) == (True, False)
    out = tandem(
        "generate", "--model", str(dst), "--prompt", "hello", "--max-tokens", "4", "--json"
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.splitlines()[0])["token_ids"]) == 4


@pytest.mark.parametrize(
    "case",
    [
        "non-empty destination",
        "already quantized",
        "no model",
        "group size with w8a8",
        "act order without calibration",
        "calibration text missing",
    ],
)
def test_bad_input_is_one_error_line(case: str, demo: Path, tmp_path: Path) -> None:
    src, dst = demo, tmp_path / "out"
    if case == "non-empty destination":
        dst.mkdir()
        (dst / "x").write_text("")
    elif case == "already quantized":
        first = tmp_path / "first"
        assert tandem("quantize", str(demo), str(first), "--scheme", "w8a8").returncode == 0
        src = first
    elif case == "no model":
        src = tmp_path / "missing"
    extra: tuple[str, ...] = {
        "group size with w8a8": ("--scheme", "w8a8", "--group-size", "32"),
        "act order without calibration": ("--scheme", "w4a16", "--act-order"),
        "calibration text missing": ("--scheme", "w4a16", "--calibration", "/nonexistent.txt"),
    }.get(case, ("--scheme", "w8a8"))
    result = tandem("quantize", str(src), str(dst), *extra)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    said = {
        "non-empty destination": "is not empty",
        "already quantized": "already quantized",
        "no model": "does not exist",
        "group size with w8a8": "apply to --scheme w4a16 only",
        "act order without calibration": "--act-order needs --calibration",
        "calibration text missing": "No such file",
    }[case]
    assert said in result.stderr
