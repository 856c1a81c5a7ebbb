"""Prometheus metrics of the learner's telemetry: the latest snapshot as ``oakemu_*`` metrics over HTTP.

Served by the learner at ``/metrics`` (default port 9100) for Prometheus and Grafana; the same
figures as :class:`~oakemu_core.run.telemetry.TelemetrySnapshot`: a metric per row of
:data:`~oakemu_core.run.metrics_table.METRICS` with a Prometheus name, the message counters by label,
and each actor's figures.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from oakemu_core.run.metrics_table import FAMILIES, METRICS
from oakemu_core.run.telemetry import DROPPED_KINDS, TelemetryBindError, TelemetrySnapshot


class _SnapshotCollector(Collector):
    """Prometheus collector that exposes the latest snapshot (nothing before the first one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot: TelemetrySnapshot | None = None

    def set(self, snapshot: TelemetrySnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self) -> Iterator[object]:
        with self._lock:
            snap = self._snapshot
        info = InfoMetricFamily("oakemu_run", "Run name and environment id of the learner")
        if snap is not None:
            info.add_metric([], {"run_name": snap.run_name, "env_id": snap.env_id})
        yield info
        yield from _table_metrics(snap)
        yield from _message_metrics(snap)
        yield from _actor_metrics(snap)


Family = GaugeMetricFamily | CounterMetricFamily


def _labelled(family: Family, values: dict[str, float | None]) -> Family:
    """``family`` with one sample per label of ``values`` (None values left out)."""
    for label, value in values.items():
        if value is not None:
            family.add_metric([label], value)
    return family


def _table_metrics(snap: TelemetrySnapshot | None) -> Iterator[Family]:
    """A gauge or counter per row of :data:`METRICS` with a Prometheus name, from its snapshot
    field; rows of one labelled family (:data:`FAMILIES`) are its samples. No sample before the
    first snapshot or while the field is None."""
    families: dict[str, Family] = {}
    for row in METRICS:
        if row.prometheus is None or row.snapshot is None:
            continue
        kind = CounterMetricFamily if row.prometheus_type == "counter" else GaugeMetricFamily
        family = families.get(row.prometheus)
        if family is None:
            label, doc = FAMILIES.get(row.prometheus, (None, row.doc))
            family = kind(row.prometheus, doc, labels=None if label is None else [label])
            families[row.prometheus] = family
        value = None if snap is None else getattr(snap, row.snapshot)
        if value is not None:
            family.add_metric([] if row.label is None else [row.label], value)
    yield from families.values()


def _message_metrics(s: TelemetrySnapshot | None) -> Iterator[Family]:
    """Messages received, accepted and rejected, and dropped data, by label."""
    rejected = CounterMetricFamily(
        "oakemu_rejected_messages", "Messages rejected, by reason", labels=["reason"]
    )
    dropped = CounterMetricFamily(
        "oakemu_dropped", "Rows, steps or actors dropped, by kind", labels=["kind"]
    )
    if s is not None:
        _labelled(rejected, dict(s.rejected_messages))
        _labelled(dropped, {kind: 0 for kind in DROPPED_KINDS} | dict(s.dropped))
    yield rejected
    yield dropped
    received = CounterMetricFamily(
        "oakemu_messages_received", "ZeroMQ messages read, by socket", labels=["socket"]
    )
    accepted = CounterMetricFamily(
        "oakemu_messages_accepted", "Messages served, by kind", labels=["kind"]
    )
    if s is not None:
        _labelled(received, dict(s.messages_received))
        _labelled(accepted, dict(s.messages_accepted))
    yield received
    yield accepted


def _actor_metrics(s: TelemetrySnapshot | None) -> Iterator[Family]:
    """Connected actors, each actor's speed and envs."""
    actors = GaugeMetricFamily("oakemu_actors", "Connected actors")
    if s is not None:
        actors.add_metric([], s.num_actors)
    yield actors
    actor_sps = GaugeMetricFamily(
        "oakemu_actor_sps", "Env steps per second of one actor", labels=["actor_id"]
    )
    actor_envs = GaugeMetricFamily(
        "oakemu_actor_envs", "Environments of one actor", labels=["actor_id"]
    )
    if s is not None:
        for actor in s.actors:
            actor_sps.add_metric([actor.actor_id], actor.sps)
            actor_envs.add_metric([actor.actor_id], actor.num_envs)
    yield actor_sps
    yield actor_envs


SHUTDOWN_POLL_S = 0.05
"""How often the HTTP server's loop looks for a shutdown request: :meth:`PrometheusExporter.close`
(at every learner's exit) waits up to this long; ``prometheus_client.start_http_server`` polls every
0.5 s."""


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """prometheus_client's threading WSGI server: each scrape in a daemon thread."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        """No access log line per scrape."""


def _serve(
    port: int, addr: str, registry: CollectorRegistry
) -> tuple[WSGIServer, threading.Thread]:
    """``registry`` over HTTP at ``addr:port`` (IPv4 or IPv6, as the address resolves), served by a
    daemon thread; prometheus_client's ``start_http_server`` with a shorter shutdown poll."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("_Server", (_MetricsServer,), {"address_family": family})
    server = make_server(
        sockaddr[0], port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
    )
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": SHUTDOWN_POLL_S},
        name="prometheus",
        daemon=True,
    )
    thread.start()
    return server, thread


class PrometheusExporter:
    """Serves the latest snapshot as Prometheus metrics (``oakemu_*``) over HTTP at ``/metrics``.

    Counters (``oakemu_env_steps_total``, ``oakemu_updates_total``, ``oakemu_episodes_total``,
    ``oakemu_rejected_messages_total{reason}``, ``oakemu_dropped_total{kind}``) carry the learner's
    own running totals; gauges carry the latest value. A figure that does not exist yet (no
    update, no episode) has no sample. The learner process's own figures come with them
    (``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ...: prometheus_client's
    process collector, Linux). Metrics are kept in a private registry by default, so several
    exporters can live in one process.

    Args:
        port: TCP port to serve on; ``0`` picks a free one (see :attr:`port`).
        registry: registry to add the metrics to (default: a new ``CollectorRegistry``).
        addr: interface to listen on (the learner passes ``metrics_host``, else its ``bind_host``:
            ``"0.0.0.0"`` in a container, ``"127.0.0.1"`` for local use).

    Raises:
        TelemetryBindError: the port is in use or the address invalid.
    """

    def __init__(
        self, port: int, registry: CollectorRegistry | None = None, *, addr: str = "127.0.0.1"
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = _SnapshotCollector()
        self.registry.register(self._collector)
        self._process = ProcessCollector(
            registry=self.registry
        )  # process_* figures: memory, CPU, fds
        try:
            self._server, self._thread = _serve(port, addr, self.registry)
        except OSError as exc:  # socket.gaierror too: an address that does not resolve
            self.registry.unregister(self._process)
            self.registry.unregister(self._collector)
            raise TelemetryBindError(
                f"cannot serve Prometheus metrics on {addr}:{port}: {exc} "
                "(set OAKEMU_METRICS_PORT to a free port, OAKEMU_METRICS_HOST to an address of this machine)"
            ) from exc
        self.port: int = self._server.server_port
        """The port actually served (useful with ``port=0``)."""
        self._closed = False

    def update(self, snapshot: TelemetrySnapshot) -> None:
        """Expose ``snapshot``'s figures from now on (thread-safe, O(1))."""
        self._collector.set(snapshot)

    def close(self) -> None:
        """Stop the HTTP server and remove the metrics from the registry. Idempotent."""
        if not self._closed:
            self._closed = True
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self.registry.unregister(self._process)
            self.registry.unregister(self._collector)

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
