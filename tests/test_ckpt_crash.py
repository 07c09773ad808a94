"""Crash consistency: savers, rival writers and gc SIGKILLed at random instants never damage, mix or lose a step."""

import multiprocessing
import os
import random
import signal
import sys
import time

import pytest
import torch

import ckpt
from ckpt import catalog
from ckpt.storage import open_storage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
import saver  # noqa: E402
import writer  # noqa: E402
from child_logs import wait_for  # noqa: E402
from saver import state_for  # noqa: E402


def _kills() -> int:
    return int(os.environ.get("CKPT_CRASH_KILLS", "200" if os.environ.get("CKPT_SLOW") else "30"))


def _rounds() -> int:
    """Rounds of the rival-writer and gc variants (each round kills two processes)."""
    return max(3, _kills() // 5)


@pytest.fixture(scope="module")
def procs():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckpt", "saver", "writer"])
    return ctx


pytestmark = pytest.mark.usefixtures("no_child_left")


def _kill(*procs) -> int:
    """SIGKILL the processes still running, reap all; returns how many were killed."""
    killed = 0
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    for p in procs:
        p.join()
    return killed


def _commits(*logs) -> list[int]:
    return [
        int(line.split()[1]) for log in logs for line in log.read_text().splitlines() if line.startswith("committed")
    ]


def _check(root: str, kill: int, commits: list[int]) -> list[int]:
    """Every step reported durable is there (or rotated out by a newer one); every committed step verifies and
    restores bitwise equal to what exactly one writer saved (never a mix of two). Returns the committed steps."""
    storage = open_storage(root)
    with ckpt.CheckpointManager(root) as m:
        steps = m.steps()
        if commits:
            assert steps and steps[-1] >= max(commits), (kill, steps, commits)
        target = state_for(0)
        assert m.restore(target) == (steps[-1] if steps else None), (kill, steps)
        for s in reversed(steps):
            assert not list(catalog.verify(storage, s)), (kill, s)
            if s != steps[-1]:
                assert m.restore(target, step=s) == s
            expected = state_for(s, target["writer"])
            for key in ("model", "opt"):
                for name, t in expected[key].items():
                    assert torch.equal(target[key][name], t), (kill, s, target["writer"], key, name)
            assert target["step"] == s
    return steps


def test_sigkill_at_random_instants_never_damages_committed_steps(tmp_path, procs):
    root = str(tmp_path / "ck")
    rng = random.Random(1234)
    start, seen_commits = 0, []
    for kill in range(_kills()):
        log = tmp_path / f"log{kill}"
        log.touch()
        child = procs.Process(target=saver.main, args=(root, start, str(log)))
        child.start()
        try:  # the kill window opens at the child's first commit: on a busy machine its start alone can take seconds
            wait_for(log, "committed", 120.0, child)
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            killed = _kill(child)
        assert killed == 1 and child.exitcode == -signal.SIGKILL, child.exitcode
        commits = _commits(log)
        seen_commits += commits
        steps = _check(root, kill, commits)
        start = (steps[-1] + 1) if steps else start
    assert seen_commits, "the kills never let a single save commit: the test exercises nothing"
    assert len(set(seen_commits)) >= 5


def _wait_for_a_commit(logs, children, timeout: float = 120.0) -> None:
    """Until one of the writers logged a commit; fails at once when both have exited without one."""
    deadline = time.monotonic() + timeout
    while not any("committed" in log.read_text() for log in logs):
        assert any(c.is_alive() for c in children), [log.read_text() for log in logs]
        assert time.monotonic() < deadline, f"no writer committed within {timeout:g} s"
        time.sleep(0.02)


def test_two_writers_killed_at_random_instants_never_mix_a_step(tmp_path, procs):
    """Two savers of different states start on one root at nearly the same time: the lease lets one in."""
    root = str(tmp_path / "ck")
    rng = random.Random(99)
    start, kills, refused, seen_commits = 0, 0, 0, []
    for rnd in range(_rounds()):
        logs = [tmp_path / f"w{rnd}-{w}" for w in (1, 2)]
        children = []
        try:
            for w, log in zip((1, 2), logs):
                log.touch()
                children.append(procs.Process(target=saver.main, args=(root, start, str(log), w)))
                children[-1].start()
                time.sleep(rng.uniform(0.0, 0.3))
            _wait_for_a_commit(logs, children)  # the kill window opens at the first commit of either writer
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            kills += _kill(*children)
        for child, log in zip(children, logs):  # killed while writing, or turned away at its first save
            assert child.exitcode == -signal.SIGKILL or (
                child.exitcode == 0 and log.read_text().startswith("refused: ")
            )
        refused += sum(log.read_text().startswith("refused: ") for log in logs)
        commits = _commits(*logs)
        seen_commits += commits
        steps = _check(root, rnd, commits)
        start = (steps[-1] + 1) if steps else start
    assert refused >= 1, "the second writer was never turned away: the test exercises nothing"
    assert kills >= _rounds() and len(set(seen_commits)) >= 3


def test_gc_and_a_saver_killed_at_random_instants_never_damage_committed_steps(tmp_path, procs):
    """`ckpt gc` in a loop beside a saver; each round kills both, in a random order."""
    root = str(tmp_path / "ck")
    rng = random.Random(7)
    start, kills, seen_commits = 0, 0, []
    for rnd in range(_rounds()):
        log, gc_log = tmp_path / f"s{rnd}", tmp_path / f"gc{rnd}"
        log.touch()
        children = [
            procs.Process(target=saver.main, args=(root, start, str(log))),
            procs.Process(target=writer.gc_loop, args=(root, str(tmp_path / "never"), str(gc_log))),
        ]
        for c in children:
            c.start()
        wait_for(log, "committed", 60.0, children[0])  # then the saver is mid-save nearly always: a kill leaves some
        time.sleep(rng.uniform(0.0, 0.5))
        kills += _kill(*rng.sample(children, 2))
        assert [c.exitcode for c in children] == [-signal.SIGKILL] * 2, "a save failed beside gc, or gc did"
        commits = _commits(log)
        seen_commits += commits
        _check(root, rnd, commits)
        # the next saver starts past every step directory: one at a killed save's step would be cleared by that
        # saver's own first save, leaving nothing for gc to remove
        start = max([start - 1] + [e.step for e in catalog.entries(open_storage(root))]) + 1
    removed = sum(gc_log.read_text().count("removed incomplete") for gc_log in tmp_path.glob("gc*"))
    assert removed >= 1, "gc never removed a crashed save's leftovers: the test exercises nothing"
    assert kills == 2 * _rounds() and len(set(seen_commits)) >= 2
