"""The main demo end to end in its --quick size: torchrun, a real SIGKILL, a restart, the report, the PNG, the verdict."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from examples.lm_demo.__main__ import _check, _parser

REPO = Path(__file__).resolve().parent.parent


def run_demo(*argv: str, tmpdir: Path | None = None) -> str:
    """`python -m examples.lm_demo ARGV` (with TMPDIR=`tmpdir` if given); its stdout, once it exited 0."""
    env = {**os.environ, "TMPDIR": str(tmpdir)} if tmpdir else None
    proc = subprocess.run(
        [sys.executable, "-m", "examples.lm_demo", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quick_demo_crashes_resumes_and_proves_determinism(tmp_path):
    run_dir, tmp = tmp_path / "demo", tmp_path / "tmp"
    tmp.mkdir()
    out = run_demo("--quick", f"--run-dir={run_dir}", tmpdir=tmp)
    left = [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]  # but torch's shared cache
    assert not left, f"the demo left {left} in its TMPDIR"
    assert "chaos: SIGKILL during the background write" in out
    assert "[chaos attempt 2] resumed from step" in out
    # the resume trained the steps after its checkpoint again, each bitwise equal to its first pass; the report agrees
    said = re.search(r"^\[chaos attempt 2\] replayed (\d+) step\(s\): (\d+) bitwise equal$", out, re.M)
    assert said and said[1] == said[2] and int(said[1]) > 0, out
    assert f"\nreplayed {said[1]} step(s): {said[1]} bitwise equal\n" in out
    lines = out.rstrip().splitlines()
    png = run_dir.resolve() / "timeline.png"
    assert lines[-2:] == [f"timeline: {png}", "deterministic: yes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1 failure(s)" in out and "recommended interval" in out, out[-4000:]  # a failure shows the report
    # what docs/demo.md calls H: one SHA-256 of the final weights, the same for both runs of this demo
    hashes = re.findall(r"^(reference|resumed) +weights sha256 ([0-9a-f]{64}) after \d+ steps$", out, re.M)
    assert [name for name, _ in hashes] == ["reference", "resumed"] and hashes[0][1] == hashes[1][1], out


def test_the_demo_doc_shows_no_hash_a_reader_cannot_reproduce():
    """The weights' hash depends on the machine (CPU, torch build, BLAS): the doc shows a placeholder, and says that
    what is bitwise is the two runs of one demo on one machine."""
    doc = (REPO / "docs" / "demo.md").read_text()
    assert not re.findall(r"sha256 [0-9a-f]{8,}", doc), "a hash only the machine that made it reproduces"
    assert "reference weights sha256 H after 300 steps" in doc and "resumed   weights sha256 H after 300 steps" in doc
    assert "the two runs of one demo, on one machine, match each\nother" in doc


def test_quick_demo_with_two_tiers_restores_locally_then_from_durable_after_a_node_loss(tmp_path):
    run_dir = tmp_path / "demo"
    local = f"--local={tmp_path / 'nvme'}"
    out = run_demo(
        "--quick", f"--run-dir={run_dir}", local, "--persist-every=2", "--chaos=2", "--node-loss=2", "--compare"
    )
    assert re.search(r"\[chaos attempt 2\] resumed from step \d+ \(local tier\)", out), out
    assert "chaos: SIGKILL in step" in out and "and the node is lost" in out
    assert re.search(r"\[chaos attempt 3\] resumed from step \d+ \(durable tier\)", out), out
    replays = r"^\[chaos attempt [23]\] (replayed (\d+) step\(s\): \2 bitwise equal|no step trained twice)$"
    assert len(re.findall(replays, out, re.M)) == 2, out  # a kill inside the step after a save replays none
    assert re.search(r"restores per tier: local 1 \(.*\), durable 1 \(", out)
    assert "failures by class: 1 the local tier survived, 1 it did not (node), 0 unclassified" in out
    assert re.search(r"\n\S+ +ok +\d+  durable +\d+-40 ", out), out  # the attempt table: where each restore read
    assert "two-tier plan: local every" in out and "best single tier" in out
    assert "the same chaos at the same durable interval (10 steps):" in out
    assert re.search(r"one tier, every 10 steps +ETTR [\d.]+ +lost", out)
    assert out.rstrip().endswith("deterministic: yes")


def processes_naming(text: str) -> list[int]:
    """The ids of the live processes whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # it ended meanwhile
            pass
    return pids


def test_a_demo_stopped_by_sigterm_stops_its_torchrun_and_worker_first(tmp_path):
    """SIGTERM to the demo while a run trains (a scheduler, `kill`, `timeout`): torchrun and its worker end before the
    demo exits, rather than train on, orphaned, into the run directory."""
    run_dir = tmp_path / "demo"
    argv = ["--quick", f"--run-dir={run_dir}", "--steps=1000000", "--log-every=1000000"]
    demo = subprocess.Popen(
        [sys.executable, "-m", "examples.lm_demo", *argv], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        for line in demo.stdout:
            if "[reference attempt 1] fresh start" in line:  # the worker trains
                break
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(timeout=120)
        survivors = processes_naming(str(run_dir))
        assert not survivors, f"still running after the demo exited: {survivors}"
        assert code == 128 + signal.SIGTERM  # the status of a shell's command that SIGTERM ended
    finally:
        demo.kill()
        for pid in processes_naming(str(run_dir)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "flag, said",
    [
        ("--chaos=-1", "argument --chaos: must be >= 0, got -1"),
        ("--steps=0", "argument --steps: must be >= 1, got 0"),
        ("--every=0", "argument --every: must be >= 1, got 0"),
        ("--threads=0", "argument --threads: must be >= 1, got 0"),
        ("--context=1", "argument --context: must be >= 2, got 1"),
        ("--persist-every=0", "argument --persist-every: must be >= 1, got 0"),
        ("--batch=x", "argument --batch: invalid int value: 'x'"),
        ("--d-model=30", "--d-model must be a multiple of 4 (the attention heads), got 30"),
        ("--corpus-mb=0", "--corpus-mb 0.0 holds fewer bytes than one window (--context + 1 = 65)"),
        ("--local=runs/demo/", "--local runs/demo is --run-dir: each run's local tier would be its durable root"),
    ],
)
def test_a_demo_flag_out_of_range_is_refused_naming_it_before_any_run(flag, said, capsys):
    """Not seconds later as a worker's traceback under torchrun's (after the whole reference run, for --local), nor
    (--chaos=-1) as a complaint about --node-loss."""
    parser = _parser()
    with pytest.raises(SystemExit) as refused:
        _check(parser, parser.parse_args([flag]))
    assert refused.value.code == 2 and said in capsys.readouterr().err
