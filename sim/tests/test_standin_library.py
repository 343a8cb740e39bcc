"""The stand-in communicator library is built once per source version and fails to build with
the compiler's own message (its behaviour is tested through the bindings in hw/tests)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest
from tandem_sim.standin_library import StandinUnavailable, build_standin_library


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_built_once_and_exports_both_apis(tmp_path: Path) -> None:
    first = build_standin_library(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_standin_library(tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    lib = ctypes.CDLL(str(first))
    for symbol in (
        "HcclCommInitAll",
        "HcclCommInitRootInfo",
        "ncclCommInitAll",
        "ncclCommInitRank",
    ):
        assert hasattr(lib, symbol)
    assert lib.TandemStandinVersion() >= 1
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_failing_compiler_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing = tmp_path / "cc-that-fails"
    failing.write_text("#!/bin/sh\necho 'no toolchain here' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(StandinUnavailable, match="no toolchain here"):
        build_standin_library(tmp_path / "build")
    assert not list((tmp_path / "build").glob("*.so"))
