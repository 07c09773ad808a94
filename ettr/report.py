"""Text/JSON report of an attribution, and a Gantt-style timeline plot (matplotlib imported lazily, Agg backend)."""

from __future__ import annotations

import json
import os
import secrets
from typing import Any

from .advice import Advice
from .attribution import CATEGORIES, DOWNTIME, Attribution
from .ledger import TIERS
from .stragglers import Stragglers

COLORS = {
    "productive": "#2ca02c",
    "checkpoint_save": "#1f77b4",
    "checkpoint_restore": "#9467bd",
    "startup": "#ff7f0e",
    "lost": "#d62728",
    "downtime": "#7f7f7f",
    "data_wait": "#bcbd22",
    "other": "#c7c7c7",
}


def _ordered(micros: dict[str, int]) -> list[str]:
    """The fixed categories first, then custom span categories alphabetically."""
    return [c for c in CATEGORIES if c in micros] + sorted(c for c in micros if c not in CATEGORIES)


def report_text(a: Attribution, advice: Advice | None = None, stragglers: Stragglers | None = None) -> str:
    """A table per category, one line per attempt, ETTR, the ranks' step times and stragglers, and the advice."""
    wall = a.wall_us
    tiered = any(at.restored_tier is not None for at in a.attempts)  # a "from" column: the tier each restore read
    from_column = f"{'  from':<10}" if tiered else ""
    lines = [f"{'category':<20}{'seconds':>14}{'share':>9}"]
    for cat in _ordered(a.micros):
        lines.append(f"{cat:<20}{a.micros[cat] / 1e6:>14.6f}{a.micros[cat] / wall if wall else 0:>9.2%}")
    lines += [
        f"{'wall time':<20}{wall / 1e6:>14.6f}{1:>9.2%}",
        f"{'background ckpt':<20}{a.background_us / 1e6:>14.6f}   (beside the sum: overlaps training)",
        _split_line(a),
        "",
        f"ETTR {a.ettr:.4f} cumulative, {a.ettr_window():.4f} over the last {a.window_s:g} s; "
        f"{a.failures} failure(s); committed steps: {_steps(a.committed_steps) or 'none'}",
        f"  retained {_steps(a.retained_steps) or 'none'}; deleted since (retention, delete()): "
        f"{_steps(a.deleted_steps) or 'none'}",
        _restore_line(a),
        *_tier_lines(a),
        *_replay_lines(a),
        "",
        f"{'attempt':<32}{'status':<9}{'restored':>9}{from_column}{'steps':>12}{'lost':>6}"
        f"{'productive s':>14}{'lost s':>10}",
    ]
    for at in a.attempts:
        span = f"{at.first_step}-{at.last_step}" if at.steps else "-"
        tier = f"{'  ' + (at.restored_tier or '-'):<10}" if tiered else ""
        lines.append(
            f"{at.attempt[:31]:<32}{at.status:<9}{str(at.restored_step):>9}{tier}{span:>12}{at.lost_steps:>6}"
            f"{at.micros.get('productive', 0) / 1e6:>14.3f}{at.micros.get('lost', 0) / 1e6:>10.3f}"
            + ("  (torn last line dropped)" if at.torn else "")
        )
    if stragglers is not None:
        lines += ["", *_straggler_lines(stragglers)]
    if advice is not None:
        lines += ["", advice.text()]
    return "\n".join(lines)


SHOWN = 8  # ranks and windows the text report lists at most (the slowest ranks, the last windows); --json has all


def _straggler_lines(s: Stragglers) -> list[str]:
    """Each rank's step times (the slowest SHOWN), the slowest rank of the last SHOWN windows, the time waited."""
    ranks = sorted(s.ranks, key=lambda r: (-r.busy_us, r.rank))[:SHOWN]
    hidden = len(s.ranks) - len(ranks)
    lines = [
        f"{'rank':<6}{'steps':>8}{'step s':>12}{'busy s':>12}{'coll. wait s':>14}{'ideal step s':>14}"
        f"{'deviation s':>13}" + (f"  (the {SHOWN} busiest of {len(s.ranks)} ranks)" if hidden else "")
    ]
    for r in ranks:
        ideal = "-" if r.ideal_step_us is None else f"{r.ideal_step_us / 1e6:.6f}"
        deviation = "-" if r.deviation_us is None else f"{r.deviation_us / 1e6:.6f}"
        lines.append(
            f"{r.rank:<6}{r.steps:>8}{r.step_us / 1e6:>12.3f}{r.busy_us / 1e6:>12.3f}{r.wait_us / 1e6:>14.3f}"
            f"{ideal:>14}{deviation:>13}"
        )
    if not s.windows:
        return lines + ["slowest rank per window: needs the ledgers of two ranks or more"]
    shown = s.windows[-SHOWN:]
    earlier = len(s.windows) - len(shown)
    lines.append(
        f"slowest rank per {s.window}-step window (busy s; the other ranks' median; waited s)"
        + (f", the last {SHOWN} of {len(s.windows)}:" if earlier else ":")
    )
    for w in shown:
        steps = f"steps {w.first_step}-{w.last_step}"
        lines.append(
            f"  {steps:<20}rank {w.slowest_rank:<6}{w.slowest_busy_us / 1e6:>12.3f}{w.others_busy_us / 1e6:>12.3f}"
            f"{w.waited_us / 1e6:>12.3f}"
        )
    per_rank = s.waited_per_rank_us()
    lines.append(
        f"waiting for the slowest rank: {s.waited_us / 1e6:.3f} s of the job's time over {len(s.windows)} window(s); "
        f"most for rank {s.slowest_rank} ({per_rank[s.slowest_rank] / 1e6:.3f} s)"
    )
    return lines


def _restore_line(a: Attribution) -> str:
    """How many restores of a step and their mean: `Attribution.mean_restore_s`, the advice's T_read too."""
    mean = a.mean_restore_s()
    n = len(a.restores())
    return f"restores of a step: {n}" + (f", mean {mean:.3f} s (T_read)" if mean is not None else "")


def _split_line(a: Attribution) -> str:
    """How checkpoint_save's seconds split, per save, and the background write beside them (not badput)."""
    split = {part: us / 1e6 for part, us in a.checkpoint_split_us.items()}
    return (
        f"checkpoint_save = stall {split['stall']:.6f} s + waiting for the previous save "
        f"{split['previous_wait']:.6f} s + optimizer steps waiting for an overlapped snapshot "
        f"{split['overlap_wait']:.6f} s; {a.saves} save(s); background write {a.background_us / 1e6:.6f} s "
        "(not badput)"
    )


def _replay_lines(a: Attribution) -> list[str]:
    """The steps trained again after a resume, against their first pass (none when no step was trained twice)."""
    text = a.replay.text()
    return text.splitlines() if text else []


def _tier_lines(a: Attribution) -> list[str]:
    """Restores and restore seconds per tier and the failures per class, when the ledgers name tiers."""
    tiers = a.restores_per_tier
    if not any(tier is not None for tier in tiers):
        return []
    order = [t for t in TIERS if t in tiers] + [t for t in tiers if t not in TIERS]
    per_tier = ", ".join(f"{t or 'untiered'} {tiers[t][0]} ({tiers[t][1]:.3f} s)" for t in order)
    classes = a.failure_classes
    return [
        f"restores per tier: {per_tier}",
        f"failures by class: {classes['local']} the local tier survived, {classes['node']} it did not (node), "
        f"{classes['unclassified']} unclassified",
    ]


def _steps(steps: tuple[int, ...]) -> str:
    """A short list of steps."""
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]} ... {steps[-1]} ({len(steps)})"


def report_json(a: Attribution, advice: Advice | None = None, stragglers: Stragglers | None = None) -> str:
    """The attribution (and the ranks' step times and stragglers, and the advice) as JSON."""
    out: dict[str, Any] = a.to_dict()
    if stragglers is not None:
        out["stragglers"] = stragglers.to_dict()
    if advice is not None:
        out["advice"] = advice.to_dict()
    return json.dumps(out, indent=2)


def plot_timeline(a: Attribution, path: str, *, title: str | None = None) -> str:
    """Draw attempts as rows of colored category bars over time, failures marked, cumulative ETTR on a second axis.

    Writes exactly `path` (an existing directory: `path`/timeline.png), in the format its extension names (.png,
    .svg, .pdf, ...) or PNG when it has none, and returns the path written: matplotlib alone would write ``t.png``
    for ``t``, a file the caller was never told of. A missing parent folder is an error naming it, as for
    ``ckpt export``: neither makes folders; so is an extension no format has (``t.v2``), before drawing."""
    path = os.fspath(path)
    if os.path.isdir(path) or path.endswith(os.sep):  # a folder, or one meant (`-o plots/`)
        path = os.path.join(path, "timeline.png")
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):  # checked before drawing; a typo in a path makes no folders
        error, what = (
            (NotADirectoryError, "not a folder") if os.path.exists(parent) else (FileNotFoundError, "no such folder")
        )
        raise error(f"{parent}: {what} (the parent of the output {path}); plot creates no folders: make it first")
    try:
        import matplotlib
    except ImportError as err:  # an extra, not a dependency
        raise ImportError("plot needs matplotlib, which is not installed: pip install 'ckpt-goodput[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    scale, unit = _time_unit(a.wall_us / 1e6)
    t0 = a.start_us
    n = len(a.attempts)
    # rows beyond MAX_PLOT_ROWS share the height of that many (a row per attempt grew the figure without bound:
    # 2,000 attempts drew a PNG 121,000 pixels tall in 19 s)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.55 * min(n + 1, MAX_PLOT_ROWS)))
    ext = os.path.splitext(path)[1][1:]
    formats = fig.canvas.get_supported_filetypes()
    if ext and ext.lower() not in formats:  # before drawing (seconds for thousands of attempts), naming the file
        plt.close(fig)
        raise ValueError(
            f"{path}: no image format has the extension .{ext}; give one of .{', .'.join(sorted(formats))} "
            "(or none, for PNG)"
        )
    boxes, colors = [], []  # one collection for all bars and one line for all failures: an artist each took 53 s
    for s in a.segments:  # and 1.4 GB for 2,000 attempts
        row = n - s.attempt - 1 if s.attempt != DOWNTIME else -1
        x0, x1 = (s.begin_us - t0) / 1e6 / scale, (s.end_us - t0) / 1e6 / scale
        boxes.append([(x0, row - 0.35), (x0, row + 0.35), (x1, row + 0.35), (x1, row - 0.35)])
        colors.append(COLORS.get(s.category, "#17becf"))
    ax.add_collection(PolyCollection(boxes, facecolors=colors, linewidth=0))
    ax.autoscale_view()
    failed = [((at.end_us - t0) / 1e6 / scale, n - k - 1) for k, at in enumerate(a.attempts) if at.failed]
    if failed:
        size = max(2.0, 11 * min(1.0, MAX_PLOT_ROWS / (n + 1)))  # no larger than a row
        ax.plot(*zip(*failed), marker="X", ls="", color="black", markersize=size, zorder=3)
    labelled = range(0, n, -(-(n + 1) // MAX_PLOT_ROWS))  # every attempt, or every k-th from the first
    ax.set_yticks([-1] + [n - k - 1 for k in labelled], ["downtime"] + [f"attempt {k + 1}" for k in labelled])
    ax.set_ylim(-1.5, n - 0.5)
    ax.set_xlabel(f"time since job start ({unit})")
    ax.set_xlim(0, a.wall_us / 1e6 / scale or 1.0)  # no wall time (died after its start record): one unit, no warning
    curve = a.ettr_curve()
    ettr_ax = ax.twinx()
    ettr_ax.plot([(t - t0) / 1e6 / scale for t, _ in curve], [e for _, e in curve], color="black", lw=1.2)
    ettr_ax.set_ylim(0, 1.05)
    ettr_ax.set_ylabel("cumulative ETTR")
    present = _ordered({s.category: 0 for s in a.segments})
    handles = [Patch(color=COLORS.get(c, "#17becf"), label=c) for c in present]
    handles.append(plt.Line2D([], [], marker="X", color="black", ls="", label="failure"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.08, 0.5), fontsize=8, frameon=False)
    ax.set_title(title or f"ETTR {a.ettr:.3f} over {a.wall_us / 1e6 / scale:.2f} {unit}, {a.failures} failure(s)")
    fig.tight_layout()
    try:
        _save_whole(fig, path, ext.lower() or "png")  # a format given: matplotlib appends no extension
    finally:
        plt.close(fig)
    return path


def _save_whole(fig: Any, path: str, fmt: str) -> None:
    """Write `fig` to `path` whole or not at all: into a new file beside it, renamed over it once written (a full
    disk cut the previous plot to what fitted, an image that does not open); an error names `path`. A device or
    FIFO (`-o /dev/null`) is written as it is: a rename would replace it with a file; a symbolic link stays one."""
    direct = os.path.exists(path) and not os.path.isfile(path)
    real = os.path.realpath(path)  # a link's target gets the plot, as writing through the link gave it
    tmp = os.path.join(os.path.dirname(real), f".{os.path.basename(real)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        if direct:
            fig.savefig(path, dpi=110, format=fmt)
        else:
            with open(tmp, "xb") as f:  # mode 0o666 less the umask, as the plot itself was made
                fig.savefig(f, dpi=110, format=fmt)
            os.replace(tmp, real)
    except OSError as e:
        if not direct and os.path.lexists(tmp):
            os.unlink(tmp)
        raise type(e)(f"{path}: the plot could not be written ({e.strerror or e})") from None


MAX_PLOT_ROWS = 40  # rows of the timeline drawn at full height and each labelled; more share that height


def _time_unit(seconds: float) -> tuple[float, str]:
    """A readable unit for the x axis."""
    if seconds >= 7200:
        return 3600.0, "h"
    if seconds >= 120:
        return 60.0, "min"
    return 1.0, "s"
