"""Every code block of README.md and docs/*.md runs as written, or is marked not runnable with a reason.

Blocks are extracted by `doc_blocks` (directives: see its docstring). Each markdown file runs in one fresh
interpreter in an empty directory, with PYTHONPATH at the repository root and `python` on PATH being this
interpreter, as a reader who copies the blocks in order would run them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import doc_blocks

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def run_doc(path: Path, tmp: Path, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    """Run one markdown file's blocks the way a reader would: a fresh interpreter, an empty directory."""
    cwd = Path(tempfile.mkdtemp(dir=tmp))
    bin_dir = cwd / ".bin"  # `python` in the docs' commands is this interpreter (a symlink would lose its venv)
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }  # one torch thread: tiny models on a shared machine, no oversubscription
    work = cwd / "work"
    work.mkdir()
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "doc_blocks.py"), str(path)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_block_is_runnable_or_skipped_with_a_reason():
    found = [p for path in DOCS for p in doc_blocks.problems(doc_blocks.parse(path))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_doc_runs_as_written(path, tmp_path):
    proc = run_doc(path, tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]


# -- the mechanism itself: it must catch what it is for -----------------------------------------------------------


def test_unmarked_output_skip_without_reason_and_dangling_directive_are_problems(tmp_path):
    md = tmp_path / "x.md"
    text = (
        "```\nsome output\n```\n\n"
        "<!-- doc-test: skip -->\n```python\nx = 1\n```\n\n"
        "<!-- doc-test: prelude=nope -->\n```python\nx = 1\n```\n\n"
        "<!-- doc-test: replace=absent -> present -->\n```python\nx = 1\n```\n\n"
        "```python\nf(x=1, ...)\n```\n\n"
        "<!-- doc-test: frobnicate=1 -->\n```bash\ntrue\n```\n\n"
        "<!-- doc-test: skip: a reason -->\nprose, no block\n"
    )
    found = doc_blocks.problems(doc_blocks.parse(md, text))
    assert [f.split(":", 2)[1] for f in found] == ["25", "29", "1", "6", "11", "16", "20"], found
    assert "unknown directive 'frobnicate'" in found[0] and "not followed by a code block" in found[1]
    assert "cannot run" in found[2] and "without a reason" in found[3] and "prelude 'nope'" in found[4]
    assert "does not occur" in found[5] and "does not compile" in found[6]


def test_console_and_bash_commands_are_split_per_line():
    console = doc_blocks.Block(Path("x.md"), 1, "console", "$ echo a \\\n  b\na b\n$ true  # ok\n")
    bash = doc_blocks.Block(Path("x.md"), 1, "bash", "# comment\necho 1   # note\n\nls runs\n")
    assert doc_blocks.commands(console) == ["echo a    b", "true  # ok"]
    assert doc_blocks.commands(bash) == ["echo 1   # note", "ls runs"]


def test_a_failing_block_fails_the_file_and_names_its_line(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPT_REQUIRE_EXTRAS", raising=False)  # the block needing a missing module is skipped here
    md = tmp_path / "x.md"
    md.write_text(
        "<!-- doc-test: skip: output -->\n```\n1\n```\n\n"
        "<!-- doc-test: requires=no_such_module_here -->\n```python\n1 / 0\n```\n\n"
        "```python\nimport os\n```\n\n"
        "```bash\ntrue\nfalse  # fails\n```\n\n```python\nos.getcwd()\n```\n"
    )
    proc = run_doc(md, tmp_path)
    assert proc.returncode == 1
    assert "skip x.md:7: no_such_module_here not installed" in proc.stdout
    assert "ok x.md:11" in proc.stdout and "FAILED x.md:15 (bash block)" in proc.stdout
    assert "`false  # fails` exited with status 1" in proc.stdout
    md.write_text("```python\nimport os\n```\n\n```python\nos.getcwd()  # each block imports what it uses\n```\n")
    proc = run_doc(md, tmp_path)
    assert proc.returncode == 1 and "FAILED x.md:5" in proc.stdout and "NameError: name 'os'" in proc.stdout


def test_a_prelude_gives_its_objects_not_its_imports(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "<!-- doc-test: prelude=goodput_training -->\n```python\ntrain(next(loader))\nprint(total)\n"
        "torch.zeros(1)\n```\n"
    )
    proc = run_doc(md, tmp_path)
    assert proc.returncode == 1 and proc.stdout.startswith("1000\n") and "NameError: name 'torch'" in proc.stdout
