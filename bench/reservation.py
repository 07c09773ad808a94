"""Reservation benchmark: what the background reservation of a fresh job's staging arena costs the training
that starts meanwhile.

A fresh job's `restore` finds nothing to resume and reserves the arena for the state (allocates it and faults
its pages in) on the writer thread, so that the first save copies into warm memory. Faulting in 2 GiB took
0.15-7 s in this VM (slowest for memory the host had not backed yet). Per fresh child process:

- restore s: the fresh-start `restore` call (the reservation goes on after it returns);
- reserve s: from the restore call until the arena is faulted in;
- kept x: a training stand-in's steps/s during the reservation / its idle steps/s just after;
- max step ms: its worst step during the reservation.

The stand-in's step is bench/interference.py's (a matmul and some Python) plus its activations: a fresh 32 MiB
tensor, which the allocator maps and unmaps each step, as a CPU step's large tensors are. Variants, interleaved:
`touch` (ckpt's: a zero byte written to each page, 4 MiB at a time, without the GIL) and `populate` (the
mechanism before: ``MADV_POPULATE_WRITE`` over the whole arena in one call). The kernel holds the process's
memory-map lock for the range of one such call, and every mmap, munmap or thread start of another thread waits
for it; a page fault holds it for one fault at most.

    .venv/bin/python bench/reservation.py                      # 2 GiB, 3 children per variant
    .venv/bin/python bench/reservation.py --sizes 1,2 --rounds 5
    .venv/bin/python bench/reservation.py --quick              # 0.25 GiB, 1 child each (~30 s)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from interference import Trainer, interleaved, parse_or_run_child, spawn  # noqa: E402  (the interference benchmark's)
from kit import build_state, positive, positives  # noqa: E402

VARIANTS = ("touch", "populate")
ACTIVATIONS = 32 << 20


class AllocatingTrainer(Trainer):
    """The interference stand-in, plus a fresh activation tensor each step (mapped and unmapped by the allocator)."""

    def step(self) -> None:
        import torch

        torch.empty(ACTIVATIONS, dtype=torch.uint8)[:: 1 << 20] = 1  # a few pages touched, then freed
        super().step()


def populate_in_one_call(fresh, stop) -> None:
    """The mechanism before: MADV_POPULATE_WRITE (Linux >= 5.14) over the whole range, through ctypes (no GIL)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(fresh.ctypes.data, fresh.size, 23) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")


def run_child(args) -> dict:
    import ckpt
    from ckpt import staging

    if args._child == "populate":
        staging._touch = populate_in_one_call
    state = build_state(args.size, args.seed)
    trainer = AllocatingTrainer()
    trainer.rate(0.5)  # warm
    work = tempfile.mkdtemp(dir=args.dir, prefix=f"{args._child}-")
    try:
        with ckpt.CheckpointManager(work) as m:
            t0 = time.perf_counter()
            assert m.restore({"model": state[0], "optim": state[1]}) is None  # a fresh job: reserves in the background
            restore_s = time.perf_counter() - t0
            # done once the writer thread has finished the reservation
            reserved = m._background._writer.submit(lambda: None)
            n, during, worst = trainer.run_until(reserved.done)
            reserve_s = time.perf_counter() - t0
            idle = trainer.rate(1.0)
            capacity = m._background.arena.capacity
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "restore": restore_s,
        "reserve": reserve_s,
        "kept": n / during / idle if during > 0 else 1.0,
        "worst": worst,
        "gib": capacity / (1 << 30),
    }


def child(args, variant: str, size: float) -> dict:
    return spawn(__file__, variant, size, ["--seed", str(args.seed), "--dir", args.dir])


def report(size: float, results: dict[str, list[dict]]) -> str:
    n = len(next(iter(results.values())))
    lines = [
        f"\n{size:g} GiB, medians of {n} fresh processes",
        f"{'variant':<12}{'restore s':>11}{'reserve s':>11}{'kept x':>8}{'max step ms':>13}   reserve s of each",
    ]
    for variant, runs in results.items():
        m = {k: statistics.median(r[k] for r in runs) for k in ("restore", "reserve", "kept", "worst")}
        each = " ".join(f"{r['reserve']:.2f}" for r in runs)
        lines.append(
            f"{variant:<12}{m['restore']:>11.3f}{m['reserve']:>11.2f}{m['kept']:>8.2f}{m['worst'] * 1e3:>13.0f}   {each}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes",
        type=positives(float),
        default=None,
        help="state sizes in GiB, comma separated (default 2; quick 0.25)",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=positive(int), default=3, help="children per variant, interleaved across variants")
    ap.add_argument("--dir", default=None, help="where the roots go (default: a temp dir, deleted after)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 0.25 GiB, one child per variant")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_or_run_child(ap, argv, run_child)
    if args is None:
        return
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}: the variants are {', '.join(VARIANTS)}")
    if args.quick:
        args.sizes, args.rounds = args.sizes or "0.25", 1
    args.sizes = args.sizes or "2"
    for size, results in interleaved(args, variants, child, "ckpt-reservation-"):
        print(report(size, results), flush=True)
    print(
        "\nrestore = the fresh-start restore call; reserve = from it until the arena is faulted in; kept = the "
        "stand-in's steps/s during the reservation / its idle steps/s after; max step = its worst step meanwhile"
    )


if __name__ == "__main__":
    main()
