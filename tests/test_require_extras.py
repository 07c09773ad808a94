"""The suite cannot pass by skipping: with CKPT_REQUIRE_EXTRAS=1 a missing optional framework fails its tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
MODULE_LEVEL = 'import pytest\npytest.importorskip("no_such_framework_here")\n\ndef test_a():\n    pass\n'
IN_A_TEST = (
    'import pytest\n\ndef test_b():\n    pytest.importorskip("no_such_framework_here")\n\n'
    'def test_gpu():\n    pytest.skip("needs CUDA")\n'
)


def _pytest(tmp_path: Path, source: str, required: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_x.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CKPT_REQUIRE_EXTRAS"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if required:
        env["CKPT_REQUIRE_EXTRAS"] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "require_extras",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize("required", [False, True])
def test_a_missing_framework_skips_or_fails_loudly(tmp_path, required):
    module, test = _pytest(tmp_path, MODULE_LEVEL, required), _pytest(tmp_path, IN_A_TEST, required)
    if not required:
        assert (module.returncode, test.returncode) == (5, 0), module.stdout + test.stdout  # 5: no test ran
        assert "1 skipped" in module.stdout and "2 skipped" in test.stdout
        return
    message = "CKPT_REQUIRE_EXTRAS=1: could not import 'no_such_framework_here'"
    assert (
        module.returncode == 2
        and message in module.stdout
        and "Interrupted: 1 error during collection" in module.stdout
    )
    assert test.returncode == 1 and message in test.stdout and "1 failed, 1 skipped" in test.stdout  # the GPU one skips


def test_doc_blocks_needing_a_missing_extra_fail_when_extras_are_required(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("<!-- doc-test: requires=no_such_module_here -->\n```python\n1\n```\n")
    env = {**os.environ, "CKPT_REQUIRE_EXTRAS": "1"}
    out = subprocess.run(
        [sys.executable, str(TESTS / "doc_blocks.py"), str(md)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert out.returncode == 1 and "FAILED x.md:2: no_such_module_here not installed" in out.stdout, out.stdout
