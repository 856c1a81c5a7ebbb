"""Read-only, lossy telemetry from the learner: the snapshot and its ZeroMQ PUB/SUB channel.

The learner builds one :class:`TelemetrySnapshot` about once per second and after every PPO update
and hands it to

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
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pydantic
import zmq

from oakemu_core.errors import UserError

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


HISTORY_MAX_POINTS = 512
"""Most points each series of :class:`TelemetryHistoryData` holds (and a subscriber accepts)."""


class TrainingPoint(pydantic.BaseModel):
    """One PPO update in the learner's history.

    Attributes:
        global_step: env steps of the run at the update (all envs).
        time: unix time (s) of the update.
        episodic_return: mean raw episodic return of the recent episode window; None while empty.
        sps: env steps per second (recent window); None when unknown.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    global_step: int = pydantic.Field(ge=0)
    time: float
    episodic_return: float | None = None
    sps: float | None = None


class EvaluationPoint(pydantic.BaseModel):
    """One tester evaluation in the learner's history (see ``oakemu_core.run.tester``).

    Attributes:
        global_step: env steps of the run when the evaluated weights were submitted.
        time: unix time (s) at which the evaluation finished.
        policy_version: version of the evaluated weights.
        return_mean / return_std: mean and population std of the raw episodic return (None if
            not finite).
        length_mean: mean episode length (agent steps; None if not finite).
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    global_step: int = pydantic.Field(ge=0)
    time: float
    policy_version: int = pydantic.Field(ge=0)
    return_mean: float | None
    return_std: float | None
    length_mean: float | None


class TelemetryHistoryData(pydantic.BaseModel):
    """The learner's bounded history, sent in every snapshot so a late monitor sees whole curves.

    Each series holds at most :data:`HISTORY_MAX_POINTS` points, oldest first, in increasing
    ``global_step``; a long run is downsampled evenly (see :class:`TelemetryHistory`), the first
    and the newest point always kept.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    training: list[TrainingPoint] = pydantic.Field(
        default_factory=list, max_length=HISTORY_MAX_POINTS
    )
    evaluations: list[EvaluationPoint] = pydantic.Field(
        default_factory=list, max_length=HISTORY_MAX_POINTS
    )


class _DownsampledSeries:
    """At most ``capacity`` points of an unbounded stream, evenly spaced by arrival index.

    Point ``i`` (0-based arrival index) is kept while ``i % stride == 0``; the newest point is
    always kept as well. When the kept points exceed ``capacity`` the stride doubles (every other
    point goes), so a run of any length keeps its whole curve at a coarser resolution.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError(f"history capacity: expected >= 2, received {capacity}")
        self.capacity = capacity
        self.stride = 1
        self.count = 0
        self._items: list[tuple[int, Any]] = []

    def add(self, point: Any) -> None:
        index, self.count = self.count, self.count + 1
        if self._items and self._items[-1][0] % self.stride != 0:
            self._items.pop()  # the previous newest point was off the grid: it only stood for "newest"
        self._items.append((index, point))
        while len(self._items) > self.capacity:
            self.stride *= 2
            newest = self._items[-1]
            self._items = [item for item in self._items[:-1] if item[0] % self.stride == 0]
            self._items.append(newest)

    def points(self) -> list[Any]:
        return [point for _, point in self._items]

    def state(self) -> dict[str, Any]:
        return {
            "stride": self.stride,
            "count": self.count,
            "indexes": [index for index, _ in self._items],
        }


class TelemetryHistory:
    """The learner's history of training and evaluation figures, for :class:`TelemetrySnapshot`.

    The learner calls :meth:`record_update` after every PPO update and :meth:`record_evaluation`
    for every tester report, and passes :meth:`snapshot_fields` into every snapshot
    (``TelemetrySnapshot(..., **history.snapshot_fields())``): the latest evaluation figures,
    the best evaluation return, and :class:`TelemetryHistoryData` (bounded: at most
    ``max_points`` points per series, about 30 kB of msgpack at 512). Thread-safe.
    :meth:`state_dict` / :meth:`load_state_dict` carry it through a checkpoint (plain values),
    so a resumed run keeps its curves.

    Args:
        max_points: points kept per series (2..:data:`HISTORY_MAX_POINTS`).

    Raises:
        ValueError: ``max_points`` out of range.
    """

    def __init__(self, max_points: int = HISTORY_MAX_POINTS) -> None:
        if not 2 <= int(max_points) <= HISTORY_MAX_POINTS:
            raise ValueError(f"max_points: expected 2..{HISTORY_MAX_POINTS}, received {max_points}")
        self.max_points = int(max_points)
        self._lock = threading.Lock()
        self._training = _DownsampledSeries(self.max_points)
        self._evaluations = _DownsampledSeries(self.max_points)
        self._latest: EvaluationPoint | None = None
        self.best_eval_return: float | None = None
        """Highest mean evaluation return so far (None before the first evaluation)."""
        self.eval_video: str | None = None
        """Path of the newest evaluation video (None before the first)."""
        self._data: TelemetryHistoryData | None = None

    def record_update(
        self,
        global_step: int,
        episodic_return: float | None,
        sps: float | None,
        *,
        time_s: float | None = None,
    ) -> None:
        """Add one PPO update: env steps so far, mean raw return of the episode window (NaN or None
        while empty) and env steps per second; ``time_s`` defaults to now (unix s)."""
        point = TrainingPoint(
            global_step=int(global_step),
            time=time.time() if time_s is None else float(time_s),
            episodic_return=_finite(episodic_return),
            sps=_finite(sps),
        )
        with self._lock:
            self._training.add(point)
            self._data = None

    def record_evaluation(self, report: Any) -> None:
        """Add one evaluation: an :class:`oakemu_core.run.tester.EvaluationReport` (or any object with
        ``global_step``, ``policy_version``, ``return_mean``, ``return_std``, ``length_mean`` and
        ``finished_at``)."""
        point = EvaluationPoint(
            global_step=int(report.global_step),
            time=float(report.finished_at),
            policy_version=int(report.policy_version),
            return_mean=_finite(report.return_mean),
            return_std=_finite(report.return_std),
            length_mean=_finite(report.length_mean),
        )
        with self._lock:
            self._evaluations.add(point)
            self._latest = point
            self.eval_video = getattr(report, "video_path", None) or self.eval_video
            if point.return_mean is not None and (
                self.best_eval_return is None or point.return_mean > self.best_eval_return
            ):
                self.best_eval_return = point.return_mean
            self._data = None

    def data(self) -> TelemetryHistoryData:
        """The history as sent in snapshots (built once per change)."""
        with self._lock:
            if self._data is None:
                self._data = TelemetryHistoryData(
                    training=self._training.points(), evaluations=self._evaluations.points()
                )
            return self._data

    def snapshot_fields(self) -> dict[str, Any]:
        """Keyword arguments for :class:`TelemetrySnapshot`: ``eval_return_mean``,
        ``eval_return_std``, ``eval_length_mean``, ``eval_policy_version``, ``best_eval_return``,
        ``eval_video`` and ``history``."""
        history = self.data()
        with self._lock:
            latest, best, video = self._latest, self.best_eval_return, self.eval_video
        return {
            "eval_return_mean": None if latest is None else latest.return_mean,
            "eval_return_std": None if latest is None else latest.return_std,
            "eval_length_mean": None if latest is None else latest.length_mean,
            "eval_policy_version": None if latest is None else latest.policy_version,
            "best_eval_return": best,
            "eval_video": video,
            "history": history,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain values (for a checkpoint) that :meth:`load_state_dict` restores."""
        with self._lock:
            return {
                "max_points": self.max_points,
                "training": [point.model_dump() for point in self._training.points()],
                "training_series": self._training.state(),
                "evaluations": [point.model_dump() for point in self._evaluations.points()],
                "evaluation_series": self._evaluations.state(),
                "best_eval_return": self.best_eval_return,
                "eval_video": self.eval_video,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values.

        Raises:
            ValueError: malformed state (a point fails validation, or counts disagree).
        """
        try:
            series = []
            for key, model in (("training", TrainingPoint), ("evaluations", EvaluationPoint)):
                points = [model.model_validate(item) for item in state[key]]
                meta = state["training_series" if key == "training" else "evaluation_series"]
                if len(meta["indexes"]) != len(points) or len(points) > self.max_points:
                    raise ValueError(
                        f"history {key}: {len(points)} points, {len(meta['indexes'])} indexes, "
                        f"capacity {self.max_points}"
                    )
                restored = _DownsampledSeries(self.max_points)
                restored.stride, restored.count = int(meta["stride"]), int(meta["count"])
                restored._items = list(zip((int(i) for i in meta["indexes"]), points))
                series.append(restored)
        except (KeyError, TypeError, pydantic.ValidationError) as exc:
            raise ValueError(f"telemetry history state: {type(exc).__name__}: {exc}") from exc
        best = state.get("best_eval_return")
        with self._lock:
            self._training, self._evaluations = series
            evaluations = self._evaluations.points()
            self._latest = evaluations[-1] if evaluations else None
            self.best_eval_return = None if best is None else float(best)
            self.eval_video = state.get("eval_video")
            self._data = None


def _finite(value: float | None) -> float | None:
    """``value`` as a float, or None for None / NaN / infinities."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class TelemetrySnapshot(pydantic.BaseModel):
    """The learner's state at one moment; one telemetry message.

    Every figure is a plain Python scalar so the snapshot encodes with msgpack and JSON.
    Optional figures are ``None`` until they exist (no episode finished yet, no update yet).

    Attributes:
        protocol_version: must equal :data:`TELEMETRY_PROTOCOL_VERSION`.
        time: unix time (s) at which the learner built the snapshot.
        run_name, env_id: the run and its Gymnasium environment id.
        global_step: env steps written to rollout buffers since the run started (all envs); the
            same count as ``global_step`` in ``metrics.jsonl`` and the checkpoints.
        sps: env steps per second, wall clock since the learner started (start-up included;
            ``charts/SPS`` in the metrics).
        sps_recent: env steps per second over the last ~10 s (``charts/SPS_recent``).
        policy_version: version of the newest published weights.
        iterations: PPO updates completed.
        trained_env_steps: env steps of the rollouts PPO trained on (the count the budget
            ``total_env_steps`` is spent by; rows discarded or too stale never count).
        episodes: episodes finished (all actors).
        episodic_return_mean / _min / _max: raw game score over the recent episode window.
        episodic_length_mean: episode length (env steps) over the recent episode window.
        policy_loss, value_loss, entropy, approx_kl, clip_fraction, explained_variance:
            statistics of the last PPO update (CleanRL's ``losses/*`` figures).
        learning_rate: the optimizer's current learning rate.
        buffer_fill: fraction (0..1) of rows written in the buffer that is filling.
        rejected_messages: messages rejected since start, by reason.
        dropped: rows / steps / actors dropped since start, by kind (see :data:`DROPPED_KINDS`).
        policy_lag_min / _mean / _max: policy lag (versions) of the rows of the last rollout.
        messages_received: ZeroMQ messages the learner read, by socket (``data``, ``control``).
        messages_accepted: messages it served, by kind (``step``, ``join``, ``heartbeat``, ``leave``,
            ``weights_request`` (weights asked for on the control socket), ``join_refused`` (learner
            stopping), ``unknown_actor_control`` (heartbeat/leave/weights request of an incarnation it
            does not know: answered "rejoin")). Every message read is accepted, rejected
            (:attr:`rejected_messages`, except ``unauthorized_key``, which counts refused connections) or
            a late step (``dropped["late_step_messages"]``).
        checkpoint_failures: checkpoint writes that failed (full disk, ...) since the learner started.
        log_write_failures: metrics / episode records and TensorBoard writes dropped by failed writes.
        trainable_share: fraction (0..1) of the last rollout's written rows that PPO trained on
            (routed and stale rows are stored for GAE but not trained on); None before an update.
        eval_return_mean / eval_return_std / eval_length_mean: the latest tester evaluation (raw
            episodic return mean and population std, mean length in agent steps); None before one.
        eval_policy_version: version of the weights that evaluation played.
        rollout_columns / planned_columns: columns that held rows in the newest update's rollout,
            and the columns the run's planned actors fill (fewer: it trained with fewer rows; more:
            more actors joined); None before an update.
        best_eval_return: highest evaluation mean return so far (the evaluation kept as best.pt).
        eval_video: path (on the learner's machine) of the newest evaluation video, or None.
        history: bounded training / evaluation curves of the whole run (:class:`TelemetryHistoryData`).
        actors: the connected actors.
        is_update: ``True`` when the snapshot was published right after a PPO update.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    protocol_version: int = TELEMETRY_PROTOCOL_VERSION
    time: float
    run_name: str
    env_id: str
    global_step: int = pydantic.Field(ge=0)
    sps: float = pydantic.Field(ge=0)
    sps_recent: float = pydantic.Field(default=0.0, ge=0)
    policy_version: int = pydantic.Field(ge=0)
    iterations: int = pydantic.Field(ge=0)
    trained_env_steps: int = pydantic.Field(default=0, ge=0)
    episodes: int = pydantic.Field(ge=0)
    episodic_return_mean: float | None = None
    episodic_return_min: float | None = None
    episodic_return_max: float | None = None
    episodic_length_mean: float | None = None
    policy_loss: float | None = None
    value_loss: float | None = None
    entropy: float | None = None
    approx_kl: float | None = None
    clip_fraction: float | None = None
    explained_variance: float | None = None
    learning_rate: float | None = None
    buffer_fill: float = pydantic.Field(default=0.0, ge=0.0, le=1.0)
    rejected_messages: dict[str, pydantic.NonNegativeInt] = pydantic.Field(default_factory=dict)
    dropped: dict[str, pydantic.NonNegativeInt] = pydantic.Field(default_factory=dict)
    policy_lag_min: float | None = None
    policy_lag_mean: float | None = None
    policy_lag_max: float | None = None
    messages_received: dict[str, pydantic.NonNegativeInt] = pydantic.Field(default_factory=dict)
    messages_accepted: dict[str, pydantic.NonNegativeInt] = pydantic.Field(default_factory=dict)
    checkpoint_failures: int = pydantic.Field(default=0, ge=0)
    log_write_failures: int = pydantic.Field(default=0, ge=0)
    trainable_share: float | None = pydantic.Field(default=None, ge=0.0, le=1.0)
    eval_return_mean: float | None = None
    eval_return_std: float | None = None
    eval_length_mean: float | None = None
    eval_policy_version: int | None = pydantic.Field(default=None, ge=0)
    rollout_columns: int | None = pydantic.Field(default=None, ge=0)
    planned_columns: int | None = pydantic.Field(default=None, ge=0)
    best_eval_return: float | None = None
    eval_video: str | None = None
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
