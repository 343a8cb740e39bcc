"""Quantized checkpoints served on the stand-in NPUs (``python -m tandem_sim.as_npu``), through
torch_npu's quantized matmuls: W8A8 with dynamic and with static activation scales
(``npu_dynamic_quant`` / ``npu_quantize``, ``npu_quant_matmul``), and W4A16 as GPTQ
(symmetric, groups of 32) and as AWQ (zero points) through ``npu_weight_quant_batchmatmul``
over weights packed at load by ``npu_convert_weight_to_int4pack``.

The dense demo, and the hybrid one (Qwen3.5, Gated DeltaNet projections quantized too). Greedy
tokens at TP=1 and TP=2 (one process) are the CPU path's (the C++ int8 and 4-bit kernels),
but for near-ties; the log shows that torch_npu's kernels served the quantized layers (at TP=2 the
row-parallel int8 layers quantize, multiply to int32 and all-reduce the exact sums) and that
the weights were laid out for them at load. In bfloat16: the quantizers take half precision
only."""

from __future__ import annotations

import json
from pathlib import Path

import preloaded_cli
import pytest
from quantized_folders import awq_from_gptq, static_w8a8
from test_npu_standin import PROMPTS, _generate

pytest.importorskip("triton")

DTYPE = "bfloat16"
GROUP = 32
# Inputs beyond +-127 * 0.03 saturate, so the static path's clamp is exercised too.
STATIC_SCALE = 0.03
INT8_TP1 = ["int8_linear"]
INT8_TP2 = ["int8_linear", "int8_quantize", "int8_matmul"]
CASES = {
    "w8a8 dynamic": (INT8_TP1, INT8_TP2),
    "w8a8 static": (INT8_TP1, INT8_TP2),
    "w4a16 gptq sym": (["int4_linear"], ["int4_linear"]),
    "w4a16 awq": (["int4_linear"], ["int4_linear"]),
}


def _tandem(*args: str) -> None:
    done = preloaded_cli.run(list(args), timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("float") / "llm"
    _tandem("make-demo-model", "--kind", "llm", str(folder))
    return folder


def _folder(demo: Path, root: Path, case: str) -> Path:
    if case.startswith("w8a8"):
        _tandem("quantize", str(demo), str(root / "w8a8"), "--scheme", "w8a8")
        if case.endswith("static"):
            return static_w8a8(root / "w8a8", root / "static", STATIC_SCALE)
        return root / "w8a8"
    group = ("--group-size", str(GROUP))
    if case.endswith("sym"):
        _tandem("quantize", str(demo), str(root / "gptq"), "--scheme", "w4a16", *group)
        return root / "gptq"
    _tandem("quantize", str(demo), str(root / "asym"), "--scheme", "w4a16", *group, "--no-sym")
    return awq_from_gptq(root / "asym", root / "awq", GROUP)


# The demo models' next-token distributions are almost flat (the top logprob near -6.5, the
# top two often within 0.05 nats: their weights are random), so bfloat16 rounding in another
# kernel family (torch_npu's int8 and 4-bit matmuls accumulate in their own order) can flip a
# greedy choice that quantization made a near-tie. Where the stand-in's tokens part from the
# CPU's, the CPU path, fed the stand-in's tokens, must find every one of them within
# NEAR_TIE nats of its own first choice. The one flip seen (4-bit hybrid, 4-bit matmuls
# accumulating in another order) is 0.008 nats, a bfloat16 step of a logit; tokens drawn at
# random sit 0.64-1.56 nats below the first choice, as a wrong scale or shard would put them.
NEAR_TIE = 0.1


def _cpu_first_choice_gaps(model: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """For each of ``tokens`` after ``prompt``, how many nats the CPU path's first choice
    there is above it (0 where it is that choice)."""
    ids = ",".join(str(t) for t in prompt + tokens)
    cmd = ["generate", "--model", str(model), "--dtype", DTYPE, "--num-blocks", "64",
           "--max-tokens", "1", "--json", "--prompt-logprobs", "1",
           "--prompt-token-ids", ids]  # fmt: skip
    done = preloaded_cli.run(cmd, timeout_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    positions = json.loads(done.stdout)["prompt_logprobs"][len(prompt) :]
    return [max(p["top"][0][1] - p["logprob"], 0.0) for p in positions]


def _greedy_choices_agree(model: Path, cpu: list[list[int]], other: list[list[int]]) -> None:
    """``other``'s greedy tokens are the CPU path's, but for near-ties (see NEAR_TIE)."""
    for prompt, ours, theirs in zip(PROMPTS, cpu, other, strict=True):
        if ours == theirs:
            continue
        ids = [int(t) for t in prompt.split(",")]
        gaps = _cpu_first_choice_gaps(model, ids, theirs)
        assert max(gaps) <= NEAR_TIE, (
            f"{theirs} parts from the CPU path's {ours} by more than a near-tie: the CPU "
            f"path's first choices are {gaps} nats above them"
        )


def _served_by_torch_npu(log: str, devices: list[str], kernels: list[str]) -> None:
    lines = log.splitlines()
    for device in devices:
        for name in kernels:
            assert any(
                f"registered {name} on {device}: tandem.core.kernels.npu." in line for line in lines
            ), f"{name} did not come from torch_npu's ops on {device}"
    assert "for torch_npu's quantized matmuls" in log


def _standin_npus_equal_the_cpu_path(
    model: Path, kernels: tuple[list[str], list[str]], laid_out: str = ""
) -> None:
    """Greedy tokens at TP=1 and TP=2 (one process) are the CPU path's (but for near-ties),
    with ``kernels``
    (at TP=1, at TP=2) served by torch_npu's ops, and the load step's ``laid_out`` line in
    the log."""
    cpu, _ = _generate("tandem.server.cli.main", model, DTYPE, [])
    tp1_kernels, tp2_kernels = kernels
    one, log = _generate("tandem_sim.as_npu", model, DTYPE, ["--devices", "npu:0"])
    _greedy_choices_agree(model, cpu, one)
    _served_by_torch_npu(log, ["npu:0"], tp1_kernels)
    assert laid_out in log
    two, log = _generate(
        "tandem_sim.as_npu", model, DTYPE, ["--devices", "npu:0,npu:1", "--single-process"]
    )
    _greedy_choices_agree(model, cpu, two)
    _served_by_torch_npu(log, ["npu:0", "npu:1"], tp2_kernels)


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_models_on_standin_npus_equal_the_cpu_path(
    demo: Path, tmp_path: Path, case: str
) -> None:
    _standin_npus_equal_the_cpu_path(_folder(demo, tmp_path, case), CASES[case])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("float") / "qwen3_5"
    _tandem("make-demo-model", "--kind", "qwen3_5", str(folder))
    return folder


# Each scheme's quantized layers of the hybrid demo (three Gated DeltaNet layers, one gated
# attention layer, four MLPs), by the layers the engine fuses: W8A8 quantizes every
# projection (b and a in in_proj_qkvz, both pairs being int8); 4-bit leaves in_proj_b and
# in_proj_a float (4 outputs, under a packed word), in in_proj_ba apart.
HYBRID_CASES = {
    "w8a8": ("laid out 16 int8 and 0 4-bit weights", INT8_TP1, INT8_TP2),
    "w4a16": ("laid out 0 int8 and 16 4-bit weights", ["int4_linear"], ["int4_linear"]),
}


@pytest.mark.parametrize("scheme", sorted(HYBRID_CASES))
def test_a_quantized_hybrid_model_on_standin_npus_equals_the_cpu_path(
    hybrid: Path, tmp_path: Path, scheme: str
) -> None:
    """Qwen3.5 written by ``tandem quantize``, its Gated DeltaNet projections quantized too:
    the q/k/v/z sections cut per rank with their scales, out_proj row-parallel."""
    model = tmp_path / scheme
    group = ("--group-size", str(GROUP)) if scheme == "w4a16" else ()
    _tandem("quantize", str(hybrid), str(model), "--scheme", scheme, *group)
    laid_out, tp1, tp2 = HYBRID_CASES[scheme]
    _standin_npus_equal_the_cpu_path(model, (tp1, tp2), laid_out)
