"""One rank of the cluster's fault tests, started by torchrun inside a node of `tests/cluster.py`.

Two tiers as in `cluster_worker.py` (the local tier on the node's tmpfs, the peer replica on the other node), a
state of a few tensors, and for each case of ``--cases`` (save, persist, replicate, sigstop):

1. a save of step 10k+1 that commits (persisted to the durable root);
2. a save of step 10k+2 that stops at the case's gate (``save``: its background write, before the ranks report to
   each other; ``persist``: the persist, after the durable step was begun, before its copy; ``replicate``: before the step
   is sent to the peer; ``sigstop``: before the save), saying ``rank R gate CASE pid P``, until the harness
   creates ``--gates/CASE`` (after taking a link down or stopping a rank); it fails, and the rank says
   ``rank R case CASE failed after S s: TYPE: MESSAGE``, S timed from the gate;
3. once ``--gates/CASE-after`` exists (the link is back): a new manager saves step 10k+3, persisted, and says
   ``rank R case CASE committed 10k+3``.
"""

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ckpt
from ckpt import persist, save, tiers

CASES = ("save", "persist", "replicate", "sigstop")


def say(line: str) -> None:
    """One line in one write (the node's ranks share its log)."""
    os.write(1, f"{line}\n".encode())


class Gate:
    """Holds a rank at one point of a save until the harness lets it through."""

    def __init__(self, folder: Path, rank: int):
        self.folder, self.rank = folder, rank
        self.case: str | None = None
        self.passed: float | None = None

    def __call__(self, case: str) -> None:
        if self.case != case:
            return
        self.case = None  # once per case
        say(f"rank {self.rank} gate {case} pid {os.getpid()}")
        self.wait(case)
        self.passed = time.monotonic()

    def wait(self, name: str) -> None:
        while not (self.folder / name).exists():
            time.sleep(0.01)


def install(gate: Gate) -> None:
    """The gates inside the library's real code paths (each calls through to the real function)."""
    run, layout, transfer = save.SaveJob.run, persist.layout, tiers.transfer

    def gated_run(job, *a, **k):
        gate("save")
        return run(job, *a, **k)

    class GatedLayout:  # every rank's persist reads the local manifest once it began the durable step
        def __getattr__(self, name):
            return getattr(layout, name)

        @staticmethod
        def read_manifest(*a, **k):
            gate("persist")
            return layout.read_manifest(*a, **k)

    def gated_transfer(*a, **k):
        gate("replicate")
        return transfer(*a, **k)

    save.SaveJob.run, persist.layout, tiers.transfer = gated_run, GatedLayout(), gated_transfer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--local-tier", dest="local", required=True)
    p.add_argument("--gates", required=True, type=Path)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    dist.init_process_group("gloo")
    rank, per_node = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(64)}  # replicated: the same on every rank
    options = dict(
        local=args.local,
        persist_every=1000,  # persisted when asked only
        keep_local=2,
        replica_offset=per_node,
        collective_timeout=args.timeout,
    )
    gate = Gate(args.gates, rank)
    install(gate)
    for k, case in enumerate(args.cases.split(","), start=1):
        with ckpt.CheckpointManager(args.root, **options) as m:
            m.save(10 * k + 1, state, persist=True).wait()
            m.wait()
        m = ckpt.CheckpointManager(args.root, **options)
        gate.case, gate.passed = case, None
        try:
            if case == "sigstop":
                gate(case)
            m.save(10 * k + 2, state, persist=case == "persist").wait()
            m.wait()
            say(f"rank {rank} case {case} did not fail")
        except Exception as e:
            took = time.monotonic() - (gate.passed or time.monotonic())
            message = str(e).replace("\n", " ")
            say(f"rank {rank} case {case} failed after {took:.2f} s: {type(e).__name__}: {message}")
        try:
            m.close()
        except Exception:
            pass
        gate.wait(f"{case}-after")
        with ckpt.CheckpointManager(args.root, **options) as m:
            m.save(10 * k + 3, state, persist=True).wait()
            m.wait()
        say(f"rank {rank} case {case} committed {10 * k + 3}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.freeze()
    sys.exit(0)
