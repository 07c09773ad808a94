"""The main demo end to end in its --quick size: torchrun, a real SIGKILL, a restart, the report, the PNG, the verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_quick_demo_crashes_resumes_and_proves_determinism(tmp_path):
    run_dir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "examples.lm_demo", "--quick", f"--run-dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "chaos: SIGKILL during the background write" in out
    assert "[chaos attempt 2] resumed from step" in out
    lines = out.rstrip().splitlines()
    png = run_dir.resolve() / "timeline.png"
    assert lines[-2:] == [f"timeline: {png}", "deterministic: yes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1 failure(s)" in out and "recommended interval" in out
