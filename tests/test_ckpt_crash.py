"""Crash consistency: a saver SIGKILLed at random instants never leaves a damaged or half-visible step."""

import multiprocessing
import os
import random
import signal
import sys
import time

import torch

import ckpt
from ckpt import catalog
from ckpt.storage import open_storage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "procs"))
import saver  # noqa: E402
from saver import state_for  # noqa: E402


def _kills() -> int:
    return int(os.environ.get("CKPT_CRASH_KILLS", "200" if os.environ.get("CKPT_SLOW") else "30"))


def test_sigkill_at_random_instants_never_damages_committed_steps(tmp_path):
    root = str(tmp_path / "ck")
    rng = random.Random(1234)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckpt", "saver"])
    start, seen_commits = 0, []
    for kill in range(_kills()):
        log = tmp_path / f"log{kill}"
        log.touch()
        child = ctx.Process(target=saver.main, args=(root, start, str(log)))
        child.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL, child.exitcode
        commits = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("committed")]
        seen_commits += commits

        with ckpt.CheckpointManager(root) as m:
            steps = m.steps()
            if commits:  # every step reported durable is there (or was rotated out by a newer one)
                assert steps and steps[-1] >= commits[-1], (kill, steps, commits)
            target = state_for(0)
            restored = m.restore(target)
            assert restored == (steps[-1] if steps else None), (kill, steps, restored)
            if restored is not None:
                expected = state_for(restored)
                for key in ("model", "opt"):
                    for name, t in expected[key].items():
                        assert torch.equal(target[key][name], t), (kill, restored, key, name)
                assert target["step"] == restored
        storage = open_storage(root)
        for s in steps:
            problems = list(catalog.verify(storage, s))
            assert not problems, (kill, s, problems)
        start = (steps[-1] + 1) if steps else start
    assert seen_commits, "the kills never let a single save commit: the test exercises nothing"
    assert len(set(seen_commits)) >= 5
