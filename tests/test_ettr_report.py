"""The CLI (report, plot, advise, simulate) on a scripted job, and the OpenTelemetry configure helper."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from ettr import FakeClock, GoodputMetrics, GoodputTracker, attribute_root, configure_metrics, metric_totals

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scripted_job(root: str) -> None:
    """An 8-hour job on a fake clock: 20 s steps, a 30 s save every 45 steps, two crashes, restarts of minutes."""
    clock = FakeClock(1_700_000_000.0)
    plan = [(0.0, 180.0, None, 1, 410), (9_000.0, 240.0, 405, 406, 800), (19_500.0, 200.0, 765, 766, 1290)]
    for k, (at, startup, resume, first, last) in enumerate(plan):
        clock.set(1_700_000_000.0 + at)
        tr = GoodputTracker(root, attempt_id=f"a{k}", rank=0, clock=clock, flush_interval=600.0).start()
        clock.advance(startup)
        with tr.span("checkpoint_restore"):
            clock.advance(60.0 if resume else 2.0)
        tr.checkpoint_restored(resume)
        for s in range(first, last + 1):
            with tr.step(s):
                if s % 10 == 0:
                    with tr.span("data_wait"):
                        clock.advance(4.0)
                clock.advance(20.0)
            if s % 45 == 0:
                with tr.span("checkpoint_save", step=s):
                    clock.advance(30.0)
                tr.checkpoint_committed(s, 90.0)
        tr.flush()
        if k == len(plan) - 1:
            tr.end()


# What scripted_job must come to, worked out by hand from its plan (not from the attribution code):
# steps 1-1290 are kept (405 by a0, 406-765 by a1, 766-1290 by a2); a0 re-runs 406-410 and a1 766-800 (lost);
# a data_wait of 4 s on every 10th step run (41 + 40 + 53), a 30 s save after every 45th (9 + 8 + 11 = 28 commits).
EXPECTED = {
    "productive": 1290 * 20.0,
    "checkpoint_save": 28 * 30.0,
    "checkpoint_restore": 2.0 + 60 + 60,
    "startup": 180.0 + 240 + 200,
    "lost": (5 + 35) * 20.0,
    "data_wait": (41 + 40 + 53) * 4.0,
    "other": 0.0,
}
WALL = 19_500.0 + 200 + 60 + 525 * 20 + 53 * 4 + 11 * 30  # a2 starts at 19500 s and runs to the job's end
EXPECTED["downtime"] = (9_000.0 - (180 + 2 + 410 * 20 + 41 * 4 + 9 * 30)) + (
    19_500.0 - (9_000 + 240 + 60 + 395 * 20 + 40 * 4 + 8 * 30)
)
ATTEMPTS = [
    ("a0", "failed", "None", "1-410", 5, 405 * 20.0, 5 * 20.0),
    ("a1", "failed", "405", "406-800", 35, 360 * 20.0, 35 * 20.0),
    ("a2", "ok", "765", "766-1290", 0, 525 * 20.0, 0.0),
]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("job"))
    scripted_job(root)
    return root


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ettr", *args], capture_output=True, text=True, cwd=REPO)


def test_report_json_matches_attribution(job):
    out = cli("report", job, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    a = attribute_root(job)
    assert report["seconds"] == pytest.approx(a.seconds) == EXPECTED
    assert sum(report["seconds"].values()) == pytest.approx(report["wall_seconds"]) == WALL
    assert report["failures"] == 2 and [x["lost_steps"] for x in report["attempts"]] == [5, 35, 0]
    assert report["advice"]["mttf_failures"] == 2


def test_report_text_gives_the_numbers_of_the_job(job):
    out = cli("report", job)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    table = {line[:20].strip(): line[20:].split() for line in lines[1:11]}
    assert {cat: float(v[0]) for cat, v in table.items() if cat in EXPECTED} == EXPECTED
    assert {cat: v[1] for cat, v in table.items() if cat in EXPECTED} == {
        c: f"{v / WALL:.2%}" for c, v in EXPECTED.items()
    }
    assert float(table["wall time"][0]) == WALL and float(table["background ckpt"][0]) == 28 * 90.0
    ettr = re.search(
        r"ETTR ([\d.]+) cumulative, ([\d.]+) over the last 3600 s; (\d+) failure\(s\); committed steps: "
        r"45 \.\.\. 1260 \(28\)",
        out.stdout,
    )
    assert ettr and float(ettr[1]) == round(EXPECTED["productive"] / WALL, 4) and int(ettr[3]) == 2, out.stdout
    assert float(ettr[2]) == round(attribute_root(job).ettr_window(), 4)
    rows = [line.split() for line in lines[lines.index(next(l for l in lines if l.startswith("attempt"))) + 1 :][:3]]
    assert [(r[0], r[1], r[2], r[3], int(r[4]), float(r[5]), float(r[6])) for r in rows] == ATTEMPTS
    assert "recommended interval" in out.stdout


def test_plot_draws_each_category_as_long_as_its_seconds(job, tmp_path):
    """The PNG renders; the same plot as SVG (text kept as text) has, per attempt row, bars whose lengths are the
    attempt's seconds per category, and a title with the job's ETTR, wall time and failures."""
    from ettr.report import COLORS

    png = tmp_path / "timeline.png"
    out = cli("plot", job, "-o", str(png))
    assert out.returncode == 0, out.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000

    (tmp_path / "matplotlibrc").write_text("svg.fonttype: none\n")
    svg = tmp_path / "timeline.svg"
    out = subprocess.run(
        [sys.executable, "-m", "ettr", "plot", job, "-o", str(svg)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "MATPLOTLIBRC": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    ns = {"s": "http://www.w3.org/2000/svg"}
    axes = ET.parse(svg).getroot().find(".//s:g[@id='axes_1']", ns)
    frame = [float(x) for x in re.findall(r"[\d.]+", axes.find("s:g[@id='patch_2']/s:path", ns).get("d"))]
    seconds_per_unit = WALL / (max(frame[0::2]) - min(frame[0::2]))  # the x axis spans the job's wall time
    category = {color: cat for cat, color in COLORS.items()}
    bars: dict[float, dict[str, float]] = {}  # row (its y centre) -> category -> seconds
    for group in axes.findall("s:g", ns):
        if group.get("id", "").startswith("PolyCollection"):
            for path in group.findall("s:path", ns):
                xy = [float(v) for v in re.findall(r"[\d.]+", path.get("d"))]
                cat = category[re.search(r"fill: (#[0-9a-f]{6})", path.get("style"))[1]]
                row = bars.setdefault(round((min(xy[1::2]) + max(xy[1::2])) / 2, 3), {})
                row[cat] = row.get(cat, 0.0) + (max(xy[0::2]) - min(xy[0::2])) * seconds_per_unit
    a = attribute_root(job)
    expected_rows = [{c: v / 1e6 for c, v in at.micros.items() if v} for at in a.attempts] + [
        {"downtime": EXPECTED["downtime"]}
    ]
    drawn = [bars[y] for y in sorted(bars)]  # top to bottom: attempt 1, 2, 3, then downtime
    assert [sorted(r) for r in drawn] == [sorted(r) for r in expected_rows]
    for got, want in zip(drawn, expected_rows):
        assert got == pytest.approx(want, abs=0.05)
    titles = [t.text for t in axes.iter("{http://www.w3.org/2000/svg}text") if t.text and t.text.startswith("ETTR")]
    assert titles == [f"ETTR {EXPECTED['productive'] / WALL:.3f} over {WALL / 3600:.2f} h, 2 failure(s)"]


def test_plot_writes_the_path_it_is_given_and_prints_the_one_it_wrote(job, tmp_path):
    """`-o t` wrote t.png (matplotlib appends .png) but printed `t`. Now it writes `t` exactly, as PNG, and an
    existing directory gets timeline.png inside; what is printed is the file written."""
    bare, dot, folder = tmp_path / "t", tmp_path / "u.", tmp_path / "plots"  # `-o u.` wrote u.png, printed u.
    folder.mkdir()
    for given, written in ((bare, bare), (dot, dot), (folder, folder / "timeline.png")):
        out = cli("plot", job, "-o", str(given))
        assert out.returncode == 0, out.stderr
        assert out.stdout == f"{written}\n" and written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots", "t", "u."]  # no t.png, u.png, plots.png beside


def test_a_plot_of_a_job_of_no_wall_time_is_drawn_without_a_warning(tmp_path):
    """An attempt that died right after its start record (wall time 0): plot printed matplotlib's 'warning: Attempting
    to set identical low and high xlims makes transformation singular; automatically expanding.' beside the file."""
    GoodputTracker(str(tmp_path), attempt_id="a0", rank=0, clock=FakeClock(1000.0)).start().flush()
    png = tmp_path / "t.png"
    out = cli("plot", str(tmp_path), "-o", str(png))
    assert (out.returncode, out.stdout, out.stderr) == (0, f"{png}\n", "")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install_in_one_line(job, tmp_path, monkeypatch, capsys):
    """matplotlib is an extra (`[plot]`): without it plot ended in a ModuleNotFoundError traceback."""
    import ettr.cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` finds where it is not installed
    code = ettr.cli.main(["plot", job, "-o", str(tmp_path / "t.png")])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == "error: plot needs matplotlib, which is not installed: pip install 'ckpt-goodput[plot]'\n"
    assert not (tmp_path / "t.png").exists()


def test_a_report_without_commits_says_none_were_committed(tmp_path):
    """'committed steps: ' ended the ETTR line with nothing after it, where the line below says 'retained none'."""
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(tmp_path), attempt_id="a0", rank=0, clock=clock).start()
    with tr.step(1):
        clock.advance(1.0)
    tr.end()
    out = cli("report", str(tmp_path))
    assert "; 0 failure(s); committed steps: none\n  retained none; deleted since" in out.stdout, out.stdout


def test_a_plot_of_many_attempts_keeps_a_readable_height_and_labels_every_kth_row(tmp_path):
    """A row per attempt grew the figure without bound (2,000 attempts: a PNG 121,000 pixels tall, 19 s). Past
    MAX_PLOT_ROWS the rows share that height and every k-th is labelled, from attempt 1; every attempt is drawn."""
    from ettr.report import MAX_PLOT_ROWS, plot_timeline

    (tmp_path / "ettr").mkdir()
    n, t = 3 * MAX_PLOT_ROWS, 0
    for k in range(n):  # attempts of 2 one-second steps each, all but the last failed, 1 s apart
        lines = [{"k": "start", "t": t, "job": "j", "attempt": f"a{k:04d}", "rank": 0, "pid": 1, "host": "h", "v": 2}]
        lines += [{"k": "step", "s": 2 * k + s, "b": t + s * 10**6, "e": t + (s + 1) * 10**6, "o": s} for s in (1, 2)]
        lines.append({"k": "end", "t": t + 3 * 10**6, "status": "ok" if k == n - 1 else "error"})
        (tmp_path / "ettr" / f"ledger-a{k:04d}-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        t += 4 * 10**6
    a = attribute_root(str(tmp_path))
    assert len(a.attempts) == n
    png = plot_timeline(a, str(tmp_path / "t.png"))
    header = open(png, "rb").read(24)
    height = int.from_bytes(header[20:24], "big")  # the PNG's IHDR: width, then height
    assert height <= (1.6 + 0.55 * MAX_PLOT_ROWS) * 110, height

    (tmp_path / "matplotlibrc").write_text("svg.fonttype: none\n")
    svg = tmp_path / "t.svg"
    out = subprocess.run(
        [sys.executable, "-m", "ettr", "plot", str(tmp_path), "-o", str(svg)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "MATPLOTLIBRC": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    labels = [t.text for t in ET.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}text") if t.text]
    rows = [x for x in labels if x.startswith("attempt ")]
    assert rows == [f"attempt {k + 1}" for k in range(0, n, 4)], rows  # 121 rows with downtime's: every 4th
    assert "downtime" in labels


def test_plot_to_a_missing_folder_is_an_error_naming_it_as_export_says_it(job, tmp_path):
    """A missing parent folder: one line naming the folder (it named the file, after drawing it), as `ckpt export`
    says it; neither makes folders."""
    (tmp_path / "file").write_text("not a folder")
    a_b = tmp_path / "a" / "b"
    for given, parent, written, what in (
        (f"{a_b}/c.png", a_b, f"{a_b}/c.png", "no such folder"),
        (f"{a_b}/", a_b, f"{a_b}/timeline.png", "no such folder"),  # meant as a folder, which is not there
        (f"{tmp_path}/file/c.png", tmp_path / "file", f"{tmp_path}/file/c.png", "not a folder"),
    ):
        res = cli("plot", job, "-o", given)
        assert res.returncode == 2 and res.stdout == "", res
        assert res.stderr == (
            f"error: {parent}: {what} (the parent of the output {written}); plot creates no folders: make it first\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def _file_size_limit(limit: int):
    """A child's preexec_fn: files past `limit` bytes fail with EFBIG (SIGXFSZ ignored), as a full disk fails them."""

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_files


def test_a_plot_that_cannot_be_written_whole_leaves_the_previous_file_and_names_it(job, tmp_path):
    """A disk that filled up while plot wrote: the previous timeline.png was cut to the bytes that fitted (an image
    that does not open) and the error named no file ('[Errno 27] File too large'). The plot is written beside it and
    renamed over it when whole: the previous file stays, no temporary one is left, and the error names the output."""
    png = tmp_path / "timeline.png"
    assert cli("plot", job, "-o", str(png)).returncode == 0
    before = png.read_bytes()
    res = subprocess.run(
        [sys.executable, "-m", "ettr", "plot", job, "-o", str(png)],
        capture_output=True,
        text=True,
        cwd=REPO,
        preexec_fn=_file_size_limit(len(before) // 2),
    )
    assert res.returncode == 2 and res.stdout == "", res
    assert res.stderr.startswith(f"error: {png}: the plot could not be written (") and "File too large" in res.stderr
    assert png.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["timeline.png"]
    devnull = cli("plot", job, "-o", os.devnull)  # a device is written as it is, never replaced by a file
    assert devnull.returncode == 0 and os.path.isfile(os.devnull) is False, devnull
    (tmp_path / "latest.png").symlink_to(png)  # a link stays a link: its target gets the plot
    assert cli("plot", job, "-o", str(tmp_path / "latest.png")).returncode == 0
    assert os.readlink(tmp_path / "latest.png") == str(png) and png.read_bytes() == before


def test_rank_selects_whose_ledger_is_reported(tmp_path):
    """Two ranks of one attempt: rank 1 waits 5 s for data before each of its 4 steps. `--rank` picks the ledger;
    without it the lowest rank's; a rank without a ledger is an error."""
    for rank in (0, 1):
        clock = FakeClock(1000.0)
        tr = GoodputTracker(
            str(tmp_path), job_id="j", attempt_id="a0", rank=rank, clock=clock, flush_interval=0
        ).start()
        clock.advance(10.0)
        for step in range(1, 5):
            with tr.step(step):
                if rank == 1:
                    with tr.span("data_wait"):
                        clock.advance(5.0)
                clock.advance(20.0)
        tr.end()
    seen = {}
    for args in ((), ("--rank", "0"), ("--rank", "1")):
        out = cli("report", str(tmp_path), "--json", *args)
        assert out.returncode == 0, out.stderr
        seen[args] = {k: v for k, v in json.loads(out.stdout)["seconds"].items() if v}
    assert seen[()] == seen[("--rank", "0")] == {"startup": 10.0, "productive": 80.0}
    assert seen[("--rank", "1")] == {"startup": 10.0, "data_wait": 20.0, "productive": 80.0}
    out = cli("report", str(tmp_path), "--rank", "7")  # said "no ledger for rank 7": of which root, which ranks?
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: no ledger of rank 7 in {tmp_path}/ettr: it holds ledgers of rank 0, 1"


def test_advise_and_simulate():
    out = cli("simulate", "--interval", "600", "--write", "10", "--restart", "300", "--mttf", "20000", "--json")
    assert out.returncode == 0, out.stderr
    sim = json.loads(out.stdout)
    assert sim["simulated"] == pytest.approx(sim["expected_exact"], rel=0.01)


def test_bad_ledger_names_file_and_line(tmp_path):
    scripted_job(str(tmp_path))
    path = tmp_path / "ettr" / "ledger-a1-rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = '{"k":"step","s":1}\n'
    path.write_text("".join(lines))
    out = cli("advise", str(tmp_path))
    assert out.returncode == 2
    assert "ledger-a1-rank0.jsonl:2:" in out.stderr and "lacks" in out.stderr


def test_configure_metrics_in_memory(tmp_path):
    provider, reader = configure_metrics("memory", set_global=False)
    clock = FakeClock(0.0)
    tr = GoodputTracker(str(tmp_path), clock=clock, metrics=GoodputMetrics(provider.get_meter("t"))).start()
    clock.advance(1.0)
    with tr.span("checkpoint_restore"):
        clock.advance(0.5)
    tr.checkpoint_restored(None)
    with tr.step(1):
        clock.advance(2.0)
    tr.end()
    seen = metric_totals(reader)
    assert seen["seconds"] == {"startup": 1.0, "checkpoint_restore": 0.5, "productive": 2.0}
    assert seen["ettr"]["cumulative"] == pytest.approx(2.0 / 3.5)
    assert seen["ettr.checkpoint_restore.duration"] == {"count": 1, "sum": 0.5}
    with pytest.raises(ValueError, match="unknown exporter"):
        configure_metrics("carrier-pigeon")


def two_tier_job(root: str) -> None:
    """Three attempts on a fake clock: 10 s steps, a 2 s local save every 6 steps, every 3rd persisted; a crash the
    local tier survives (restore 5 s from it), then a node loss (restore 50 s from the durable tier)."""
    clock = FakeClock(0.0)
    plan = [(0.0, None, None, 1.0, 1, 40), (500.0, 36, "local", 5.0, 37, 80), (1600.0, 72, "durable", 50.0, 73, 100)]
    for k, (at, resume, tier, restore_s, first, last) in enumerate(plan):
        clock.set(at)
        tr = GoodputTracker(root, attempt_id=f"a{k}", rank=0, clock=clock, flush_interval=600.0).start()
        clock.advance(20.0)
        with tr.span("checkpoint_restore"):
            clock.advance(restore_s)
        tr.checkpoint_restored(resume, tier=tier)
        for s in range(first, last + 1):
            with tr.step(s):
                clock.advance(10.0)
            if s % 6 == 0:
                with tr.span("checkpoint_save", step=s):
                    clock.advance(2.0)
                tr.checkpoint_committed(s, 1.0, tier="local")
                if s % 18 == 0:
                    tr.checkpoint_committed(s, 30.0, tier="durable")
        tr.flush()
    tr.end()


# By hand: a0 ends at 20 + 1 + 40 * 10 + 6 * 2 = 433, a1 at 500 + 20 + 5 + 44 * 10 + 7 * 2 = 979, a2 at
# 1600 + 20 + 50 + 28 * 10 + 4 * 2 = 1958; overhead per failure = downtime + startup = (67 + 20 + 621 + 20) / 2;
# running time 1958 - 688 = 1270 s with one failure of each class.
TWO_TIER_FIT = {
    "restart_overhead_s": 364.0,
    "local_write_s": 2.0,
    "persist_s": 30.0,
    "local_read_s": 5.0,
    "durable_read_s": 50.0,
    "local_mttf_s": 1270.0,
    "node_mttf_s": 1270.0,
}


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("tiered"))
    two_tier_job(root)
    return root


def test_advise_prints_both_intervals_and_the_gain_from_the_ledger(tiered):
    from ettr import TwoTierCosts, optimal_two_tier

    out = cli("advise", tiered, "--persist-cost", "30", "--json")
    assert out.returncode == 0, out.stderr
    two = json.loads(out.stdout)["two_tier"]
    assert two["values"] == pytest.approx(TWO_TIER_FIT)
    assert two["failure_classes"] == {"local": 1, "node": 1, "unclassified": 0} and two["missing"] == []
    assert two["sources"]["persist_s"] == "given (--persist-cost)"
    assert two["sources"]["durable_read_s"] == "ledger: mean of 1 restore(s) from durable"
    f = TWO_TIER_FIT
    plan = optimal_two_tier(
        TwoTierCosts(2.0, 30.0, 364.0 + 5.0, 364.0 + 50.0, f["local_mttf_s"], f["node_mttf_s"]), min_interval_s=10.0
    )
    assert two["plan"]["interval_s"] == pytest.approx(plan.interval_s)
    assert two["plan"]["persist_every"] == plan.persist_every > 1
    assert two["plan"]["gain"] == pytest.approx(plan.gain) and plan.gain > 0
    text = cli("advise", tiered, "--persist-cost", "30").stdout
    assert (
        f"two-tier plan: local every {plan.interval_s:.1f} s (~{round(plan.interval_s / 10)} steps), durable every "
        f"{plan.persist_every} local saves ({plan.durable_interval_s:.1f} s) -> expected ETTR {plan.ettr:.4f}"
    ) in text
    assert (
        f"best single tier: every {plan.single_interval_s:.1f} s (~{round(plan.single_interval_s / 10)} steps) to "
        f"the durable tier -> expected ETTR {plan.single_ettr:.4f}; two tiers gain {plan.gain:+.4f}"
    ) in text
    # flags override the ledger
    two = json.loads(cli("advise", tiered, "--local-read", "1", "--node-mttf", "86400", "--json").stdout)["two_tier"]
    assert (two["values"]["local_read_s"], two["values"]["node_mttf_s"], two["values"]["persist_s"]) == (1, 86400, 0)
    assert two["sources"]["node_mttf_s"] == "given (--node-mttf)"


def test_report_shows_restores_per_tier_and_failure_classes(tiered, job):
    out = cli("report", tiered)
    assert out.returncode == 0, out.stderr
    assert "restores per tier: local 1 (5.000 s), durable 1 (50.000 s)" in out.stdout
    assert "failures by class: 1 the local tier survived, 1 it did not (node), 0 unclassified" in out.stdout
    assert "two-tier plan: local every" in out.stdout
    report = json.loads(cli("report", tiered, "--json").stdout)
    assert report["restores_per_tier"] == {
        "local": {"restores": 1, "seconds": 5.0},
        "durable": {"restores": 1, "seconds": 50.0},
    }
    one_tier = cli("report", job).stdout  # a one-tier ledger: no tier lines, no two-tier advice
    assert "restores per tier" not in one_tier and "two tiers" not in one_tier


def test_advise_names_what_a_one_tier_ledger_cannot_tell(job):
    out = cli("advise", job)
    assert out.returncode == 0, out.stderr
    assert (
        "no two-tier plan: the ledger does not tell --local-read, --local-mttf, --node-mttf (pass them)" in out.stdout
    )
    out = cli("advise", job, "--local-read", "5", "--local-mttf", "7200", "--node-mttf", "86400")
    assert out.returncode == 0 and "two tiers gain +" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    "flag,value,says",
    [
        ("--persist-cost", "-1", "'-1' must be a finite non-negative number of seconds"),
        ("--local-read", "nan", "'nan' must be a finite non-negative number of seconds"),
        ("--node-mttf", "0", "'0' must be a finite positive number of seconds"),
        ("--local-mttf", "inf", "'inf' must be a finite positive number of seconds"),
        ("--local-write", "fast", "could not convert string to float: 'fast'"),
    ],
)
def test_advise_bad_two_tier_input_names_the_flag_and_value(job, flag, value, says):
    out = cli("advise", job, flag, value)
    assert out.returncode == 2 and f"argument {flag}: {says}" in out.stderr, out.stderr


def test_advise_names_the_flag_whose_restore_and_the_ledgers_overhead_overflow(job):
    # each flag is within the cap, but with the ledger's restart overhead a restart is not: the error names the flag,
    # not the plan's internal field
    tiers = ("--local-mttf", "7200", "--node-mttf", "86400")
    for read, other in (("--local-read", "--durable-read"), ("--durable-read", "--local-read")):
        out = cli("advise", job, read, "1e10", other, "1", *tiers)
        assert out.returncode == 2 and f"1e+10 s, given ({read})) plus the restart overhead" in out.stderr, out.stderr
        assert "restart_s" not in out.stderr


def test_simulate_two_tiers():
    out = cli(
        "simulate", "--interval", "370", "--persist-every", "5", "--write", "5", "--persist-cost", "20",
        "--local-restart", "60", "--restart", "600", "--local-mttf", "14400", "--node-mttf", "86400", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    sim = json.loads(out.stdout)
    assert sim["simulated"] == pytest.approx(sim["expected_exact"], rel=0.01)
    assert (sim["optimal_persist_every"], round(sim["optimal_interval"])) == (5, 369)
    assert sim["gain"] == pytest.approx(sim["optimal_ettr"] - sim["single_ettr"]) and sim["gain"] > 0.04
    for args, says in [
        (("--local-mttf", "14400"), "two tiers need --local-mttf and --node-mttf, and not --mttf"),
        (("--local-mttf", "1", "--node-mttf", "1", "--mttf", "5"), "two tiers need"),
        ((), "simulate needs --mttf (one tier), or --local-mttf and --node-mttf (two tiers)"),
        (("--mttf", "5", "--persist-every", "0"), "argument --persist-every: must be a positive integer, got '0'"),
        # simulated one tier, as if the two-tier flags had been taken
        (("--mttf", "1000", "--persist-every", "5"), "--persist-every: two-tier flags, and --mttf simulates one tier"),
        (
            ("--mttf", "1000", "--local-restart", "5", "--persist-cost", "0"),
            "--local-restart, --persist-cost: two-tier",
        ),
    ]:
        out = cli("simulate", "--interval", "370", *args)
        assert out.returncode == 2 and says in out.stderr, out.stderr
