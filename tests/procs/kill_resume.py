"""Test driver shared by the trainer integration tests: run a training child straight, killed, and resumed.

A child script takes ROOT OUT.npz MAX_STEPS [HANG_AT], prints "loss STEP HEX ..." lines, prints "hanging ..." once its
saves are durable at HANG_AT (then it is SIGKILLed here), and otherwise writes its final weights and prints "done".
Children run as a user's plain command does: with no launcher run id in their environment (`LAUNCHER`), unless the
test gives one (`env=`), so each attempt is a run of its own and a restart resumes only by the trainer's own resume
(HF's ``resume_from_checkpoint=True``, Lightning's ``ckpt_path="last"``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckpt.run import ENV_IDS, Run, recorded_run
from ckpt.storage import open_storage

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = (*ENV_IDS, "TORCHELASTIC_RESTART_COUNT")  # what torchrun, SLURM or the user set to name a run


def start(
    child: Path,
    root: Path,
    out: Path,
    steps: int,
    hang_at: int | None = None,
    env: Mapping[str, str] | None = None,
    ranks: int = 1,
) -> subprocess.Popen:
    """Start one training attempt as a child process, without the launcher variables of this one (plus `env`);
    `ranks` > 1: as that many CPU ranks under torchrun (standalone: its rendezvous on this machine's loopback)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    launcher += [f"--log-dir={os.devnull}"]  # else an empty torchelastic_* folder in /tmp per attempt
    args = [*(launcher if ranks > 1 else [sys.executable]), str(child), str(root), str(out), str(steps)]
    args += [str(hang_at)] if hang_at else []
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env={**environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def finish(proc: subprocess.Popen, ranks: int = 1) -> list[list[str]]:
    """Read a child's lines; once each of its `ranks` said it is hanging ("hanging [PID]"), SIGKILL each (the child
    itself where no PID is given; torchrun's workers are in sessions of their own); returns the split lines."""
    lines, hanging = [], []
    for line in proc.stdout:
        lines.append(line.split())
        if line.startswith("hanging"):
            hanging.append(int(lines[-1][1]) if len(lines[-1]) > 1 else proc.pid)
            if len(hanging) == ranks:
                for pid in hanging:
                    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=120)
    return lines


def hung(lines: list[list[str]]) -> bool:
    """Whether a child said it was hanging (its saves durable), waiting to be killed."""
    return any(line[:1] == ["hanging"] for line in lines)


def losses(lines: list[list[str]]) -> dict[int, list[str]]:
    """Step -> the losses (float hex) a child printed for it."""
    out: dict[int, list[str]] = {}
    for line in lines:
        if line and line[0] == "loss":
            out.setdefault(int(line[1]), []).append(line[2])
    return out


@dataclass
class Runs:
    """Lines of the uninterrupted, the killed and the resumed attempt, and the two final weight files."""

    straight: list[list[str]]
    killed: list[list[str]]
    resumed: list[list[str]]
    straight_npz: Path
    resumed_npz: Path
    killed_run: Run | None  # the run recorded in the root after the killed attempt, and after the resumed one
    resumed_run: Run | None


def run_of(root: Path) -> Run | None:
    """The run a root's ``run.json`` records (None before its first save)."""
    return recorded_run(open_storage(str(root)))


def run_straight(child: Path, root: Path, out: Path, steps: int) -> list[list[str]]:
    """An uninterrupted run to `steps`, which must end well; its lines."""
    straight = start(child, root, out, steps)
    lines = finish(straight)
    assert straight.returncode == 0 and ["done"] in lines, lines[-5:]
    return lines


def straight_killed_resumed(
    child: Path, tmp: Path, steps: int, kill_at: int, ckpt_root: str = "", straight: tuple[list, Path] | None = None
) -> Runs:
    """An uninterrupted run (beside the first attempt, 2 cores) and a job killed at `kill_at` then resumed; the
    job's checkpoint root is `ckpt_root` below its folder. `straight`: the lines and weights file of an uninterrupted
    run already made (`run_straight` of the same child and steps), which is then not run again."""
    if straight is None:
        proc = start(child, tmp / "straight", tmp / "straight.npz", steps)
    killed = start(child, tmp / "job", tmp / "unused.npz", steps, hang_at=kill_at)
    if straight is None:
        straight_lines = finish(proc)
        assert proc.returncode == 0 and ["done"] in straight_lines, straight_lines[-5:]
        straight = straight_lines, tmp / "straight.npz"
    straight_lines, straight_npz = straight
    killed_lines = finish(killed)
    assert killed.returncode == -signal.SIGKILL and hung(killed_lines), killed_lines[-5:]
    killed_run = run_of(tmp / "job" / ckpt_root)
    resumed = start(child, tmp / "job", tmp / "resumed.npz", steps)
    resumed_lines = finish(resumed)
    assert resumed.returncode == 0 and ["done"] in resumed_lines, resumed_lines[-5:]
    assert min(losses(resumed_lines)) > 1, "the restart trained from step 1: it restored nothing"
    resumed_run = run_of(tmp / "job" / ckpt_root)
    return Runs(straight_lines, killed_lines, resumed_lines, straight_npz, tmp / "resumed.npz", killed_run, resumed_run)


def assert_same_bits(a_path: Path, b_path: Path) -> None:
    """Two weight files hold the same tensors, byte for byte."""
    a, b = np.load(a_path), np.load(b_path)
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key


def assert_reported(root: Path, restored: int, lost_steps: int) -> str:
    """The job's goodput report shows one failure, the lost steps, the restore and a save; returns its text."""
    from ettr import attribute_root, report_text

    report = attribute_root(str(root))
    assert [at.status for at in report.attempts] == ["failed", "ok"]
    assert [at.restored_step for at in report.attempts] == [None, restored]
    assert [at.lost_steps for at in report.attempts] == [lost_steps, 0]
    assert report.failures == 1
    assert report.micros["lost"] > 0 and report.micros["checkpoint_restore"] > 0
    assert report.micros["checkpoint_save"] > 0 and report.micros["downtime"] > 0
    assert sum(report.micros.values()) == report.wall_us
    text = report_text(report)
    assert "failed" in text and "1 failure(s)" in text
    return text


def assert_replayed(root: Path, resumed: list[list[str]], restored: int, killed_at: int) -> None:
    """The resumed attempt trained steps restored+1..killed_at again (the steps whose first pass ended), each bitwise
    equal to its first pass, and its ledger's step records carry the losses it printed (exact bits); the report says
    so."""
    from ettr import attribute_root, read_ledgers, report_text
    from ettr.replay import float_bits

    report = attribute_root(str(root))
    n = killed_at - restored
    assert (report.replay.replayed, report.replay.equal, report.replay.diverged) == (n, n, 0), report.replay
    assert f"replayed {n} step(s): {n} bitwise equal" in report_text(report).splitlines()
    (ledger,) = [l for l in read_ledgers(str(root)) if l.attempt == report.attempts[-1].attempt]
    recorded = {r["s"]: r["l"] for r in ledger.records if r["k"] == "step"}
    printed = {step: float_bits(float.fromhex(hexes[-1])) for step, hexes in losses(resumed).items()}
    assert recorded == printed and len(printed) > n
