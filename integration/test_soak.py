"""A short soak of a real server (the command the long runs use): it must pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_a_short_soak_passes(model_dir: Path, tmp_path: Path) -> None:
    result = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli.main", "bench", "soak", "--model",
         str(model_dir), "--duration", "8", "--concurrency", "8", "--num-blocks", "24",
         "--max-waiting-requests", "4", "--max-prompt", "120", "--result-json", str(result)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Verdict:                          PASS" in done.stdout
    figures = json.loads(result.read_text())
    assert figures["outcomes"]["ok"] > 0 and figures["exit_status"] == 0
    assert set(figures["samples"]) == {"start", "middle", "end"}
