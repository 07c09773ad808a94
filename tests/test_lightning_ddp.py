"""Lightning DDP on CPU (2 ranks, gloo): Lightning saves through CkptCheckpointIO on rank 0 only, so its manager
checkpoints alone; every rank resumes from "last" with rank 0's weights and optimizer state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))

from ckpt import layout  # noqa: E402
from ckpt.storage import open_storage  # noqa: E402
from ettr import attribute_root  # noqa: E402
from kill_resume import LAUNCHER, REPO  # noqa: E402

CHILD = Path(__file__).parent / "procs" / "lightning_ddp.py"
# Lightning's own variables too: a test run under a launcher must not make the child a rank of that job
OUTSIDE = (*LAUNCHER, "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run(root: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    """Run the DDP child (Lightning starts rank 1 from it) to `steps`: its exit code and output.

    A hang (a collective that one rank never joins) fails here after 120 s, killing both ranks."""
    environ = {k: v for k, v in os.environ.items() if k not in OUTSIDE}
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(root), str(steps), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1"},
        start_new_session=True,  # rank 1 is its child: both go with the group
    )
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the DDP fit to step {steps} hung:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def fit(root: Path, steps: int, *extra: str) -> dict[tuple[str, int], tuple[int, str]]:
    """`run` to `steps`, which must succeed; (what, rank) -> (step, weights) printed."""
    done = run(root, steps, *extra)
    out = done.stdout
    assert done.returncode == 0, out[-6000:]
    found = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) == 4 and words[0] in ("start", "end"):
            found[words[0], int(words[1])] = int(words[2]), words[3]
    assert len(found) == 4, out[-6000:]
    return found


def test_ddp_fit_saves_on_rank_0_every_rank_resumes_from_last_and_a_rank_blind_to_the_root_fails_all(tmp_path):
    root = tmp_path / "root"
    first = fit(root, 4)
    assert first["start", 0] == first["start", 1] and first["start", 0][0] == 0
    assert first["end", 0] == first["end", 1] and first["end", 0][0] == 4
    assert layout.committed_steps(open_storage(str(root))) == [4]  # step 2 went with its pointer
    assert sorted(p.name for p in (root / "pointers").iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]

    second = fit(root, 8, "decide")
    # both ranks start from rank 0's step 4, and train on in step (rank 1's Adam state was restored too)
    assert second["start", 0] == second["start", 1] == first["end", 0]
    assert second["end", 0] == second["end", 1] and second["end", 0][0] == 8
    # a DecisionCheckpoint whose decision asked for step 6 on rank 1 alone (a signal seen by one node): saved, as
    # every rank agrees on any rank's answer (rank 0's alone was taken before)
    assert [p.name for p in (root / "decided").iterdir()] == ["epoch=0-step=6.ckpt"]
    assert layout.committed_steps(open_storage(str(root))) == [6, 8]

    # each rank's goodput ledger under its own rank, one per attempt; rank 1 recorded the restore of step 4
    ledgers = sorted(p.name.rsplit("-", 1)[1] for p in (root / "ettr").glob("ledger-*.jsonl"))
    assert ledgers == ["rank0.jsonl", "rank0.jsonl", "rank1.jsonl", "rank1.jsonl"]
    for rank in (0, 1):
        attribution = attribute_root(str(root), rank=rank)
        assert attribution.replay.diverged == 0

    # rank 1 cannot see the root's steps or pointers (a root of its own, as a node-local disk would give it): it
    # started fresh while rank 0 resumed, their models and Adam states differed, and the job hung at its first
    # collective. Every rank now raises at the fit's start, naming each rank's step
    split = run(root, 12, "split")
    assert split.returncode != 0
    assert "start from different steps" in split.stdout and "rank 0 step 8, rank 1 nothing" in split.stdout, (
        split.stdout[-6000:]
    )
    assert layout.committed_steps(open_storage(str(root))) == [6, 8]


def test_ddp_fit_whose_ranks_samplers_differ_is_refused_at_its_start_and_at_a_save(tmp_path):
    """Lightning writes rank 0's checkpoint alone, and GoodputCallback's sampler states are plain dicts in it, which
    no save among ranks compares: a rank 1 whose sampler skipped other items or stood at another position trained
    on other batches, every save committed rank 0's state, and a resume put rank 1 on it unseen (its skips lost).
    Every rank now raises, naming what differs, at the fit's start and at a save."""
    root = tmp_path / "root"
    # rank 1 counts step 3's batch twice: the save of step 2 (the samplers equal) commits, step 4's is refused
    advanced = run(root, 8, "sampled", "advance")
    assert advanced.returncode != 0
    assert "differ from rank 0's at the save of step 4" in advanced.stdout, advanced.stdout[-6000:]
    assert "'train' step: rank 0 has 4, rank 1 has 5" in advanced.stdout, advanced.stdout[-6000:]
    assert layout.committed_steps(open_storage(str(root))) == [2]

    skipped = run(root, 8, "sampled", "skip")  # compared before the resume from step 2 loads rank 0's state
    assert skipped.returncode != 0
    assert "samplers of rank(s) [1] differ from rank 0's at the fit's start" in skipped.stdout, skipped.stdout[-6000:]
    assert "'train' skip: rank 0 has [], rank 1 has [3]" in skipped.stdout, skipped.stdout[-6000:]
    assert layout.committed_steps(open_storage(str(root))) == [2]
