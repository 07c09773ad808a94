"""OpenTelemetry instruments for goodput (API only), and a helper for applications to configure the SDK."""
from __future__ import annotations

from typing import Any

from opentelemetry import metrics

# Second-scale buckets: checkpoint saves/restores take from tens of milliseconds to many minutes.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class GoodputMetrics:
    """The instruments a GoodputTracker feeds; created from a Meter (default: the global provider's, a no-op until
    an application configures the SDK)."""

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter("ettr")
        self._seconds = meter.create_counter(
            "ettr.time", unit="s", description="Job wall time attributed to a goodput category")
        self._ettr = meter.create_gauge(
            "ettr.ratio", unit="1", description="Effective training time ratio, cumulative and over a sliding window")
        self._failures = meter.create_counter(
            "ettr.failures", unit="{failure}", description="Attempts of the job that ended in a failure (restarts)")
        self._durations = {
            cat: meter.create_histogram(
                f"ettr.{cat}.duration", unit="s", description=f"Blocking duration of each {cat.replace('_', ' ')}",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
            for cat in ("checkpoint_save", "checkpoint_restore")
        }

    def add_seconds(self, category: str, seconds: float) -> None:
        """Count `seconds` more of wall time in `category`."""
        self._seconds.add(seconds, {"ettr.category": category})

    def set_ettr(self, cumulative: float, windowed: float, window_s: float) -> None:
        """Set the ETTR gauges (attribute ettr.window = "cumulative" or "<seconds>s")."""
        self._ettr.set(cumulative, {"ettr.window": "cumulative"})
        self._ettr.set(windowed, {"ettr.window": f"{window_s:g}s"})

    def add_failures(self, count: int) -> None:
        """Count failed attempts (each is one restart)."""
        if count:
            self._failures.add(count)

    def record_duration(self, category: str, seconds: float) -> None:
        """Record one checkpoint save/restore blocking duration."""
        self._durations[category].record(seconds)


def configure_metrics(
    exporter: str = "console",
    *,
    interval_s: float = 10.0,
    endpoint: str | None = None,
    prometheus_port: int | None = None,
    set_global: bool = True,
) -> tuple[Any, Any]:
    """For applications, not the library: build an SDK MeterProvider with one reader and return (provider, reader).

    exporter: "console" (periodic, stdout), "otlp" (opentelemetry-exporter-otlp), "prometheus"
    (opentelemetry-exporter-prometheus; serves /metrics on `prometheus_port` if given) or "memory" (tests).
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, InMemoryMetricReader, PeriodicExportingMetricReader

    if exporter == "memory":
        reader: Any = InMemoryMetricReader()
    elif exporter == "console":
        reader = PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=interval_s * 1000)
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        except ImportError as err:
            raise ImportError("exporter='otlp' needs `pip install opentelemetry-exporter-otlp-proto-http`") from err
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint), export_interval_millis=interval_s * 1000)
    elif exporter == "prometheus":
        try:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
        except ImportError as err:
            raise ImportError("exporter='prometheus' needs `pip install opentelemetry-exporter-prometheus`") from err
        reader = PrometheusMetricReader()
        if prometheus_port is not None:
            from prometheus_client import start_http_server

            start_http_server(prometheus_port)
    else:
        raise ValueError(f"unknown exporter {exporter!r}: use console, otlp, prometheus or memory")
    provider = MeterProvider(metric_readers=[reader])
    if set_global:
        metrics.set_meter_provider(provider)
    return provider, reader


def metric_totals(reader: Any) -> dict[str, Any]:
    """Read an InMemoryMetricReader into {"seconds": {category: s}, "failures": n, "ettr": {window: v},
    "<histogram>": count} — the numbers a report should agree with."""
    out: dict[str, Any] = {"seconds": {}, "failures": 0, "ettr": {}}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    if m.name == "ettr.time":
                        out["seconds"][p.attributes["ettr.category"]] = p.value
                    elif m.name == "ettr.failures":
                        out["failures"] += p.value
                    elif m.name == "ettr.ratio":
                        out["ettr"][p.attributes["ettr.window"]] = p.value
                    else:
                        out[m.name] = {"count": p.count, "sum": p.sum}
    return out
