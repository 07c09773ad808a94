"""Per-step overhead of GoodputTracker (step_begin + step_end, flushes amortized): median of repeated runs, in CPU
time of the process (what the step path costs training, robust to other jobs on a shared machine) and wall time.

Each run is a fresh job (its own root): bare steps, steps with a data_wait span, steps whose record carries a digest
(the loss and a batch hash, as the integrations record them), and the same steps trained a second time by a resumed
attempt, each compared with its first pass at the flushes (replay verification, docs/goodput.md).

    .venv/bin/python bench/tracker_overhead.py                     # every variant, 5 runs of 200,000 steps each
    .venv/bin/python bench/tracker_overhead.py bare --runs 1 --steps 1000   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from kit import positive

from ettr import GoodputTracker

STEPS = 200_000  # steps per run; --steps sets it before the inputs below are made
LOSSES: list[float] = []  # made before timing: a float each, as `loss.item()` gives
BATCHES: list[str] = []  # 16 hex digits, as sampler.batch_hash gives


def make_inputs(steps: int) -> None:
    """Set STEPS and precompute the losses and batch hashes the digest variants record (outside the timing)."""
    global STEPS
    STEPS = steps
    LOSSES[:] = [2.0 + 1.0 / (s + 1) for s in range(steps + 1)]
    BATCHES[:] = [f"{s * 2654435761 % 2**64:016x}" for s in range(steps + 1)]


def steps(tr: GoodputTracker, variant: str) -> None:
    """STEPS empty steps of one variant."""
    if variant == "bare":
        for s in range(1, STEPS + 1):
            tr.step_begin(s)
            tr.step_end(s)
    elif variant == "span":
        for s in range(1, STEPS + 1):
            tr.step_begin(s)
            with tr.span("data_wait"):
                pass
            tr.step_end(s)
    else:
        losses, batches = LOSSES, BATCHES
        for s in range(1, STEPS + 1):
            tr.step_begin(s)
            tr.step_end(s, losses[s], batch=batches[s])


def one_run(variant: str) -> tuple[float, float]:
    """Mean (CPU, wall) microseconds per step over STEPS steps of `variant` in a fresh root (for "replay", the second
    attempt: it restores the first attempt's checkpoint of step 0 and trains its steps again)."""
    with tempfile.TemporaryDirectory() as root:
        if variant == "replay":
            first = GoodputTracker(root, attempt_id="a1", flush_interval=5.0).start()  # ids: the order they ran
            first.checkpoint_committed(0, 0.0)
            steps(first, "digest")
            first.end("error")
        tr = GoodputTracker(root, attempt_id="a2", flush_interval=5.0).start()
        tr.checkpoint_restored(0 if variant == "replay" else None)  # "replay": every step is trained again
        cpu, wall = time.process_time(), time.perf_counter()
        steps(tr, variant)
        replay = tr.replay() if variant == "replay" else None  # the comparison of the last flush's steps counts too
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        tr.end()
    assert replay is None or replay.equal == STEPS, replay
    return cpu / STEPS * 1e6, wall / STEPS * 1e6


LABELS = {
    "bare": "step_begin/step_end",
    "span": "step + data_wait span",
    "digest": "step + loss, batch hash",
    "replay": "the same, replayed",
}


def main(argv: list[str] | None = None) -> None:
    """Print the median over --runs runs of each variant named (default: all)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("variants", nargs="*", metavar="VARIANT", help=f"any of {', '.join(LABELS)} (default: all)")
    ap.add_argument(
        "--runs", type=positive(int), default=5, help="fresh jobs per variant (default 5; the median is reported)"
    )
    ap.add_argument("--steps", type=positive(int), default=STEPS, help=f"steps per run (default {STEPS:,})")
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in LABELS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(LABELS)}")
    make_inputs(args.steps)
    for variant in args.variants or list(LABELS):
        cpu, wall = zip(*(one_run(variant) for _ in range(args.runs)))
        print(
            f"{LABELS[variant]:<26} median {statistics.median(cpu):.2f} us/step CPU, {statistics.median(wall):.2f} "
            f"wall  (CPU runs: {', '.join(f'{r:.2f}' for r in cpu)}; {STEPS} steps each, flushes included)"
        )


if __name__ == "__main__":
    main()
