"""The device check (benchmarks/device_check.py) runs under the stand-in: two NPUs on CPU in
one process, Triton under its interpreter. It must start, check every model's greedy tokens
against the CPU float32 path, time the kernels its device chooses, and exit 0; on a CUDA or
NPU machine the same script is the check that matters (docs/ascend.md, "Device check")."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tandem_sim.standin_library import StandinUnavailable, build_standin_library

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None,
        reason="the stand-in runs the Triton kernels under Triton's interpreter: pip install "
        "triton (a test dependency, see tox.ini)",
    ),
]


def test_the_device_check_runs_under_the_standin(tmp_path: Path) -> None:
    try:
        library = build_standin_library(Path(tempfile.gettempdir()) / "tandem-standin")
    except StandinUnavailable as exc:
        pytest.skip(str(exc))
    env = {**os.environ, "TRITON_INTERPRET": "1", "HCCL_SO_PATH": str(library)}
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "standin", "--models-dir", str(tmp_path),
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "passed: 0 token MISMATCH(es) over 3 models" in done.stdout

    record = json.loads((out / "device_check.json").read_text())
    assert record["devices"] == "npu:0,npu:1"
    models = {m["name"]: m for m in record["models"]}
    assert set(models) == {"dense", "hybrid", "moe"}
    for model in models.values():
        assert model["verdicts"], model["name"]
        assert all(v["verdict"] != "MISMATCH" for v in model["verdicts"])
        assert model["output_tok_s"] > 0
    # Every model's kernels were timed, each family against the reference, at both the decode
    # and the prefill step: float32 attention and Gated DeltaNet through Triton, the norms and
    # the experts through torch_npu's ops (its attention ops take half precision only).
    family = {
        (name, kernel["kernel"].split("[")[0], kernel["phase"]): kernel["family"]
        for name, model in models.items()
        for kernel in model["kernels"]
    }
    for name in models:
        for phase in ("decode", "prefill"):
            assert family[(name, f"paged_attention_{phase}", phase)] == "triton"
    assert family[("hybrid", "recurrent_gated_delta_rule", "decode")] == "triton"
    assert family[("hybrid", "chunk_gated_delta_rule", "prefill")] == "triton"
    assert family[("hybrid", "causal_conv1d_prefill", "prefill")] == "triton"
    assert family[("moe", "fused_moe", "decode")] == "torch_npu"
    assert family[("dense", "add_rms_norm", "decode")] == "torch_npu"
    for model in models.values():
        for kernel in model["kernels"]:
            assert kernel["ref_ms"] > 0 and kernel["kernel_ms"] > 0
            # float32 against float32: rounding apart (nan: a kernel that returns nothing).
            assert math.isnan(kernel["max_abs_diff"]) or kernel["max_abs_diff"] < 1e-3
