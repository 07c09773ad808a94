"""OpenTelemetry instruments for goodput (API only), and helpers for applications to configure the SDK.

Every point carries the job and rank (`ettr.job`, `ettr.rank`). Per-attempt instruments (a counter and histograms)
also carry `ettr.attempt` and start from zero in each process, so `rate()`/`increase()` see a new series at a
restart instead of a jump; the job's running totals are gauges, which a restarted process simply sets again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import metrics

from .formulas import check_seconds

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

log = logging.getLogger(__name__)


class TrackedProcess(Protocol):
    """What telemetry needs of a tracker (`ettr.GoodputTracker`): this process's identity in the job, and where its
    metrics go. A protocol, so that telemetry never imports the tracker that imports it."""

    job_id: str
    attempt_id: str
    rank: int

    def claim_attempt(self) -> str:
        """The attempt id its ledger records, final even before the tracker starts (a taken id is renamed)."""
        ...

    def use_metrics(self, metrics: GoodputMetrics) -> None: ...


SERVICE_NAME = "ckpt-goodput"  # service.name unless configured (argument, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES)
# Duration buckets from 1 ms to 30 min: a save's stall or an optimizer step's wait is often a few milliseconds,
# a restore or a background write of a large model many minutes.
DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)
# Byte buckets in powers of 4 from 64 KiB to 1 TiB: a checkpoint is a few MB (tests) to terabytes (large models).
SIZE_BUCKETS = tuple(float(4**k) for k in range(8, 21))
DURATIONS = {
    "checkpoint_save": "Blocking duration of each checkpoint save() call, its wait for the previous save included",
    "checkpoint_previous_wait": "Each wait inside a checkpoint save() for the previous save to finish",
    "checkpoint_overlap_wait": "Each wait of an optimizer step for an overlapped snapshot's copies",
    "checkpoint_restore": "Blocking duration of each checkpoint restore",
    "checkpoint_write": "Background duration of each checkpoint write, from snapshot to commit",
}


class GoodputMetrics:
    """The instruments a GoodputTracker feeds; created from a Meter (default: the global provider's, a no-op until
    an application configures the SDK). The tracker calls `bind` at start with its identity and clock."""

    def __init__(self, meter: metrics.Meter | None = None, *, point_attributes: dict[str, Any] | None = None) -> None:
        """`point_attributes`: put on every point besides the job and rank, e.g. `identity_attributes()`
        (``configure_metrics(identity_on_points=True)``): for backends that do not join `target_info`."""
        meter = meter or _global_meter()
        self._points = dict(point_attributes or {})
        self._job: dict[str, Any] = dict(self._points)  # ettr.job, ettr.rank (and the point attributes)
        self._attempt: dict[str, Any] = {}  # and ettr.attempt
        self._now_us: Callable[[], int] | None = None
        self._recorded = False  # a point of a synchronous instrument was recorded (its series is exported for good)
        self._last_commit: tuple[int, int] | None = None  # (step, commit time in microseconds)
        # what the counters and gauges were given while their API proxy had no SDK instrument behind it (no global
        # provider yet: the API drops it), per series: [instrument, attributes, sum (a counter) or last value]
        self._held: dict[tuple[int, frozenset], list[Any]] = {}
        self._held_lock = threading.Lock()
        self._in = _instruments_of(meter)  # its checkpoint gauges report this object from `bind` until `end`

    def bind(self, *, job: str, attempt: str, rank: int, now_us: Callable[[], int]) -> None:
        """Label every point with the job, rank (and attempt) and read the checkpoint age from `now_us`."""
        self._job = {**self._points, "ettr.job": job, "ettr.rank": rank}
        self._attempt = {**self._job, "ettr.attempt": attempt}
        self._now_us = now_us
        self._in.live.add(self)

    @property
    def recorded(self) -> bool:
        """Whether a point was recorded with the job it is bound to: the SDK exports that series (the last value of a
        gauge, a counter's total) for as long as the provider lives, so binding another job now would leave it beside
        the new job's series. The checkpoint gauges are read at each collection and follow a new job."""
        return self._recorded

    def _record(self, instrument: Any, value: float, attributes: dict[str, Any]) -> None:
        """Add `value` to a counter, or set a gauge to it. An API proxy made before the global provider was set
        drops what it is given until then, so that is held here (a counter's sum, a gauge's last value, per series)
        and handed to the SDK instrument once one is behind it: a counter set up before the provider counted only
        what came after (ettr.attempt.time 2 s of an attempt's 5), a gauge set once (the first divergence) was lost.
        A histogram's observations before the provider are dropped, as the API does (they are not bounded)."""
        self._recorded = True
        real = _recording(instrument)
        if real is None:
            key = id(instrument), frozenset(attributes.items())
            with self._held_lock:
                held = self._held.setdefault(key, [instrument, attributes, 0])
                held[2] = held[2] + value if isinstance(instrument, metrics.Counter) else value
            return
        if self._held:
            self._release()
        (real.add if isinstance(instrument, metrics.Counter) else real.set)(value, attributes)

    def _release(self) -> None:
        """Hand what was held (`_record`) to the SDK instruments now behind the proxies."""
        with self._held_lock:
            held, self._held = self._held, {}
        for key, (instrument, attributes, value) in held.items():
            real = _recording(instrument)
            if real is None:  # cannot be: one meter's proxies get their SDK instruments at once; kept, not lost
                with self._held_lock:
                    self._held.setdefault(key, [instrument, attributes, value])
            elif isinstance(instrument, metrics.Counter):
                real.add(value, attributes)
            else:
                real.set(value, attributes)

    def add_attempt_seconds(self, category: str, seconds: float) -> None:
        """Count `seconds` more of this attempt's wall time in `category`."""
        self._record(self._in.attempt_time, seconds, {**self._attempt, "ettr.category": category})

    def set_job_seconds(self, seconds: dict[str, float]) -> None:
        """Set the job's total seconds per category."""
        for category, value in seconds.items():
            self._record(self._in.job_time, value, {**self._job, "ettr.category": category})

    def set_checkpoint_seconds(self, seconds: dict[str, float]) -> None:
        """Set the job's checkpoint seconds per part (attribute ettr.part): "stall", "previous_wait" and
        "overlap_wait" sum to checkpoint_save's badput; "background_write" overlaps training."""
        for part, value in seconds.items():
            self._record(self._in.checkpoint_time, value, {**self._job, "ettr.part": part})

    def set_ettr(self, cumulative: float, windowed: float, window_s: float) -> None:
        """Set the ETTR gauges (attribute ettr.window = "cumulative" or "<seconds>s", the seconds exact: "3600s",
        "2592000s"; `:g` made a 30-day window "2.592e+06s" and 1000001 s "1e+06s", another window's label)."""
        self._record(self._in.ratio, cumulative, {**self._job, "ettr.window": "cumulative"})
        self._record(
            self._in.ratio, windowed, {**self._job, "ettr.window": f"{str(float(window_s)).removesuffix('.0')}s"}
        )

    def set_failures(self, count: int) -> None:
        """Set the number of failed attempts of the job (each is one restart)."""
        self._record(self._in.failures, count, self._job)

    def replayed(self, steps: int, diverged: int, first_divergence: int | None = None) -> None:
        """Count `steps` more steps trained again after the resume, `diverged` of them unlike their first pass, the
        first of those `first_divergence` (ettr.replay; the tracker gives it once per attempt)."""
        self._recorded = True
        if steps:
            self._record(self._in.replayed, steps, self._attempt)
        if diverged:
            self._record(self._in.diverged, diverged, self._attempt)
        if first_divergence is not None:
            self._record(self._in.first_divergence, first_divergence, self._attempt)

    def set_step_window(self, first_step: int, steps: int, busy_us: int, wait_us: int) -> None:
        """Set this rank's last complete window of steps (`first_step` on, `steps` of them run): its busy and
        collective-wait seconds (attribute ettr.part = "busy", "collective_wait")."""
        self._record(self._in.window_time, busy_us / 1e6, {**self._job, "ettr.part": "busy"})
        self._record(self._in.window_time, wait_us / 1e6, {**self._job, "ettr.part": "collective_wait"})
        self._record(self._in.window_first, first_step, self._job)
        self._record(self._in.window_steps, steps, self._job)

    def record_duration(self, category: str, seconds: float) -> None:
        """Record one duration of `category` (DURATIONS): a save() call, a part of a save (its wait for the previous
        one, an optimizer step's wait for an overlapped snapshot), a restore, or a background write."""
        self._recorded = True
        self._in.durations[category].record(seconds, self._attempt)

    def committed(
        self,
        step: int,
        at_us: int,
        background_seconds: float | None = None,
        nbytes: int | None = None,
        tier: str | None = None,
    ) -> None:
        """A checkpoint of `step` committed at `at_us` (job timeline); this attempt's own commits give the write
        time and size, an earlier attempt's (read from its ledger) only the step and time. With two tiers the
        write and size carry ``ettr.tier`` (a persist is a second write of the same step: a series of its own)."""
        if self._last_commit is None or step >= self._last_commit[0]:
            self._last_commit = step, at_us
        attrs = {**self._attempt, "ettr.tier": tier} if tier else self._attempt
        self._recorded = self._recorded or background_seconds is not None or nbytes is not None
        if background_seconds is not None:
            self._in.durations["checkpoint_write"].record(background_seconds, attrs)
        if nbytes is not None:
            self._in.size.record(nbytes, attrs)

    @property
    def last_commit(self) -> tuple[int, int] | None:
        """(step, commit time in microseconds) of the newest checkpoint it was told of, or None."""
        return self._last_commit

    def end(self) -> None:
        """Stop reporting the checkpoint gauges (the tracker ended: an age that grows on would page someone)."""
        self._in.live.discard(self)

    def _last_step(self) -> list[metrics.Observation]:
        last = self._last_commit
        return [metrics.Observation(last[0], self._job)] if last is not None else []

    def _age(self) -> list[metrics.Observation]:
        last, now = self._last_commit, self._now_us
        return [metrics.Observation((now() - last[1]) / 1e6, self._job)] if last is not None and now else []


class _Live:
    """The live metrics whose checkpoint gauges one meter reports, behind a lock: a collection (the exporter's or the
    scrape's thread) read the bare WeakSet while a tracker started or ended (bind, end) and failed with "Set changed
    size during iteration", losing that collection's step and age of every tracker, with an error logged; it could
    also read the clock of a tracker ended meanwhile, which raises. `end` now waits for a collection under way."""

    def __init__(self) -> None:
        self._metrics: weakref.WeakSet[GoodputMetrics] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, m: GoodputMetrics) -> None:
        with self._lock:
            self._metrics.add(m)

    def discard(self, m: GoodputMetrics) -> None:
        with self._lock:
            self._metrics.discard(m)

    def observe(self, read: Callable[[GoodputMetrics], list[metrics.Observation]]) -> list[metrics.Observation]:
        """`read` of every live metrics, with none started or ended meanwhile."""
        with self._lock:
            return [o for m in self._metrics for o in read(m)]


# meter -> its instruments, weakly: a strong reference kept every provider ever made (its instruments, storage and
# readers, 50 KB each) after its shutdown, for the life of the process
_OBSERVED: weakref.WeakKeyDictionary[metrics.Meter, _Instruments] = weakref.WeakKeyDictionary()
_OBSERVED_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """New locks for the live metrics in a forked child: a collection under way in the parent at the fork holds one in
    the child's copy for good, and the tracker's own fork hook (which ends its metrics there) would wait on it."""
    for instruments in _OBSERVED.values():
        instruments.live._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
_GLOBAL: list[metrics.Meter] = []  # the global provider's meter "ettr", once asked for (`_global_meter`)


def _global_meter() -> metrics.Meter:
    """The global provider's meter "ettr", the same one for every GoodputMetrics made without a meter. Before an
    application configures the SDK the API hands out a new proxy meter per call, each following the provider set
    later: a second proxy made the checkpoint gauges again on the same SDK meter, which drops their callbacks."""
    with _OBSERVED_LOCK:
        if not _GLOBAL:
            _GLOBAL.append(metrics.get_meter("ettr"))
        return _GLOBAL[0]


def _recording(instrument: Any) -> Any:
    """The instrument that records for `instrument`: the SDK instrument behind an API proxy once the global provider
    is set, None before it (the proxy drops what it is given), else `instrument` (an SDK instrument; a proxy of
    another API version, without `_real_instrument`, is taken as recording)."""
    return getattr(instrument, "_real_instrument", instrument)


def _backing(meter: metrics.Meter) -> metrics.Meter:
    """The meter that records for `meter`: the SDK meter behind an API proxy once the global provider is set (the
    proxy's `_real_meter`; absent from another API version, the proxy itself), else `meter`."""
    return getattr(meter, "_real_meter", None) or meter


class _Instruments:
    """The instruments of one meter, made once for every GoodputMetrics of it: a proxy meter (no SDK provider set yet,
    as in a process that never configures one) keeps each instrument made on it for the life of the process, so a
    set per GoodputMetrics grew it by 17 instruments per tracker. Its checkpoint gauges report `live`."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.attempt_time = meter.create_counter(
            "ettr.attempt.time",
            unit="s",
            description="Wall time of this process attempt per goodput category, from 0 at its start",
        )
        self.job_time = meter.create_gauge(
            "ettr.job.time",
            unit="s",
            description="Wall time of the whole job per goodput category, earlier attempts included",
        )
        self.ratio = meter.create_gauge(
            "ettr.ratio", unit="1", description="Effective training time ratio, cumulative and over a sliding window"
        )
        self.checkpoint_time = meter.create_gauge(
            "ettr.job.checkpoint_time",
            unit="s",
            description="Checkpoint time of the whole job by part: the badput of saves (stall, previous_wait, "
            "overlap_wait) and the background write beside it",
        )
        self.failures = meter.create_gauge(
            "ettr.job.failures", unit="{failure}", description="Attempts of the job that ended in a failure so far"
        )
        self.replayed = meter.create_counter(
            "ettr.replay.steps",
            unit="{step}",
            description="Steps this attempt trained a second time after its resume, compared with their first pass",
        )
        self.diverged = meter.create_counter(
            "ettr.replay.divergences",
            unit="{step}",
            description="Steps trained a second time whose loss, batch hash or scalars differ from their first pass",
        )
        self.first_divergence = meter.create_gauge(
            "ettr.replay.first_divergence",
            unit="{step}",
            description="The first step of this attempt whose second pass differs from its first",
        )
        self.window_time = meter.create_gauge(
            "ettr.step_window.time",
            unit="s",
            description="This rank's time in its last complete window of steps by part: busy (its steps less its "
            "collective waits; the slowest rank has the most) and collective_wait (waiting for the other ranks)",
        )
        self.window_first = meter.create_gauge(
            "ettr.step_window.first_step", unit="{step}", description="First step of that window"
        )
        self.window_steps = meter.create_gauge(
            "ettr.step_window.steps", unit="{step}", description="Steps this rank ran in that window"
        )
        self.durations = {
            cat: meter.create_histogram(
                f"ettr.{cat}.duration", unit="s", description=text, explicit_bucket_boundaries_advisory=DURATION_BUCKETS
            )
            for cat, text in DURATIONS.items()
        }
        self.size = meter.create_histogram(
            "ettr.checkpoint.size",
            unit="By",
            description="Bytes of tensor data in each committed checkpoint",
            explicit_bucket_boundaries_advisory=SIZE_BUCKETS,
        )
        self.live = _Live()
        meter.create_observable_gauge(
            "ettr.checkpoint.last_step",
            unit="{step}",
            callbacks=[lambda options: self.live.observe(GoodputMetrics._last_step)],
            description="Newest committed checkpoint step of the job",
        )
        meter.create_observable_gauge(
            "ettr.checkpoint.age",
            unit="s",
            callbacks=[lambda options: self.live.observe(GoodputMetrics._age)],
            description="Seconds since the newest committed checkpoint was committed, as of the collection",
        )


def _instruments_of(meter: metrics.Meter) -> _Instruments:
    """The instruments of `meter`, made once per meter that records (a proxy of the global provider and the SDK meter
    behind it are one): the SDK keeps a name's first registration and drops later callbacks, so a second tracker in
    one process (an integration's next train()) exported the first one's step and age, and kept it alive; now each
    collection reads every live (not ended, not collected) metrics object of the meter."""
    with _OBSERVED_LOCK:
        found = _OBSERVED.get(meter)
        if found is None:
            backing = _backing(meter)
            found = next((f for m, f in _OBSERVED.items() if _backing(m) is backing), None)
        if found is None:
            found = _OBSERVED[meter] = _Instruments(meter)
        return found


def identity_attributes(resource: Resource) -> dict[str, Any]:
    """The process's identity to put on every point (`GoodputMetrics(point_attributes=...)`): `service.name` and
    `host.name` of `resource` (this host's name if it has none); `ettr.job` is on every point anyway."""
    from opentelemetry.sdk.resources import SERVICE_NAME as NAME

    return {
        "service.name": str(resource.attributes.get(NAME, SERVICE_NAME)),
        "host.name": str(resource.attributes.get("host.name", socket.gethostname())),
    }


def goodput_resource(tracker: TrackedProcess | None = None, service_name: str | None = None) -> Resource:
    """An OpenTelemetry Resource naming the service and, given a tracker, this process of the job.

    service.name: `service_name`, else OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, else "ckpt-goodput".
    With a tracker: service.instance.id "<attempt>-rank<r>", host.name, process.pid, ettr.job, ettr.attempt, ettr.rank.
    """
    from opentelemetry.sdk.resources import SERVICE_NAME as NAME
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, Any] = {}
    if tracker is not None:
        # the id its ledger records: an unstarted tracker given a taken attempt_id is renamed (<id>.2) only when its
        # ledger is created, so that is done now; the resource cannot change once the provider has it
        attempt = tracker.claim_attempt()
        attributes = {
            "service.instance.id": f"{attempt}-rank{tracker.rank}",
            "host.name": socket.gethostname(),
            "process.pid": os.getpid(),
            "ettr.job": tracker.job_id,
            "ettr.attempt": attempt,
            "ettr.rank": tracker.rank,
        }
    resource = Resource.create(attributes)
    if service_name or str(resource.attributes.get(NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({NAME: service_name or SERVICE_NAME}))
    return resource


def configure_metrics(
    exporter: str = "console",
    *,
    tracker: TrackedProcess | None = None,
    service_name: str | None = None,
    interval_s: float = 10.0,
    endpoint: str | None = None,
    export_timeout_s: float = 3.0,
    prometheus_port: int | None = None,
    set_global: bool = True,
    identity_on_points: bool = False,
) -> tuple[Any, Any]:
    """For applications, not the library: build an SDK MeterProvider with one reader and return (provider, reader).

    exporter: "console" (periodic, stdout), "otlp" (opentelemetry-exporter-otlp), "prometheus"
    (opentelemetry-exporter-prometheus; serves /metrics on `prometheus_port` if given) or "memory" (tests).
    The provider's resource is `goodput_resource(tracker, service_name)`; a given (unstarted) tracker reports to it.
    `identity_on_points`: every point also carries `service.name` and `host.name` (and `ettr.job`, as always), not
    only the resource (Prometheus's `target_info`), for backends and queries that do not join it.
    `export_timeout_s` bounds each OTLP export, its retries included (the SDK's default, 10 s of retries, made a
    process whose collector is down linger 10-18 s at exit, after a SIGTERM too); a missed export's counts go out
    with the next one (they are cumulative). `interval_s` (between periodic exports) and `export_timeout_s` are finite
    positive seconds and `prometheus_port` an int from 0 to 65535, else a ValueError naming them.
    """
    check_seconds("export_timeout_s", export_timeout_s, positive=True)
    # the SDK took interval_s=nan (or inf) and its export thread ended at once: nothing was ever exported, no error
    check_seconds("interval_s", interval_s, positive=True)
    if prometheus_port is not None and not (type(prometheus_port) is int and 0 <= prometheus_port <= 65535):
        raise ValueError(f"prometheus_port must be an int from 0 (any free port) to 65535, got {prometheus_port!r}")
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        InMemoryMetricReader,
        PeriodicExportingMetricReader,
    )

    if exporter == "memory":
        reader: Any = InMemoryMetricReader()
    elif exporter == "console":
        reader = PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=interval_s * 1000)
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        except ImportError as err:
            raise ImportError("exporter='otlp' needs `pip install opentelemetry-exporter-otlp-proto-http`") from err
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=endpoint, timeout=export_timeout_s),
            export_interval_millis=interval_s * 1000,
            export_timeout_millis=export_timeout_s * 1000,
        )
    elif exporter == "prometheus":
        try:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
        except ImportError as err:
            raise ImportError("exporter='prometheus' needs `pip install opentelemetry-exporter-prometheus`") from err
        if prometheus_port is not None:
            _serve_metrics(prometheus_port)  # first: a port in use leaves no reader registered in the global REGISTRY
        reader = PrometheusMetricReader()
    else:
        raise ValueError(f"unknown exporter {exporter!r}: use console, otlp, prometheus or memory")
    resource = goodput_resource(tracker, service_name)
    provider = MeterProvider(resource=resource, metric_readers=[reader])
    if set_global:
        metrics.set_meter_provider(provider)
    if tracker is not None:
        points = identity_attributes(resource) if identity_on_points else None
        tracker.use_metrics(GoodputMetrics(provider.get_meter("ettr"), point_attributes=points))
    return provider, reader


def _serve_metrics(port: int) -> None:
    """Serve prometheus_client's registry on /metrics at `port`, logging the port served (0 picks a free one, which
    nothing else tells). A port in use was a bare "[Errno 98] Address already
    in use" from every rank but the first on a host when each was given the same port."""
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port)
    except OSError as err:
        raise OSError(
            err.errno,
            f"prometheus_port {port} cannot be served ({err.strerror}): each process on a host needs a port of its "
            f"own, e.g. prometheus_port={port} + int(os.environ['LOCAL_RANK'])",
        ) from err
    log.info("ettr: serving Prometheus metrics on port %d (/metrics)", server.server_port)  # port 0: the one chosen


def metric_totals(reader: Any) -> dict[str, Any]:
    """Read an InMemoryMetricReader into the numbers a report should agree with: {"seconds": {category: s} (job),
    "attempt_seconds": {category: s}, "checkpoint_seconds": {part: s} (job), "failures": n, "ettr": {window: v},
    "replay": {"steps", "divergences", "first_divergence"} (once a step was trained again),
    "last_step": s, "age": s, "step_window": {part: s}, "step_window_first_step": s,
    "step_window_steps": n,
    "<histogram>": {"count", "sum"}}."""
    out: dict[str, Any] = {"seconds": {}, "attempt_seconds": {}, "failures": 0, "ettr": {}}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    if m.name == "ettr.job.time":
                        out["seconds"][p.attributes["ettr.category"]] = p.value
                    elif m.name == "ettr.attempt.time":
                        out["attempt_seconds"][p.attributes["ettr.category"]] = p.value
                    elif m.name == "ettr.job.checkpoint_time":
                        out.setdefault("checkpoint_seconds", {})[p.attributes["ettr.part"]] = p.value
                    elif m.name == "ettr.job.failures":
                        out["failures"] = p.value
                    elif m.name.startswith("ettr.replay."):
                        out.setdefault("replay", {})[m.name[len("ettr.replay.") :]] = p.value
                    elif m.name == "ettr.ratio":
                        out["ettr"][p.attributes["ettr.window"]] = p.value
                    elif m.name == "ettr.checkpoint.last_step":
                        out["last_step"] = p.value
                    elif m.name == "ettr.checkpoint.age":
                        out["age"] = p.value
                    elif m.name == "ettr.step_window.time":
                        out.setdefault("step_window", {})[p.attributes["ettr.part"]] = p.value
                    elif m.name == "ettr.step_window.first_step":
                        out["step_window_first_step"] = p.value
                    elif m.name == "ettr.step_window.steps":
                        out["step_window_steps"] = p.value
                    else:
                        out[m.name] = {"count": p.count, "sum": p.sum}
    return out
