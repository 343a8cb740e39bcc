"""The CPU kernel libraries are built at start-up, beside the weight loading, and in place
before ``/health`` first answers 200; the log says which kernel serves which layer. Without
a compiler the server still serves, after one warning that says what runs slower and how to
fix it, and ``tandem doctor`` says the same."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from harness import MODEL_NAME, ServerFactory

from tandem.core.kernels.cpu import native_build
from tandem.core.kernels.cpu.native_build import selected_isa


def _libraries(cache: Path) -> set[str]:
    return {path.name.split("-")[0] for path in cache.glob("*.so")}


def test_the_kernels_are_built_before_the_server_is_ready(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    # The suite's own kernel cache (an empty one costs every library's build again, some
    # 20 s; test_without_a_compiler... starts from an empty one): the log shows that the
    # report, which comes once every library is in place, precedes readiness.
    cache = native_build.kernel_cache_dir()
    # start_server returns at the first 200 from /health.
    server = start_server()
    built = _libraries(cache)
    assert {
        "libtandem_elementwise",
        "libtandem_paged_attention",
        "libtandem_prefill_attention",
    } <= built
    flags = selected_isa().cpu_flags()
    if {"avx2", "fma"} <= flags:
        assert built & {"libtandem_avx2_linear", "libtandem_avx512_linear"}
    log = server.log.read_text()
    assert log.count("CPU kernels on") == 1  # once per process, however many workers
    assert "decode attention" in log and "linear float32" in log
    # Nothing is built inside the first request.
    reply = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200
    assert "built the CPU kernels" not in server.log.read_text().split("CPU kernels on", 1)[1]


def _without_compiler(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    # The interpreter is named by its full path; no compiler is on an empty PATH.
    env["PATH"] = str(tmp_path / "empty-path")
    env["TANDEM_KERNEL_CACHE"] = str(tmp_path / "kernels")
    return env


def test_without_a_compiler_one_warning_says_what_is_slower_and_how_to_fix_it(
    tmp_path: Path,
) -> None:
    env = _without_compiler(tmp_path)
    generate = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "generate", "--max-tokens", "4",
         "--prompt", "Once upon a time"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert generate.returncode == 0, generate.stderr[-3000:]
    warnings = [line for line in generate.stderr.splitlines() if " WARNING " in line]
    compiler = [line for line in warnings if "compiler" in line]
    assert len(compiler) == 1, warnings
    assert "decode attention" in compiler[0] and "apt install g++" in compiler[0]
    doctor = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "doctor"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert doctor.returncode == 1
    assert "no C++ compiler" in doctor.stdout and "torch reference" in doctor.stdout


def test_doctor_reports_the_kernels_chosen_and_a_bad_level() -> None:
    doctor = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "doctor"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    assert "CPU kernels on" in doctor.stdout and "native, built for" in doctor.stdout
    assert "int4 linear (W4A16)" in doctor.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "doctor"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "TANDEM_CPU_ISA": "avx9000"},
    )  # fmt: skip
    assert bad.returncode == 2 and "TANDEM_CPU_ISA" in bad.stderr
