"""OpenTelemetry export across a restart: identity, per-attempt counters, job gauges, checkpoint metrics.

Read back through the SDK's InMemoryMetricReader, and through each exporter `configure_metrics` offers, for real: a
Prometheus scrape over HTTP, OTLP/HTTP protobuf sent to a receiver on 127.0.0.1 that decodes it, and the console
exporter's JSON on stdout.
"""

from __future__ import annotations

import contextlib
import gzip
import http.server
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
import warnings

import pytest

from ettr import FakeClock, GoodputTracker, attribute_root, configure_metrics, metric_totals
from ettr.tracker import WINDOW_PARTS

pytest.importorskip("opentelemetry.exporter.prometheus")
from prometheus_client import start_http_server  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

JOB = "job-7"


def crashed_attempt(root: str) -> None:
    """a1 on [1000, 1006): restore of nothing 0.5 s, steps 1-2, save of 2 (0.5 s, committed at 1003), steps 3-5,
    then it dies without an end record."""
    clock = FakeClock(1000.0)
    tr = GoodputTracker(root, job_id=JOB, attempt_id="a1", rank=0, clock=clock, flush_interval=0).start()
    with tr.span("checkpoint_restore"):
        clock.advance(0.5)
    tr.checkpoint_restored(None)
    steps(tr, clock, 1, 2)
    with tr.span("checkpoint_save", step=2):
        clock.advance(0.5)
    tr.checkpoint_committed(2, 1.0, 4096)
    steps(tr, clock, 3, 5)


def steps(tr: GoodputTracker, clock: FakeClock, first: int, last: int) -> None:
    for s in range(first, last + 1):
        tr.step_begin(s)
        clock.advance(1.0)
        tr.step_end(s)


def restarted_attempt(root: str, exporter: str, **options) -> tuple[GoodputTracker, FakeClock, object, object]:
    """a2 from 1100: 2 s of startup, restore of step 2 (1 s) reported to a freshly configured provider."""
    clock = FakeClock(1100.0)
    tr = GoodputTracker(root, job_id=JOB, attempt_id="a2", rank=0, clock=clock, flush_interval=0)
    provider, reader = configure_metrics(exporter, tracker=tr, set_global=False, **options)
    tr.start()
    clock.advance(2.0)
    with tr.span("checkpoint_restore"):
        clock.advance(1.0)
    tr.checkpoint_restored(2)
    return tr, clock, provider, reader


def go_on(tr: GoodputTracker, clock: FakeClock) -> None:
    """a2 continues: steps 3-4, a save of 4 (0.5 s blocking, 2 s in the background, 8 KiB), then 5 s idle."""
    steps(tr, clock, 3, 4)
    with tr.span("checkpoint_save", step=4):
        clock.advance(0.5)
    tr.checkpoint_committed(4, 2.0, 8192)
    clock.advance(5.0)


def test_with_two_tiers_a_persist_is_a_write_series_of_its_own(tmp_path):
    """A step saved locally and then persisted is two writes of one step: the histograms tell them apart by tier,
    so a dashboard neither counts the step's bytes twice nor mixes local and durable write times."""
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(tmp_path), job_id=JOB, attempt_id="a1", rank=0, clock=clock, flush_interval=0)
    provider, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    tr.checkpoint_committed(5, 0.25, 4096, tier="local")
    tr.checkpoint_committed(5, 2.0, 4096, tier="durable")
    tr.checkpoint_committed(6, 0.5, 4096)  # one tier: no tier attribute
    (resource_metrics,) = reader.get_metrics_data().resource_metrics
    points = {
        m.name: {p.attributes.get("ettr.tier"): (p.count, p.sum) for p in m.data.data_points}
        for sm in resource_metrics.scope_metrics
        for m in sm.metrics
        if m.name in ("ettr.checkpoint_write.duration", "ettr.checkpoint.size")
    }
    assert points["ettr.checkpoint_write.duration"] == {"local": (1, 0.25), "durable": (1, 2.0), None: (1, 0.5)}
    assert points["ettr.checkpoint.size"] == {"local": (1, 4096), "durable": (1, 4096), None: (1, 4096)}
    tr.end()
    provider.shutdown()


def test_in_memory_reader_sees_identity_attempt_counters_and_job_gauges(tmp_path):
    root = str(tmp_path)
    crashed_attempt(root)
    tr, clock, provider, reader = restarted_attempt(root, "memory")

    seen = metric_totals(reader)  # right after the restore: the job's newest checkpoint is a1's step 2
    assert (seen["last_step"], seen["age"]) == (2, 100.0)  # committed at 1003, now 1103
    assert seen["failures"] == 1
    assert seen["attempt_seconds"] == pytest.approx({"startup": 2.0, "checkpoint_restore": 1.0})

    go_on(tr, clock)
    seen = metric_totals(reader)
    assert (seen["last_step"], seen["age"]) == (4, 5.0)
    assert seen["ettr.checkpoint_write.duration"] == {"count": 1, "sum": 2.0}
    assert seen["ettr.checkpoint.size"] == {"count": 1, "sum": 8192}
    (live,) = reader.get_metrics_data().resource_metrics
    (age,) = [m for sm in live.scope_metrics for m in sm.metrics if m.name == "ettr.checkpoint.age"]
    assert [dict(p.attributes) for p in age.data.data_points] == [{"ettr.job": JOB, "ettr.rank": 0}]
    tr.end()
    seen = metric_totals(reader)
    # the counter starts from 0 in this process: only a2's own time, nothing of a1 added back at the restart
    assert seen["attempt_seconds"] == pytest.approx(
        {"startup": 2.0, "checkpoint_restore": 1.0, "productive": 2.0, "checkpoint_save": 0.5, "other": 5.0}
    )
    report = attribute_root(root)  # the gauges carry the whole job, as the report does
    assert seen["seconds"] == pytest.approx({k: v / 1e6 for k, v in report.micros.items() if v})
    assert seen["seconds"]["lost"] == pytest.approx(3.0) and seen["seconds"]["productive"] == pytest.approx(4.0)
    assert seen["ettr"]["cumulative"] == pytest.approx(report.ettr)

    (resource_metrics,) = reader.get_metrics_data().resource_metrics
    resource = resource_metrics.resource.attributes
    assert resource["service.name"] == "ckpt-goodput" and resource["service.instance.id"] == "a2-rank0"
    assert (resource["ettr.job"], resource["ettr.attempt"], resource["ettr.rank"]) == (JOB, "a2", 0)
    assert resource["host.name"] == socket.gethostname()
    labels = {
        m.name: {tuple(sorted(p.attributes)) for p in m.data.data_points}
        for sm in resource_metrics.scope_metrics
        for m in sm.metrics
    }
    job, attempt = ("ettr.job", "ettr.rank"), ("ettr.attempt", "ettr.job", "ettr.rank")
    assert labels["ettr.attempt.time"] == {("ettr.attempt", "ettr.category", "ettr.job", "ettr.rank")}
    assert labels["ettr.job.time"] == {("ettr.category", "ettr.job", "ettr.rank")}
    assert labels["ettr.ratio"] == {("ettr.job", "ettr.rank", "ettr.window")}
    assert labels["ettr.job.failures"] == {job} and "ettr.checkpoint.age" not in labels  # ended: no age grows on
    assert labels["ettr.checkpoint.size"] == labels["ettr.checkpoint_save.duration"] == {attempt}
    provider.shutdown()


def test_prometheus_scrape_over_http(tmp_path):
    root = str(tmp_path)
    crashed_attempt(root)
    tr, clock, provider, _ = restarted_attempt(root, "prometheus", service_name="llm-pretrain")
    server, thread = start_http_server(0, addr="127.0.0.1")
    try:
        go_on(tr, clock)
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        thread.join(timeout=10)
        tr.end()
        provider.shutdown()

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))

    def value(name: str, **labels: str) -> float:
        (match,) = [v for got, v in samples[name] if labels.items() <= got.items()]
        return match

    (info,) = samples["target_info"]
    assert {
        k: info[0][k] for k in ("service_name", "service_instance_id", "ettr_job", "ettr_attempt", "ettr_rank")
    } == {
        "service_name": "llm-pretrain",
        "service_instance_id": "a2-rank0",
        "ettr_job": JOB,
        "ettr_attempt": "a2",
        "ettr_rank": "0",
    }
    me = {"ettr_job": JOB, "ettr_rank": "0"}
    assert value("ettr_attempt_time_seconds_total", ettr_category="productive", ettr_attempt="a2", **me) == 2.0
    assert value("ettr_attempt_time_seconds_total", ettr_category="startup", ettr_attempt="a2", **me) == 2.0
    assert value("ettr_job_time_seconds", ettr_category="productive", **me) == 4.0
    assert value("ettr_job_time_seconds", ettr_category="lost", **me) == 3.0
    assert value("ettr_job_time_seconds", ettr_category="downtime", **me) == 94.0  # a1 last record 1006 -> 1100
    assert value("ettr_job_failures", **me) == 1
    assert value("ettr_ratio", ettr_window="cumulative", **me) == pytest.approx(4.0 / 105.5)  # at the last flush
    assert value("ettr_checkpoint_last_step", **me) == 4
    assert value("ettr_checkpoint_age_seconds", **me) == 5.0
    assert value("ettr_checkpoint_size_bytes_sum", ettr_attempt="a2", **me) == 8192
    assert value("ettr_checkpoint_size_bytes_count", ettr_attempt="a2", **me) == 1
    assert value("ettr_checkpoint_write_duration_seconds_sum", ettr_attempt="a2", **me) == 2.0
    assert value("ettr_checkpoint_save_duration_seconds_count", ettr_attempt="a2", **me) == 1


# What the restarted attempt's exporters must report after go_on: (metric, attributes besides job and rank) -> value
EXPORTED = {
    ("ettr.attempt.time", (("ettr.attempt", "a2"), ("ettr.category", "productive"))): 2.0,
    ("ettr.attempt.time", (("ettr.attempt", "a2"), ("ettr.category", "startup"))): 2.0,
    ("ettr.attempt.time", (("ettr.attempt", "a2"), ("ettr.category", "checkpoint_restore"))): 1.0,
    ("ettr.attempt.time", (("ettr.attempt", "a2"), ("ettr.category", "checkpoint_save"))): 0.5,
    ("ettr.job.time", (("ettr.category", "productive"),)): 4.0,
    ("ettr.job.time", (("ettr.category", "lost"),)): 3.0,
    ("ettr.job.time", (("ettr.category", "downtime"),)): 94.0,  # a1's last record at 1006, a2 from 1100
    ("ettr.job.failures", ()): 1,
    ("ettr.ratio", (("ettr.window", "cumulative"),)): 4.0 / 105.5,
    ("ettr.checkpoint.last_step", ()): 4,
    ("ettr.checkpoint.age", ()): 5.0,
}
EXPORTED.update(
    {
        (f"{name}.{part}", (("ettr.attempt", "a2"),)): value  # histograms: count and sum
        for name, count, total in (
            ("ettr.checkpoint.size", 1, 8192.0),
            ("ettr.checkpoint_write.duration", 1, 2.0),
            ("ettr.checkpoint_save.duration", 1, 0.5),
            ("ettr.checkpoint_restore.duration", 1, 1.0),
        )
        for part, value in (("count", count), ("sum", total))
    }
)
IDENTITY = {
    "service.name": "llm-pretrain",
    "service.instance.id": "a2-rank0",
    "ettr.job": JOB,
    "ettr.attempt": "a2",
    "ettr.rank": 0,
}


def _point_key(name: str, attributes: dict) -> tuple:
    assert (attributes.pop("ettr.job"), attributes.pop("ettr.rank")) == (JOB, 0), (name, attributes)
    return name, tuple(sorted(attributes.items()))


def _assert_exported(points: dict, resource: dict) -> None:
    assert {k: resource[k] for k in IDENTITY} == IDENTITY
    got = {k: points.get(k) for k in EXPORTED}
    assert got == pytest.approx(EXPORTED), {k: (got[k], v) for k, v in EXPORTED.items() if got[k] != pytest.approx(v)}


class _OtlpReceiver(http.server.BaseHTTPRequestHandler):
    """A minimal OTLP/HTTP metrics endpoint: decodes each protobuf request, answers with an empty response."""

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        self.server.received.append((self.path, self.headers.get("Content-Type"), request))
        answer = ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args) -> None:
        pass


def _any_value(v):
    return getattr(v, v.WhichOneof("value"))


def test_otlp_http_export_is_received_and_decoded(tmp_path, monkeypatch):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    root = str(tmp_path)
    crashed_attempt(root)
    tr, clock, provider, _ = restarted_attempt(
        root,
        "otlp",
        service_name="llm-pretrain",
        interval_s=3600.0,
        endpoint=f"http://127.0.0.1:{server.server_port}/v1/metrics",
    )
    try:
        go_on(tr, clock)
        assert provider.force_flush(timeout_millis=30_000)
    finally:
        tr.end()
        provider.shutdown()
        server.shutdown()
        thread.join(timeout=10)
    path, content_type, request = server.received[0]
    assert (path, content_type) == ("/v1/metrics", "application/x-protobuf")
    (resource_metrics,) = request.resource_metrics
    resource = {kv.key: _any_value(kv.value) for kv in resource_metrics.resource.attributes}
    points = {}
    for scope in resource_metrics.scope_metrics:
        for metric in scope.metrics:
            data = getattr(metric, metric.WhichOneof("data"))
            for p in data.data_points:
                name, attributes = _point_key(metric.name, {kv.key: _any_value(kv.value) for kv in p.attributes})
                if metric.WhichOneof("data") == "histogram":
                    points[(f"{name}.count", attributes)], points[(f"{name}.sum", attributes)] = p.count, p.sum
                else:
                    points[(name, attributes)] = getattr(p, p.WhichOneof("value"))
    _assert_exported(points, resource)


_CONSOLE_CHILD = """
import sys
from test_ettr_telemetry import crashed_attempt, go_on, restarted_attempt
crashed_attempt(sys.argv[1])
tr, clock, provider, _ = restarted_attempt(sys.argv[1], "console", service_name="llm-pretrain", interval_s=3600.0)
go_on(tr, clock)
print("<<<", flush=True)
provider.force_flush(timeout_millis=30_000)
print(">>>", flush=True)
tr.end()
provider.shutdown()
"""


def test_console_export_prints_the_numbers(tmp_path):
    """The console exporter writes to the process's stdout (bound when the SDK is imported): read it from a child."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _CONSOLE_CHILD, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout.split("<<<\n", 1)[1].split(">>>\n", 1)[0]
    (resource_metrics,) = json.loads(printed)["resource_metrics"]
    points = {}
    for scope in resource_metrics["scope_metrics"]:
        for metric in scope["metrics"]:
            for p in metric["data"]["data_points"]:
                name, attributes = _point_key(metric["name"], dict(p["attributes"]))
                if "count" in p:
                    points[(f"{name}.count", attributes)], points[(f"{name}.sum", attributes)] = p["count"], p["sum"]
                else:
                    points[(name, attributes)] = p["value"]
    _assert_exported(points, resource_metrics["resource"]["attributes"])


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "3"])
def test_the_otlp_export_timeout_is_checked(bad):
    with pytest.raises(ValueError, match="export_timeout_s"):
        configure_metrics("otlp", endpoint="http://127.0.0.1:9/v1/metrics", export_timeout_s=bad, set_global=False)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"interval_s": float("nan")}, "interval_s must be a finite positive number of seconds"),
        ({"interval_s": float("inf")}, "interval_s must be a finite positive number of seconds"),
        ({"interval_s": 0}, "interval_s must be a finite positive number of seconds, .* got 0"),
        ({"exporter": "prometheus", "prometheus_port": -5}, "prometheus_port must be an int from 0 .* got -5"),
        ({"exporter": "prometheus", "prometheus_port": "9464"}, "prometheus_port must be an int .* got '9464'"),
    ],
)
def test_the_export_interval_and_port_are_checked(options, message):
    """interval_s=nan was taken and the SDK's export thread ended at once: no point was ever exported and nothing said
    so; 0 was the SDK's 'interval value 0 is invalid', naming no argument; a port of -5 a socket.gaierror."""
    with pytest.raises(ValueError, match=message):
        configure_metrics(**{"exporter": "console", **options}, set_global=False)


def test_a_prometheus_port_in_use_names_it_and_registers_nothing(tmp_path):
    """Every rank of a host given the docs' one port: all but the first failed with a bare "[Errno 98] Address already
    in use", naming neither the argument nor the port, after a reader had joined the global registry (a retry on
    another port exported every point twice). The error names both and says what to do; nothing is registered."""
    from prometheus_client import REGISTRY

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = set(REGISTRY._collector_to_names)
        tracker = GoodputTracker(str(tmp_path), job_id=JOB, attempt_id="a1", rank=1)
        with pytest.raises(OSError, match=f"prometheus_port {port} cannot be served .*LOCAL_RANK"):
            configure_metrics("prometheus", tracker=tracker, prometheus_port=port, set_global=False)
    assert set(REGISTRY._collector_to_names) == before
    assert not os.listdir(tmp_path)  # nor was the attempt claimed (an empty ledger)


def test_prometheus_port_0_logs_the_port_it_serves(tmp_path, caplog):
    """prometheus_port=0 ("any free port", as the error and the docs' tests say) served /metrics on a port nothing
    told: the port served is logged, and a scrape there answers."""
    tracker = GoodputTracker(str(tmp_path), job_id=JOB, attempt_id="a1", rank=0)
    with caplog.at_level(logging.INFO, logger="ettr.telemetry"):
        provider, _ = configure_metrics("prometheus", tracker=tracker, prometheus_port=0, set_global=False)
    try:
        (port,) = [int(m) for m in re.findall(r"Prometheus metrics on port (\d+)", caplog.text)]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200 and b"# TYPE " in response.read()
    finally:
        provider.shutdown()


def test_a_second_tracker_in_one_process_reports_its_own_checkpoint_and_an_ended_one_none(tmp_path):
    """An integration makes a tracker per train(): the SDK keeps the first registration of an observable gauge and
    dropped the second tracker's callbacks, so the newest step and the age (what the docs say to alert on) stayed
    the first tracker's, which they also kept alive; and an ended tracker's age grew on, paging someone for a job
    that had finished."""
    import gc
    import weakref

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from ettr import GoodputMetrics

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("ettr")
    clock = FakeClock(1000.0)
    first = GoodputTracker(str(tmp_path), job_id=JOB, clock=clock, metrics=GoodputMetrics(meter)).start()
    first.checkpoint_committed(10, 1.0)
    first.end()
    clock.advance(1800)
    assert "age" not in metric_totals(reader) and "last_step" not in metric_totals(reader)  # ended: no age at all
    ended = weakref.ref(first)
    del first
    gc.collect()
    assert ended() is None, "the gauges' callbacks keep no tracker alive"
    second = GoodputTracker(str(tmp_path), job_id=JOB, clock=clock, metrics=GoodputMetrics(meter)).start()
    second.checkpoint_restored(10)
    second.checkpoint_committed(20, 1.0)
    clock.advance(5)
    seen = metric_totals(reader)
    assert (seen["last_step"], seen["age"]) == (20, 5.0)
    second.end()


def test_metrics_handed_to_a_started_tracker_get_the_jobs_failures_commit_and_attempt_time(tmp_path):
    """use_metrics (a provider configured after the tracker's restore): the failures gauge was set once, at the
    restore, and never reached the new provider; the newest checkpoint's step and age were missing until the next
    commit, and the attempt counters started from the switch."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from ettr import GoodputMetrics

    root = str(tmp_path)
    crashed_attempt(root)
    clock = FakeClock(1100.0)
    tr = GoodputTracker(root, job_id=JOB, attempt_id="a2", rank=0, clock=clock, flush_interval=0).start()
    with tr.span("checkpoint_restore"):
        clock.advance(1)
    tr.checkpoint_restored(2)
    steps(tr, clock, 3, 4)
    reader = InMemoryMetricReader()
    tr.use_metrics(GoodputMetrics(MeterProvider(metric_readers=[reader]).get_meter("ettr")))
    steps(tr, clock, 5, 6)
    tr.flush()
    seen = metric_totals(reader)
    report = attribute_root(root)
    assert seen["failures"] == report.failures == 1 and seen["last_step"] == 2
    mine = {k: v / 1e6 for k, v in report.attempts[-1].micros.items() if v}
    assert seen["attempt_seconds"] == pytest.approx(mine)
    tr.end()


def test_a_renamed_attempt_is_exported_under_the_id_its_ledger_records(tmp_path):
    """A requeued job passing its scheduler's id again: the second process's ledger is `slurm-1.2`, and so must be
    the resource made before its start (it named `slurm-1`, the first process's attempt, beside points of
    `slurm-1.2`)."""
    from ettr import read_ledgers

    root = str(tmp_path)
    GoodputTracker(root, job_id=JOB, attempt_id="slurm-1", rank=0, clock=FakeClock(1000.0)).start().end()
    clock = FakeClock(1100.0)
    tr = GoodputTracker(root, job_id=JOB, attempt_id="slurm-1", rank=0, clock=clock, flush_interval=0)
    provider, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    steps(tr, clock, 1, 1)
    tr.end()
    assert tr.attempt_id == "slurm-1.2"
    assert [l.attempt for l in read_ledgers(root)] == ["slurm-1", "slurm-1.2"]
    (resource_metrics,) = reader.get_metrics_data().resource_metrics
    resource = resource_metrics.resource.attributes
    assert (resource["ettr.attempt"], resource["service.instance.id"]) == ("slurm-1.2", "slurm-1.2-rank0")
    on_points = {
        p.attributes["ettr.attempt"]
        for sm in resource_metrics.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
        if "ettr.attempt" in p.attributes
    }
    assert on_points == {"slurm-1.2"}
    provider.shutdown()


@contextlib.contextmanager
def reading_paused(tr: GoodputTracker, restored: int):
    """`tr.checkpoint_restored(restored)` on another thread, its first flush after the resume paused inside its read
    of the earlier attempts' ledgers (at the warning of an empty ledger, read after this attempt's own): the body
    runs while the read is under way; on exit the read goes on and the thread is joined."""
    reading, release = threading.Event(), threading.Event()

    def paused(message, *args):
        reading.set()
        release.wait()

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = paused
        restorer = threading.Thread(target=tr.checkpoint_restored, args=(restored,))
        restorer.start()
        try:
            reading.wait()
            yield
        finally:
            release.set()
            restorer.join()


def test_steps_go_on_while_a_restarted_attempt_reads_the_earlier_ledgers(tmp_path):
    """The first export after a restart reads and attributes every earlier attempt's ledger (3.7 s for 300k steps)
    and held the tracker's lock meanwhile: a training thread's step_end stalled behind a restore or a commit on
    another thread. The read is paused here (an empty ledger's warning, read after this attempt's own) while the
    training thread runs replayed steps; its figures are the report's, and the steps it ran meanwhile are compared
    with their first pass."""
    root = str(tmp_path)
    clock = FakeClock(1000.0)
    a1 = GoodputTracker(root, job_id=JOB, attempt_id="a1", rank=0, clock=clock, flush_interval=0).start()
    a1.checkpoint_restored(None)
    for s in range(1, 6):
        with a1.step(s) as step:
            clock.advance(1.0)
            step.record(float(s))
        if s == 2:
            with a1.span("checkpoint_save", step=2):
                clock.advance(0.5)
            a1.checkpoint_committed(2, 1.0, 4096)
    # a1 dies; a process that died before its start() left an empty ledger, which sorts after a2's
    GoodputTracker(root, job_id=JOB, attempt_id="zz", rank=0).claim_attempt()
    clock = FakeClock(1100.0)
    tr = GoodputTracker(root, job_id=JOB, attempt_id="a2", rank=0, clock=clock, flush_interval=0)
    provider, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    with tr.span("checkpoint_restore"):
        clock.advance(1.0)
    with reading_paused(tr, 2):
        free = tr._lock.acquire(blocking=False)  # what step_begin/step_end take
        if free:
            tr._lock.release()
            for s, loss in ((3, 3.0), (4, 0.5)):  # replayed steps: 3 as its first pass, 4 diverged
                with tr.step(s) as step:
                    clock.advance(1.0)
                    step.record(loss)
    assert free, "the training thread's steps waited for the earlier attempts' attribution"
    with tr.step(5) as step:
        clock.advance(1.0)
        step.record(5.0)
    assert metric_totals(reader)["last_step"] == 2  # a1's commit, read from its ledger
    tr.end()
    seen = metric_totals(reader)
    with pytest.warns(RuntimeWarning, match="empty ledger"):
        report = attribute_root(root)
    assert seen["seconds"] == pytest.approx({k: v / 1e6 for k, v in report.micros.items() if v})
    assert seen["ettr"]["cumulative"] == pytest.approx(report.ettr)
    assert seen["failures"] == report.failures == 1
    assert seen["replay"] == {"steps": 3, "divergences": 1, "first_divergence": 4}
    mine = tr.replay()
    assert (mine.replayed, mine.equal, mine.diverged, mine.first_divergence.step) == (3, 2, 1, 4)
    assert (mine.replayed, mine.diverged) == (report.attempts[-1].replay.replayed, report.attempts[-1].replay.diverged)
    provider.shutdown()


def test_end_waits_for_a_read_of_the_earlier_ledgers_in_progress_on_another_thread(tmp_path):
    """end() on the training thread while another thread reads the earlier attempts' ledgers (its first flush after
    the resume) returned at once: the job's figures came after the metrics had ended (and never, if the process
    exited then). It now returns once the read is done and exported."""
    root = str(tmp_path)
    clock = FakeClock(1000.0)
    a1 = GoodputTracker(root, job_id=JOB, attempt_id="a1", rank=0, clock=clock, flush_interval=0).start()
    a1.checkpoint_restored(None)
    with a1.step(1):
        clock.advance(1.0)
    a1.checkpoint_committed(1, 1.0, 4096)
    GoodputTracker(root, job_id=JOB, attempt_id="zz", rank=0).claim_attempt()  # an empty ledger: a warning, read
    clock = FakeClock(1100.0)
    tr = GoodputTracker(root, job_id=JOB, attempt_id="a2", rank=0, clock=clock, flush_interval=0)
    provider, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    ended = threading.Event()
    ender = threading.Thread(target=lambda: (tr.end(), ended.set()))
    with reading_paused(tr, 1):
        ender.start()
        returned_early = ended.wait(1.0)
    ender.join()
    assert not returned_early, "end() returned while the earlier ledgers were still being read"
    assert tr._prior_done and not tr._loading
    assert metric_totals(reader)["failures"] == 1
    provider.shutdown()


_GLOBAL_LATER_CHILD = r"""
import json, sys
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from ettr import FakeClock, GoodputMetrics, GoodputTracker, metric_totals

root, clock, reader, seen = sys.argv[1], FakeClock(1000.0), InMemoryMetricReader(), []
first = GoodputTracker(root, job_id="job-7", clock=clock).start()  # no metrics=: the global provider's, unset yet
second_metrics = GoodputMetrics()  # made before the provider too (an integration's callback, built early)
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
first.checkpoint_committed(10, 1.0)
first.end()
for step, made in ((20, lambda: None), (30, lambda: GoodputMetrics(metrics.get_meter("ettr")))):
    tracker = GoodputTracker(root, job_id="job-7", clock=clock, metrics=made() or second_metrics).start()
    tracker.checkpoint_restored(step - 10)
    tracker.checkpoint_committed(step, 1.0)
    clock.advance(5)
    totals = metric_totals(reader)
    seen.append([totals.get("last_step"), totals.get("age")])
    tracker.end()
print(json.dumps(seen))
"""


def test_trackers_after_the_first_report_their_checkpoint_when_the_global_provider_is_set_later(tmp_path):
    """The docs say a tracker made without metrics= may have the global provider configured after it exists. The
    API hands out a new proxy meter per call until then, each following the provider set later: the second
    tracker's proxy made the checkpoint gauges again on the same SDK meter, which dropped their callbacks, and so
    did a meter asked of the provider afterwards: ettr.checkpoint.last_step and ettr.checkpoint.age, what the docs
    say to alert on, were missing for every tracker but the first (an integration's next train())."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__))])}
    out = subprocess.run(
        [sys.executable, "-c", _GLOBAL_LATER_CHILD, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [[20, 5.0], [30, 5.0]]


def _restarted_at(root: str, starts_at: float, window_s: float = 3600.0):
    """a1, from 1000 s: steps 1-3 of 1 s, a 0.5 s save of step 3 committed at 1003.5 s, steps 4-5, then it dies (no
    end record) at 1005.5 s. a2's clock starts at `starts_at`: 2 s of startup, a 1 s restore of step 3, steps 4-6,
    a flush. (a2, still open; its metrics as collected then; the report then, over `window_s`)."""
    clock = FakeClock(1000.0)
    first = GoodputTracker(root, job_id=JOB, attempt_id="a1", rank=0, clock=clock, flush_interval=0).start()
    first.checkpoint_restored(None)
    steps(first, clock, 1, 3)
    with first.span("checkpoint_save", step=3):
        clock.advance(0.5)
    first.checkpoint_committed(3, 1.0)
    steps(first, clock, 4, 5)
    clock = FakeClock(starts_at)
    second = GoodputTracker(root, job_id=JOB, attempt_id="a2", rank=0, clock=clock, flush_interval=0, window_s=window_s)
    _, reader = configure_metrics("memory", tracker=second, set_global=False)
    second.start()
    clock.advance(2.0)
    with second.span("checkpoint_restore"):
        clock.advance(1.0)
    second.checkpoint_restored(3)
    steps(second, clock, 4, 6)
    second.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the report's own warning about the clock
        report = attribute_root(root, window_s=window_s)
    return second, metric_totals(reader), report


@pytest.mark.parametrize("starts_at", [990.0, 1003.0])  # before the first attempt's start, inside its run
def test_the_ratio_gauges_equal_the_report_when_the_wall_clock_went_back(tmp_path, starts_at):
    """The restarted attempt's clock is behind (an NTP step, a node with a wrong clock): attribution places it right
    after the attempt before, and the job's seconds were exported as the report has them, but the ratios divided by
    the attempt's own clock less the job's start: ETTR 0.0 (a clock behind the job's start) or far above the
    report's (0.7 for 0.27). They are taken on the job's timeline: cumulative and windowed, as the report's."""
    second, seen, report = _restarted_at(str(tmp_path), starts_at, window_s=8.0)
    assert seen["seconds"] == pytest.approx({k: v for k, v in report.seconds.items() if v})
    assert seen["ettr"]["cumulative"] == pytest.approx(report.ettr) and 0 < report.ettr < 1
    assert seen["ettr"]["8s"] == pytest.approx(report.ettr_window(8.0))
    second.end()


@pytest.mark.parametrize(("starts_at", "age"), [(990.0, 8.0), (1003.0, 8.0), (1020.0, 22.5)])
def test_the_checkpoint_age_follows_the_report_when_the_wall_clock_went_back(tmp_path, starts_at, age):
    """a1 (from 1000 s) commits step 3 at 1003.5 s and dies at 1005.5 s; a2's clock starts at `starts_at` and restores
    step 3. A clock behind (990 s: before a1's start; 1003 s: inside its run) is placed by the report right after a1,
    at 1005.5 s: its flush at 6 s of its own is 1011.5 s on the job's timeline, 8 s after the commit. The age compared
    a1's raw commit time with a2's own clock: -7.5 s (a checkpoint from the future) and 5.5 s. A clock ahead (1020 s)
    is not moved: 22.5 s either way."""
    second, seen, report = _restarted_at(str(tmp_path), starts_at)  # the collection: at the report's end
    assert report.newest_commit == (3, 1_003_500_000)
    assert (seen["last_step"], seen["age"]) == (3, age)
    assert seen["age"] == (report.end_us - report.newest_commit[1]) / 1e6
    second.end()


_GLOBAL_AFTER_STEPS_CHILD = r"""
import json, sys
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from ettr import FakeClock, GoodputTracker, metric_totals

def train(tr, clock, first, last, loss):
    for s in range(first, last + 1):
        with tr.step(s) as step:
            clock.advance(1.0)
            step.record(loss(s))

root, clock, reader = sys.argv[1], FakeClock(1000.0), InMemoryMetricReader()
a1 = GoodputTracker(root, job_id="job-7", attempt_id="a1", clock=clock, flush_interval=0).start()
a1.checkpoint_restored(None)
train(a1, clock, 1, 2, float)
a1.checkpoint_committed(2, 1.0)
train(a1, clock, 3, 5, float)  # then it dies: no end
clock = FakeClock(1100.0)
a2 = GoodputTracker(root, job_id="job-7", attempt_id="a2", clock=clock, flush_interval=0).start()  # no metrics=
clock.advance(2.0)
a2.checkpoint_restored(2)
train(a2, clock, 3, 5, lambda s: s + (0.5 if s == 4 else 0.0))  # step 4 diverges; all exported to the proxies
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
train(a2, clock, 6, 7, float)
a2.flush()
print(json.dumps(metric_totals(reader)))
"""


def test_the_attempt_counters_count_what_came_before_the_global_provider_was_set(tmp_path):
    """A tracker made without metrics= reports through the API's proxies, which drop what they are given until the
    global provider is set (the docs say setting it after the tracker exists works). The job gauges caught up at the
    next export, but ettr.attempt.time counted only the time after the provider (2 s of productive where the report
    says 5 s, no startup), and the replay counters and the first divergence, given once, were lost: exactly what
    the docs say to alert on. What came before is held and handed to the SDK once the provider is set."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    out = subprocess.run(
        [sys.executable, "-c", _GLOBAL_AFTER_STEPS_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout)
    report = attribute_root(str(tmp_path))
    mine = report.attempts[-1]
    assert mine.attempt == "a2" and mine.replay.replayed == 3 and mine.replay.first_divergence.step == 4
    assert seen["attempt_seconds"] == {"startup": 2.0, "productive": 5.0}
    assert seen["attempt_seconds"] == {k: v / 1e6 for k, v in mine.micros.items() if v}
    assert seen["seconds"] == {k: v for k, v in report.seconds.items() if v}
    assert seen["replay"] == {"steps": 3, "divergences": 1, "first_divergence": 4}


def test_the_windowed_ratio_keeps_a_bounded_history_at_any_flush_rate(tmp_path):
    """The sliding window's history took a snapshot at every export and kept all of those in the window: at
    flush_interval=0, 12.5 MB per 100k steps (an hour of 1 ms flushes: 460 MB). Snapshots closer than 1/1000 of the
    window are coalesced: here 8,000 flushes in a 0.1 s window keep at most 2,003, and the ratio is still the
    report's, exactly where the window starts in a stretch without steps (a data wait). An object-store root: a
    flush exports without an fsync each."""
    root = f"memory://ettr-window-{tmp_path.name}"
    clock = FakeClock(1000.0)
    tr = GoodputTracker(root, job_id=JOB, attempt_id="a1", rank=0, clock=clock, flush_interval=0, window_s=0.1)
    _, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    tr.checkpoint_restored(None)
    for s in range(5000):  # 0.05 s of 10 us steps, one flush each
        with tr.step(s):
            clock.advance(0.00001)
    with tr.span("data_wait"):  # 1000.05 s to 1000.09 s: the window (0.1 s to 1000.17 s) starts inside it
        clock.advance(0.04)
    for s in range(5000, 13000):  # 0.08 s more
        with tr.step(s):
            clock.advance(0.00001)
    tr.flush()
    report = attribute_root(root, window_s=0.1)
    assert (report.ettr, report.ettr_window(0.1)) == (0.13 / 0.17, 0.8)
    assert metric_totals(reader)["ettr"] == {"cumulative": report.ettr, "0.1s": report.ettr_window(0.1)}
    assert len(tr._history) <= 2 * WINDOW_PARTS + 3 < 8000
    tr.end()


_GAUGES = {  # the synchronous gauges: set at flushes, at a window's end, once (the first divergence)
    "ettr.job.time",
    "ettr.job.checkpoint_time",
    "ettr.job.failures",
    "ettr.ratio",
    "ettr.step_window.time",
    "ettr.step_window.first_step",
    "ettr.step_window.steps",
    "ettr.replay.first_divergence",
}


def _gauges(reader) -> set[str]:
    """The synchronous gauges in one collection of `reader`."""
    data = reader.get_metrics_data()
    return {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics} & _GAUGES


def test_the_job_gauges_stay_in_every_collection_while_training_hangs_and_after_the_end(tmp_path):
    """The tracker sets its gauges at flushes (the step window's at a window's end, the first divergence once). The
    SDK before 1.45 (which the dependency floor, 1.30, allowed) dropped a synchronous gauge from every collection
    after the first without a new set(): while training hung (no flush) the job time, ETTR, failures, checkpoint
    time and step window vanished from the export, the first divergence after one export, and every gauge after the
    end. Each collection carries them all."""
    root = str(tmp_path)
    clock = FakeClock(1000.0)
    a1 = GoodputTracker(root, job_id=JOB, attempt_id="a1", rank=0, clock=clock, straggler_window=2).start()
    a1.checkpoint_restored(None)
    for s in range(1, 4):
        with a1.step(s) as step:
            clock.advance(1.0)
            step.record(float(s))
    a1.checkpoint_committed(1, 0.5)
    a1.end("error")
    clock.advance(10.0)
    a2 = GoodputTracker(root, job_id=JOB, attempt_id="a2", rank=0, clock=clock, straggler_window=2)
    provider, reader = configure_metrics("memory", tracker=a2, set_global=False)
    a2.start()
    a2.checkpoint_restored(1)
    for s in range(2, 6):  # step 3 diverges
        with a2.step(s) as step:
            clock.advance(1.0)
            step.record(float(s) + (s == 3))
    a2.flush()
    assert _gauges(reader) == _GAUGES
    clock.advance(60.0)  # training hangs: nothing is set again
    assert _gauges(reader) == _GAUGES
    a2.end()
    assert _gauges(reader) == _gauges(reader) == _GAUGES
    provider.shutdown()


@pytest.mark.parametrize(
    "window_s, label", [(3600, "3600s"), (0.1, "0.1s"), (2592000, "2592000s"), (1000001, "1000001s")]
)
def test_the_window_label_is_its_exact_seconds(tmp_path, window_s, label):
    """The windowed ratio's `ettr.window` was `f"{window_s:g}s"`: a 30-day window read "2.592e+06s" in every query,
    and a window of 1000001 s "1e+06s", the label of another window."""
    clock = FakeClock(1000.0)
    tr = GoodputTracker(str(tmp_path), job_id=JOB, attempt_id="a1", rank=0, clock=clock, window_s=window_s)
    provider, reader = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    tr.checkpoint_restored(None)
    steps(tr, clock, 1, 2)
    tr.end()
    assert set(metric_totals(reader)["ettr"]) == {"cumulative", label}
    provider.shutdown()


def test_a_collection_while_trackers_start_and_end_loses_no_checkpoint_gauge(caplog):
    """A collection (the exporter's thread, a scrape) read the live metrics' WeakSet while another thread started or
    ended a tracker (bind, end): "Set changed size during iteration" failed the callback, an error was logged and that
    collection lost ettr.checkpoint.last_step or .age of every tracker (within 7 s here, 4 runs out of 4). Binding
    and ending 100 metrics 5,000 times beside collections in a loop logs nothing now."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from ettr import GoodputMetrics

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    pool = [GoodputMetrics(provider.get_meter("ettr-live")) for _ in range(100)]
    for m in pool:
        m.committed(1, 0)
    done = threading.Event()

    def start_and_end() -> None:
        try:
            for _ in range(5000):
                for k, m in enumerate(pool):
                    m.bind(job=JOB, attempt=f"a{k}", rank=0, now_us=lambda: 0)
                for m in pool:
                    m.end()
        finally:
            done.set()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: inside an iteration too
    try:
        with caplog.at_level("WARNING", logger="opentelemetry"):
            thread = threading.Thread(target=start_and_end)
            thread.start()
            while not done.is_set() and not caplog.records:
                reader.get_metrics_data()
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert [r.getMessage() for r in caplog.records] == []
    provider.shutdown()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_during_a_collection_does_not_hang_the_child(tmp_path):
    """The live metrics' lock, held by a collection under way in the parent at a fork (a DataLoader worker started
    while the exporter's thread collects), is held for good in the child: the tracker's fork hook, which ends its
    metrics there, would wait on it forever. The child gets new locks."""
    tr = GoodputTracker(str(tmp_path), job_id=JOB, attempt_id="a1", rank=0, clock=FakeClock(1000.0))
    provider, _ = configure_metrics("memory", tracker=tr, set_global=False)
    tr.start()
    live = tr.metrics._in.live
    with live._lock:  # as a collection holds it
        pid = os.fork()
        if pid == 0:  # the child: the fork hooks ran; its metrics report nothing now
            os._exit(0 if live.observe(lambda m: [m]) == [] else 3)
    _, status = os.waitpid(pid, 0)  # a hung child: the suite's per-test timeout fails it
    assert os.waitstatus_to_exitcode(status) == 0
    tr.end()
    provider.shutdown()


def test_a_provider_and_its_reader_are_freed_once_dropped(tmp_path):
    """A process making a provider per run (a sweep, an integration's train() with configure_metrics in it) kept every
    one for good: the checkpoint gauges' registry held each meter strongly, and with it the provider's instruments,
    storage and reader, 50 KB each after its shutdown (200 runs: 10 MB more). Dropped, they are freed."""
    import gc
    import weakref

    clock = FakeClock(1000.0)
    readers = []
    for i in range(3):
        tr = GoodputTracker(str(tmp_path), job_id=JOB, attempt_id=f"a{i}", rank=0, clock=clock)
        provider, reader = configure_metrics("memory", tracker=tr, set_global=False)
        tr.start()
        tr.checkpoint_restored(None)
        steps(tr, clock, 1, 2)
        tr.checkpoint_committed(2, 0.5, 4096)
        assert metric_totals(reader)["last_step"] == 2
        tr.end()
        provider.shutdown()
        readers.append(weakref.ref(reader))
        del tr, provider, reader
    gc.collect()
    assert [r() for r in readers] == [None, None, None]


_MANY_TRACKERS_CHILD = r"""
import gc, sys
from opentelemetry import metrics
from ettr import FakeClock, GoodputTracker

def instruments():
    gc.collect()
    return sum(isinstance(o, metrics.Instrument) for o in gc.get_objects())

counts = []
for i in range(12):  # no metrics=, no provider set: the global proxy meter's, as in a process that configures none
    GoodputTracker(sys.argv[1], job_id="job-7", attempt_id=f"a{i}", clock=FakeClock(1000.0)).start().end()
    counts.append(instruments())
print(counts[1], counts[-1])
"""


def test_trackers_made_one_after_another_without_a_provider_add_no_instruments(tmp_path):
    """The global proxy meter keeps every instrument made on it for the life of the process (to hand each the SDK's
    once a provider is set), and each tracker made its 17 again: a process making trackers one after another (an
    integration's next train(), a sweep) grew by 17 instruments per tracker. They are made once per meter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__))])}
    out = subprocess.run(
        [sys.executable, "-c", _MANY_TRACKERS_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    second, last = map(int, out.stdout.split())
    assert last == second, f"{last - second} instruments more after 10 more trackers"
