"""Read-only, lossy telemetry from the learner: the snapshot and its ZeroMQ PUB/SUB channel.

The learner builds one :class:`TelemetrySnapshot` about once per second and after every PPO update
(its figure fields: the rows of :data:`oakemu_core.run.metrics_table.METRICS`; its curves:
:mod:`oakemu_core.run.telemetry_history`) and hands it to

* :class:`TelemetryPublisher` - a ZeroMQ PUB socket (default port 5558). Any number of monitors
  (:class:`TelemetrySubscriber`, ``oakemu monitor``) may attach and detach at any time. Sending never
  blocks: a PUB socket drops messages for a subscriber whose queue (``send_hwm`` messages) is full,
  and the send itself is ``NOBLOCK``. Telemetry is lossy by design, so no monitor can slow or change
  training. (Trajectory data never travels over PUB/SUB: see ``transport/steps.py`` / ``storage/assembler.py``.)
* :class:`~oakemu_core.run.prometheus.PrometheusExporter` - the same figures as Prometheus metrics
  over HTTP (default port 9100), all named ``oakemu_*``.

Wire format of one telemetry message (two ZeroMQ frames, no pickle):

1. the topic :data:`TELEMETRY_TOPIC` (``b"oakemu.telemetry"``);
2. a msgpack map: the snapshot's fields (``TelemetrySnapshot.model_dump()``) including
   ``protocol_version`` = :data:`TELEMETRY_PROTOCOL_VERSION`.

A subscriber rejects (counts and skips) any message that is not exactly that: wrong frame count or
topic, bytes that are not msgpack, another protocol version, a missing or mistyped field.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pydantic
import zmq

from oakemu_core.errors import UserError
from oakemu_core.run.metrics_table import snapshot_fields
from oakemu_core.run.telemetry_history import TelemetryHistoryData

TELEMETRY_PROTOCOL_VERSION = 3
"""Version of the telemetry message layout; bumped on any incompatible change of the fields
(2: evaluation figures, history curves, message/checkpoint counters, trainable share; 3: trained env steps)."""

TELEMETRY_TOPIC = b"oakemu.telemetry"
"""First frame of every telemetry message (ZeroMQ SUB prefix filter)."""

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Largest telemetry message a subscriber accepts (bytes); larger ones drop the connection."""

DROPPED_KINDS = (
    "stale_rows",
    "stale_steps",
    "no_capacity_steps",
    "discarded_segment_rows",
    "timed_out_actors",
    "late_steps",
)
"""Kinds of dropped data the learner counts (keys of :attr:`TelemetrySnapshot.dropped`)."""


class TelemetryError(RuntimeError):
    """Base class of telemetry errors a user can cause (bad address, port in use)."""


class TelemetryBindError(TelemetryError, UserError):
    """The publisher or the Prometheus exporter cannot bind its address / port."""


class TelemetryAddressError(TelemetryError, UserError, ValueError):
    """A connect address is not a valid ZeroMQ endpoint."""


class TelemetryRejected(ValueError):
    """A received telemetry message is malformed; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ActorTelemetry(pydantic.BaseModel):
    """What the learner knows about one connected actor.

    Attributes:
        actor_id: the actor's id (numbers are accepted and turned into strings).
        incarnation: id of this start of the actor (new on every start; numbers become strings).
        num_envs: environments the actor steps (columns it fills per segment).
        sps: env steps per second received from this actor (all its envs), recent window.
        policy_lag: mean policy lag (learner version - version that acted) of its recent rows, in
            policy versions; ``None`` before its first row.
        policy_lag_min, policy_lag_max: min / max of that lag over the same rows (at arrival, in
            versions); ``None`` before its first row.
        last_heard_s: seconds since the learner last received anything from this actor.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True)

    actor_id: str
    incarnation: str
    num_envs: int = pydantic.Field(ge=0)
    sps: float = pydantic.Field(ge=0)
    policy_lag: float | None = None
    policy_lag_min: float | None = None
    policy_lag_max: float | None = None
    last_heard_s: float = pydantic.Field(ge=0)


class _SnapshotMessage(pydantic.BaseModel):
    """The fields of a telemetry message that are not figures of :data:`METRICS` (the base of
    :class:`TelemetrySnapshot`).

    Attributes:
        protocol_version: must equal :data:`TELEMETRY_PROTOCOL_VERSION`.
        time: unix time (s) at which the learner built the snapshot.
        run_name, env_id: the run and its Gymnasium environment id.
        rejected_messages: messages rejected since start, by reason.
        dropped: rows / steps / actors dropped since start, by kind (see :data:`DROPPED_KINDS`).
        messages_received: ZeroMQ messages the learner read, by socket (``data``, ``control``).
        messages_accepted: messages it served, by kind (``step``, ``join``, ``heartbeat``, ``leave``,
            ``weights_request`` (weights asked for on the control socket), ``join_refused`` (learner
            stopping), ``unknown_actor_control`` (heartbeat/leave/weights request of an incarnation
            it does not know: answered "rejoin")). Every message read is accepted, rejected
            (:attr:`rejected_messages`, except ``unauthorized_key``, which counts refused
            connections) or a late step (``dropped["late_step_messages"]``).
        history: bounded training / evaluation curves of the whole run
            (:class:`~oakemu_core.run.telemetry_history.TelemetryHistoryData`).
        actors: the connected actors.
        is_update: ``True`` when the snapshot was published right after a PPO update.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    protocol_version: int = TELEMETRY_PROTOCOL_VERSION
    time: float
    run_name: str
    env_id: str
    rejected_messages: dict[str, pydantic.NonNegativeInt] = pydantic.Field(default_factory=dict)
    dropped: dict[str, pydantic.NonNegativeInt] = pydantic.Field(default_factory=dict)
    messages_received: dict[str, pydantic.NonNegativeInt] = pydantic.Field(default_factory=dict)
    messages_accepted: dict[str, pydantic.NonNegativeInt] = pydantic.Field(default_factory=dict)
    history: TelemetryHistoryData = pydantic.Field(default_factory=TelemetryHistoryData)
    actors: list[ActorTelemetry] = pydantic.Field(default_factory=list)
    is_update: bool = False

    @pydantic.field_validator("protocol_version")
    @classmethod
    def _check_protocol_version(cls, value: int) -> int:
        if value != TELEMETRY_PROTOCOL_VERSION:
            raise ValueError(
                f"telemetry protocol_version {value} is not supported: expected "
                f"{TELEMETRY_PROTOCOL_VERSION} (learner and monitor come from different versions)"
            )
        return value

    @property
    def num_actors(self) -> int:
        """Number of connected actors."""
        return len(self.actors)


TelemetrySnapshot = pydantic.create_model(
    "TelemetrySnapshot",
    __base__=_SnapshotMessage,
    __module__=__name__,
    __doc__="""The learner's state at one moment; one telemetry message.

    Every figure is a plain Python scalar so the snapshot encodes with msgpack and JSON. Beside the
    fields of its base (``time``, ``run_name``, ``env_id``, message counters, ``history``,
    ``actors``, ``is_update``), it has one field per row of
    :data:`~oakemu_core.run.metrics_table.METRICS` with a ``snapshot`` name, of that row's type and
    default, documented by its ``doc`` (``global_step``, ``sps``, ``policy_loss``, ...). Optional
    figures are ``None`` until they exist (no episode finished yet, no update yet).
    """,
    **snapshot_fields(),
)


def encode_snapshot(snapshot: TelemetrySnapshot) -> bytes:
    """Encode a snapshot as the msgpack map of its fields (second frame of a telemetry message)."""
    return msgpack.packb(snapshot.model_dump(mode="python"), use_bin_type=True)


def decode_snapshot(payload: bytes) -> TelemetrySnapshot:
    """Decode and validate the msgpack payload of a telemetry message.

    Raises:
        TelemetryRejected: the bytes are not msgpack, not a map, carry another protocol version,
            or a field is missing, unknown or of the wrong type.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types for bad bytes
        raise TelemetryRejected(f"payload is not msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise TelemetryRejected(f"payload is a msgpack {type(obj).__name__}, expected a map")
    try:
        return TelemetrySnapshot.model_validate(obj)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "<root>"
        raise TelemetryRejected(
            f"invalid field {field!r}: {first['msg']} (received {first.get('input')!r:.80})"
        ) from exc


def decode_frames(frames: list[bytes]) -> TelemetrySnapshot:
    """Decode one multipart telemetry message ``[TELEMETRY_TOPIC, payload]``.

    Raises:
        TelemetryRejected: wrong number of frames, wrong topic, or a bad payload (see
            :func:`decode_snapshot`).
    """
    if len(frames) != 2:
        raise TelemetryRejected(f"expected 2 frames (topic, payload), received {len(frames)}")
    if frames[0] != TELEMETRY_TOPIC:
        raise TelemetryRejected(f"topic {frames[0]!r:.60} is not {TELEMETRY_TOPIC!r}")
    return decode_snapshot(frames[1])


def _open_socket(
    context: zmq.Context | None,
    kind: int,
    security: Any,
    options: dict[int, Any],
    attach: Callable[[zmq.Socket], None],
    error: Callable[[zmq.ZMQError], TelemetryError],
) -> zmq.Socket:
    """A ZeroMQ socket of ``kind`` with CURVE (``security.apply``, or None), ``LINGER`` 0 and
    ``options``, then bound or connected by ``attach``.

    Raises:
        TelemetryError: ``error(exc)`` when ``attach`` fails (the socket is closed first).
    """
    sock = (context or zmq.Context.instance()).socket(kind)
    if security is not None:  # oakemu_core.transport.auth: a CURVE server (PUB) or client (SUB)
        security.apply(sock)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in options.items():
        sock.setsockopt(option, value)
    try:
        attach(sock)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise error(exc) from exc
    return sock


class TelemetryPublisher:
    """ZeroMQ PUB socket the learner publishes snapshots on; never blocks the caller.

    Args:
        bind_address: ZeroMQ endpoint to bind, e.g. ``"tcp://0.0.0.0:5558"``, ``"tcp://127.0.0.1:*"``
            (random port, see :attr:`address`) or ``"ipc:///tmp/oakemu-telemetry"``.
        send_hwm: messages queued per subscriber before further ones are dropped for it.
        context: ZeroMQ context to use (default: the process-wide ``zmq.Context.instance()``).
        security: an :class:`oakemu_core.transport.auth.ServerSecurity` to make the socket a CURVE server, or None.

    Raises:
        TelemetryBindError: the address is invalid or already in use.
    """

    def __init__(
        self,
        bind_address: str,
        *,
        send_hwm: int = 4,
        context: zmq.Context | None = None,
        security: Any = None,
    ) -> None:
        self._socket = _open_socket(
            context,
            zmq.PUB,
            security,
            {zmq.SNDHWM: send_hwm},
            lambda sock: sock.bind(bind_address),
            lambda exc: TelemetryBindError(
                f"cannot bind telemetry publisher to {bind_address!r}: {exc} "
                "(set OAKEMU_TELEMETRY_PORT / OAKEMU_BIND_HOST to a free address)"
            ),
        )
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound endpoint, with the actual port when ``bind_address`` used ``*``."""
        self.published = 0
        """Snapshots handed to ZeroMQ."""
        self.dropped = 0
        """Snapshots ZeroMQ refused at once (never retried)."""
        self._closed = False

    def publish(self, snapshot: TelemetrySnapshot) -> bool:
        """Send one snapshot to every attached subscriber without blocking.

        Returns:
            ``True`` when ZeroMQ accepted the message, ``False`` when it was dropped at once.
            Subscribers whose queue is full miss it silently (lossy by design).
        """
        if self._closed:
            raise TelemetryError("publish() on a closed TelemetryPublisher")
        try:
            self._socket.send_multipart(
                [TELEMETRY_TOPIC, encode_snapshot(snapshot)], flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self.dropped += 1
            return False
        self.published += 1
        return True

    def close(self) -> None:
        """Close the socket (pending messages are discarded). Idempotent."""
        if not self._closed:
            self._closed = True
            self._socket.close(linger=0)

    def __enter__(self) -> TelemetryPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class TelemetrySubscriber:
    """ZeroMQ SUB socket that receives the learner's snapshots (the monitor's side).

    Connecting succeeds even when no learner listens (ZeroMQ reconnects in the background);
    :meth:`receive` then returns ``None`` after its timeout.

    Args:
        connect_address: endpoint of the learner's telemetry publisher, e.g. ``"tcp://learner:5558"``.
        max_message_bytes: larger messages make ZeroMQ drop the connection (and reconnect).
        receive_hwm: messages queued locally; older ones are dropped first by the publisher side.
        context: ZeroMQ context to use (default: the process-wide ``zmq.Context.instance()``).
        security: an :class:`oakemu_core.transport.auth.ClientSecurity` to connect as a CURVE client, or None.

    Raises:
        TelemetryAddressError: ``connect_address`` is not a valid ZeroMQ endpoint.
    """

    def __init__(
        self,
        connect_address: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        receive_hwm: int = 16,
        context: zmq.Context | None = None,
        security: Any = None,
    ) -> None:
        self.connect_address = connect_address
        self._socket = _open_socket(
            context,
            zmq.SUB,
            security,
            {
                zmq.RCVHWM: receive_hwm,
                zmq.MAXMSGSIZE: max_message_bytes,
                zmq.SUBSCRIBE: TELEMETRY_TOPIC,
            },
            lambda sock: sock.connect(connect_address),
            lambda exc: TelemetryAddressError(
                f"telemetry address {connect_address!r} is not a valid ZeroMQ "
                f"endpoint (expected tcp://HOST:PORT or ipc://PATH): {exc}"
            ),
        )
        self.received = 0
        """Valid snapshots received."""
        self.rejected = 0
        """Malformed messages received and skipped."""
        self.last_rejection: str | None = None
        """Reason of the last rejected message."""
        self._closed = False

    def receive(self, timeout_s: float) -> TelemetrySnapshot | None:
        """Wait up to ``timeout_s`` seconds for the next valid snapshot.

        Malformed messages are counted in :attr:`rejected`, their reason kept in
        :attr:`last_rejection`, and skipped; waiting goes on until the deadline.

        Returns:
            The snapshot, or ``None`` when none arrived in time.
        """
        if self._closed:
            raise TelemetryError("receive() on a closed TelemetrySubscriber")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            remaining_ms = max(0, int(math.ceil((deadline - time.monotonic()) * 1000)))
            if not self._socket.poll(remaining_ms, zmq.POLLIN):
                return None
            frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            try:
                snapshot = decode_frames(frames)
            except TelemetryRejected as exc:
                self.rejected += 1
                self.last_rejection = exc.reason
                continue
            self.received += 1
            return snapshot

    def close(self) -> None:
        """Close the socket. Idempotent."""
        if not self._closed:
            self._closed = True
            self._socket.close(linger=0)

    def __enter__(self) -> TelemetrySubscriber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
