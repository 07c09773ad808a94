"""Child processes of the lease and gc tests, forked from a forkserver that has torch and ckpt preloaded.

Each writes what it did, one line at a time, to a log file the test reads: "holding", "ok", "refused: ...",
"lost: ...", "committed N", "failed N: ...", "gc passes N".
"""

import os
import time

import torch

import ckpt
from ckpt import RandomWindowSampler, cli


def _log(path: str):
    return open(path, "a", buffering=1)


def state_for(step: int) -> dict:
    """A small state whose bytes are a function of the step (two tensors, a sampler for `explain`)."""
    g = torch.Generator().manual_seed(step)
    sampler = RandomWindowSampler(10_000, 16, 8, global_batch_size=4, seed=3, rank=0, world_size=1)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(300, generator=g), "data": sampler, "step": step}


def hold(root: str, log_path: str) -> None:
    """Save step 1, then keep the manager (and the root's lease) open until killed."""
    log = _log(log_path)
    m = ckpt.CheckpointManager(root)
    m.save(1, state_for(1)).wait()
    log.write("holding\n")
    time.sleep(600)


def save_once(root: str, step: int, log_path: str) -> None:
    """Try to save one step: "ok", or "refused: <the error>" at once."""
    log = _log(log_path)
    with ckpt.CheckpointManager(root) as m:
        try:
            m.save(step, state_for(step)).wait()
        except ckpt.CheckpointError as e:  # LeaseHeldError
            log.write(f"refused: {e}\n")
            return
    log.write("ok\n")


def save_loop(root: str, start: int, count: int, log_path: str) -> None:
    """Save `count` steps one after the other (keep_last=2), logging each commit or failure, then "done"."""
    log = _log(log_path)
    with ckpt.CheckpointManager(root, keep_last=2) as m:
        for step in range(start, start + count):
            try:
                m.save(step, state_for(step)).wait()
                log.write(f"committed {step}\n")
            except ckpt.CheckpointWriteError as e:
                log.write(f"failed {step}: {e}\n")
    log.write("done\n")


def gc_loop(root: str, stop_path: str, log_path: str) -> None:
    """`python -m ckpt gc ROOT` (the CLI's code, its output in the log) over and over until `stop_path` exists."""
    log = _log(log_path)
    os.dup2(log.fileno(), 1)
    passes = 0
    while not os.path.exists(stop_path):
        cli.main(["gc", root])
        passes += 1
    log.write(f"gc passes {passes}\n")


def hold_kv(url: str, ttl: float, log_path: str) -> None:
    """Hold an object-store lease (tensorstore kvstore at `url`) with a heartbeat; log "lost: ..." if it goes."""
    from ckpt import lease
    from ckpt.errors import LeaseHeldError
    from ckpt.storage import KvStorage, context

    log = _log(log_path)
    held = lease.acquire(KvStorage(url, context()), ttl=ttl)
    log.write(f"holding {held.id}\n")
    while True:
        time.sleep(0.05)
        try:
            held.check()
        except LeaseHeldError as e:
            log.write(f"lost: {e}\n")
            return
