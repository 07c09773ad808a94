"""The CLI (report, plot, advise, simulate) on a scripted job, and the OpenTelemetry configure helper."""
from __future__ import annotations

import json
import os
import subprocess
import sys

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
    assert report["seconds"] == pytest.approx(a.seconds)
    assert sum(report["seconds"].values()) == pytest.approx(report["wall_seconds"])
    assert report["failures"] == 2 and [x["lost_steps"] for x in report["attempts"]] == [5, 35, 0]
    assert report["advice"]["mttf_failures"] == 2


def test_report_text(job):
    out = cli("report", job)
    assert out.returncode == 0, out.stderr
    for word in ("productive", "lost", "downtime", "wall time", "ETTR", "recommended interval"):
        assert word in out.stdout


def test_plot_renders_png(job, tmp_path):
    png = tmp_path / "timeline.png"
    out = cli("plot", job, "-o", str(png))
    assert out.returncode == 0, out.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


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
