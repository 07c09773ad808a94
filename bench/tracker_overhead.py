"""Per-step overhead of GoodputTracker (step_begin + step_end, flushes amortized): median of repeated runs."""

from __future__ import annotations

import statistics
import tempfile
import time

from ettr import GoodputTracker

STEPS = 200_000


def one_run(root: str, with_span: bool) -> float:
    """Mean microseconds per step over STEPS empty steps (optionally with a data_wait span inside each)."""
    tr = GoodputTracker(root, flush_interval=5.0).start()
    t0 = time.perf_counter()
    if with_span:
        for s in range(STEPS):
            tr.step_begin(s)
            with tr.span("data_wait"):
                pass
            tr.step_end(s)
    else:
        for s in range(STEPS):
            tr.step_begin(s)
            tr.step_end(s)
    per_step = (time.perf_counter() - t0) / STEPS * 1e6
    tr.end()
    return per_step


def main() -> None:
    """Print the median over 5 runs, for bare steps and steps with one span."""
    for with_span in (False, True):
        with tempfile.TemporaryDirectory() as root:
            runs = [one_run(root, with_span) for _ in range(5)]
        label = "step + data_wait span" if with_span else "step_begin/step_end"
        print(
            f"{label:<24} median {statistics.median(runs):.2f} us/step  "
            f"(runs: {', '.join(f'{r:.2f}' for r in runs)}; {STEPS} steps each, flushes included)"
        )


if __name__ == "__main__":
    main()
