"""Every kernel variant on every machine that can run it: the kernel suites (and a whole
model against transformers) again under ``TANDEM_CPU_ISA`` for each level below this CPU's
own, so an AVX-512 developer's run executes the AVX2 and portable code AVX2 users and old
CPUs run, and an AVX2 machine the portable code. (The suite's own run is the native level.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.core.kernels.cpu.native_build import (
    ISA_LEVELS,
    NATIVE_ISA,
    KernelBuildError,
    build_library,
    expected_path,
    isa_levels,
    selected_isa,
)

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]
# The suites whose kernels a level changes, and one whole-model check end to end.
SUITES = [
    HERE / "test_elementwise_kernels.py",
    HERE / "test_paged_attention.py",
    HERE / "test_prefill_attention.py",
    HERE / "test_avx2_linear.py",
    HERE / "test_grouped_experts.py",
    TESTS / "models" / "test_models_vs_transformers.py",
    # A W8A8 model on the int8 kernel of the level (test_int8_gemm.py builds every level's
    # kernel in one run already).
    TESTS / "models" / "test_quantized_loading.py",
]
# What the level does not change: how libraries are built and cached, and fall-backs.
NOT_PER_LEVEL = "not concurrent_first_builds and not without_a and not refuses"
LOWER = [level.name for level in isa_levels() if level is not NATIVE_ISA]


@pytest.mark.parametrize("level", LOWER)
def test_the_kernel_suites_pass_at_each_lower_isa_level(level: str) -> None:
    isa = ISA_LEVELS[level]
    if expected_path(isa) == expected_path(NATIVE_ISA):
        pytest.skip(f"this CPU's own code path is the {level} one: the suite's run covers it")
    env = {**os.environ, "TANDEM_CPU_ISA": level}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-k", NOT_PER_LEVEL, *map(str, SUITES)],
        capture_output=True, text=True, env=env, cwd=TESTS.parents[2], timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


def test_an_unknown_level_is_refused_naming_the_known_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx9000")
    with pytest.raises(KernelBuildError, match="native, avx2, portable"):
        selected_isa()
    with pytest.raises(KernelBuildError, match="TANDEM_CPU_ISA"):
        build_library(HERE / "nothing.cpp", "nothing", build_dir=tmp_path)


def test_a_lower_level_hides_the_flags_of_what_it_turns_off() -> None:
    portable = ISA_LEVELS["portable"].cpu_flags()
    assert not any(flag.startswith(("avx", "amx")) or flag == "fma" for flag in portable)
    assert not any(f.startswith(("avx512", "amx")) for f in ISA_LEVELS["avx2"].cpu_flags())
    assert ISA_LEVELS["avx2"].cpu_flags() <= NATIVE_ISA.cpu_flags()
