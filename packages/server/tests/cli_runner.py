"""The ``tandem`` command run as a user runs it, and the demo model folder it makes, for the
CLI tests (a module of its own: a second ``tests/conftest.py`` would clash with the core
package's under mypy)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def tandem(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def make_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("demo") / "model"
    result = tandem("make-demo-model", str(folder))
    assert result.returncode == 0, result.stderr
    return folder
