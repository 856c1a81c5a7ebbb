"""The inference server of ``oakemu train`` (``actor_inference = "central"``): ONE process that runs the
forward passes of every local actor, in batches, on ``inference_device`` (the GPU when there is one).

SEED RL's central inference and Sample Factory's policy workers. Each actor's forward pass
(:class:`~oakemu_core.actor.central_inference.CentralForward`) is a request on this process's ROUTER
socket (an ``ipc://`` address in a private temporary folder of the launcher,
:data:`~oakemu_core.actor.central_inference.INFERENCE_ADDRESS_ENV`); wire form:
:mod:`oakemu_core.transport.inference_wire`. One turn of the loop (:meth:`InferenceServer.turn`):

1. every message waiting on the learner's weights channel is read (not only the newest, as an actor
   does: an actor may act with any of them) and loaded into a model of its own
   (:class:`ServedModels`: the newest :data:`KEEP_VERSIONS` weights, ``(policy_version, revision)``);
2. the requests waiting are drained (at most :data:`MAX_BATCH_REQUESTS`), grouped by the weights they
   name, and each group's observations go through ONE forward pass; the outputs are split back into
   one reply per request;
3. a request for weights newer than the newest held waits at most :data:`VERSION_WAIT_S` for them on
   the weights channel (the actor heard of them first); weights not held and not on their way are
   answered ``missing``, and the actor sends them with its request again (the join's weights, which
   the weights channel never carries, come this way).

Batch sizes, requests per client and weights sent by actors are logged every :data:`STATS_PERIOD_S`
and at the end. The server stops on SIGTERM / SIGINT (``oakemu train`` sends it once the actors have
stopped: an actor's last requests after the learner's stop notice are still answered) or its
launcher's death. Run by ``oakemu train`` as ``python -m oakemu_services.inference`` (its settings from
``OAKEMU_CONFIG_FILE``, like the other children).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq
from oakemu_services.runtime import (
    SETUP_ERROR_EXIT_STATUS,
    install_stop_signals,
    interrupted_status,
    setup_logging,
    startup_done,
)

from oakemu_core.actor.central_inference import INFERENCE_ADDRESS_ENV
from oakemu_core.config import ConfigError, OakEmuConfig, load_config, resolved_device
from oakemu_core.envs.factory import env_spec
from oakemu_core.errors import UserError
from oakemu_core.policy.models import ActorCritic, build_model, load_weight_arrays
from oakemu_core.policy.numpy_inference import NumpyForward
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.transport.auth import client_security
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.control import StopNotice, WeightsMessage, decode_message
from oakemu_core.transport.inference_wire import (
    ForwardRequest,
    InferencePing,
    InferenceReply,
    decode_inference_message,
    encode_inference_message,
)
from oakemu_core.transport.keepalive import keep_alive

__all__ = ["InferenceServer", "ServedModels", "BatchStats", "main"]

log = logging.getLogger("oakemu.inference")

KEEP_VERSIONS = 8
"""Weights (versions and revisions) the server holds a model of; the least recently used goes first."""
VERSION_WAIT_S = 1.0
"""How long a request for weights newer than the newest held waits for them on the weights channel."""
MAX_BATCH_REQUESTS = 256
"""The most requests drained for one turn."""
STATS_PERIOD_S = 30.0
"""Seconds between two log lines of batch statistics."""
WEIGHTS_QUEUE_MESSAGES = 16
"""Weights messages the server's SUB socket queues (it reads them all)."""

Key = tuple[int, int]
"""``(policy_version, revision)``."""


class ServedModels:
    """Models of the newest weights, on the inference device, by ``(policy_version, revision)``, each
    with the forward pass that serves it: on a CPU, for an MLP model, the actors' numpy pass
    (:class:`~oakemu_core.policy.numpy_inference.NumpyForward`, what ``actor_inference = "auto"`` picks:
    a few rows through torch modules cost several times more); else the module.

    Args:
        build: makes a new model (eval mode, on the device); called once per kept weights at most.
        keep: how many weights are kept; adding one more drops the least recently used (its model is
            reused for the new weights).
    """

    def __init__(self, build: Callable[[], ActorCritic], keep: int = KEEP_VERSIONS) -> None:
        self._build = build
        self._keep = keep
        self._models: OrderedDict[Key, tuple[ActorCritic, Any]] = OrderedDict()
        self.newest: Key | None = None
        """The newest weights ever added (ordered by version, then revision)."""

    def __contains__(self, key: Key) -> bool:
        return key in self._models

    def keys(self) -> list[Key]:
        return sorted(self._models)

    def get(self, key: Key) -> tuple[ActorCritic, Any] | None:
        """``(model, forward pass)`` of ``key``'s weights (now the most recently used), or None; the
        forward pass has the contract of :meth:`~oakemu_core.policy.models.ActorCritic.forward`."""
        served = self._models.get(key)
        if served is not None:
            self._models.move_to_end(key)
        return served

    def add(self, key: Key, weights: dict[str, np.ndarray]) -> None:
        """Hold ``weights`` as ``key`` (weights already held under ``key`` stay as they are).

        Raises:
            ValueError: the weights do not fit the model (nothing is dropped then).
        """
        if key in self._models:
            return
        if len(self._models) < self._keep:
            model = self._build()
            load_weight_arrays(model, weights)
            forward = model
            if model.device.type == "cpu" and NumpyForward.unsupported_reason(model) is None:
                forward = NumpyForward(model)
        else:
            oldest = next(iter(self._models))
            model, forward = self._models[oldest]
            load_weight_arrays(model, weights)  # validated before anything is written
            if forward is not model:
                forward.load(model)
            del self._models[oldest]
        self._models[key] = (model, forward)
        self.newest = key if self.newest is None else max(self.newest, key)


@dataclass
class BatchStats:
    """What the server served since the last log line (and in all)."""

    batches: int = 0
    requests: int = 0
    rows: int = 0
    most_requests: int = 0
    most_rows: int = 0
    uploads: int = 0
    missing: int = 0
    errors: int = 0
    per_client: Counter[str] = field(default_factory=Counter)

    def served(self, clients: list[str], rows: int) -> None:
        """One forward pass of the requests of ``clients`` (one entry per request), ``rows`` rows."""
        self.batches += 1
        self.requests += len(clients)
        self.rows += rows
        self.most_requests = max(self.most_requests, len(clients))
        self.most_rows = max(self.most_rows, rows)
        self.per_client.update(clients)

    def line(self, seconds: float) -> str:
        """One log line: batches, requests and rows per batch (mean and largest), per client."""
        per_batch = max(1, self.batches)
        clients = ", ".join(f"{name} {count}" for name, count in sorted(self.per_client.items()))
        return (
            f"{self.batches} batches in {seconds:.0f} s: {self.requests / per_batch:.2f} requests "
            f"per batch (at most {self.most_requests}), {self.rows / per_batch:.1f} rows per batch "
            f"(at most {self.most_rows}); weights sent by actors {self.uploads}, answered missing "
            f"{self.missing}, errors {self.errors}; requests per client: {clients or 'none'}"
        )


@dataclass
class _Pending:
    identity: bytes
    request: ForwardRequest
    deadline: float


class InferenceServer:
    """The server's sockets and loop, without processes (tests run it in a thread).

    Args:
        models: the weights held.
        router: the bound ROUTER socket the actors' requests arrive on.
        weights: the SUB socket on the learner's weights channel, or None (tests add weights to
            ``models`` themselves).
        device: the inference device (``cpu``, ``cuda``, ...).
        max_bytes: the longest request accepted (a request may carry weights).
    """

    def __init__(
        self,
        models: ServedModels,
        router: zmq.Socket,
        weights: zmq.Socket | None,
        *,
        device: str,
        max_bytes: int,
    ) -> None:
        self.models = models
        self.router = router
        self.weights = weights
        self.device = torch.device(device)
        self.max_bytes = max_bytes
        self.pending: list[_Pending] = []
        self.newest_request: dict[bytes, int] = {}
        """The newest request id taken from each client (a client's ids grow; a request sent again
        after :data:`~oakemu_core.actor.central_inference.RESEND_S` is dropped when already taken)."""
        self.stats = BatchStats()
        self.total = BatchStats()
        self.poller = zmq.Poller()
        for sock in (router, weights):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; log statistics every :data:`STATS_PERIOD_S` and at the end."""
        started = last_line = time.monotonic()
        while not stop.is_set():
            self.turn(timeout_s=0.1)
            if time.monotonic() - last_line >= STATS_PERIOD_S:
                log.info("inference: %s", self.stats.line(time.monotonic() - last_line))
                self.stats, last_line = BatchStats(), time.monotonic()
        log.info("inference in all: %s", self.total_line(time.monotonic() - started))

    def total_line(self, seconds: float) -> str:
        """The statistics of the whole run (those since the last line included)."""
        total = self.total
        return total.line(seconds) if total.batches or total.errors else "no forward pass served"

    def turn(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` (less while a request waits for weights) for requests or
        weights; read every weights message, then serve what can be served."""
        now = time.monotonic()
        if self.pending:
            timeout_s = max(0.0, min(timeout_s, min(p.deadline for p in self.pending) - now))
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.weights is not None and ready.get(self.weights):
            self._read_weights()
        requests = self._drain() if ready.get(self.router) else []
        self._serve(requests, time.monotonic())

    def _read_weights(self) -> None:
        assert self.weights is not None
        while True:
            try:
                frame = self.weights.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = decode_message(frame.buffer, max_bytes=self.max_bytes)
            except MessageRejected as error:
                log.warning("inference: malformed weights message ignored: %s", error)
                continue
            if isinstance(message, StopNotice):  # the actors' last requests are still answered
                log.info("inference: the learner announced the end of the run (%s)", message.reason)
            elif isinstance(message, WeightsMessage):
                self._add((message.policy_version, message.revision), message.weights, "learner")

    def _add(self, key: Key, weights: dict[str, np.ndarray], source: str) -> bool:
        try:
            self.models.add(key, weights)
        except ValueError as error:
            log.error(
                "inference: the weights of %s from %s do not fit the model: %s", key, source, error
            )
            return False
        return True

    def _drain(self) -> list[tuple[bytes, ForwardRequest]]:
        """Every request waiting (at most :data:`MAX_BATCH_REQUESTS`) that was not taken before (a
        request sent again); pings are answered here, malformed requests refused."""
        requests = []
        while len(requests) < MAX_BATCH_REQUESTS:
            try:
                identity, frame = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            except ValueError:  # not [identity, frame]: nothing to answer
                continue
            try:
                message = decode_inference_message(frame.buffer, self.max_bytes)
            except MessageRejected as error:
                self._reply(identity.bytes, InferenceReply(0, "error", detail=str(error)))
                continue
            if isinstance(message, InferencePing):
                self._reply(
                    identity.bytes,
                    InferenceReply(message.request_id, "ready", detail=str(self.device)),
                )
            elif isinstance(message, ForwardRequest):
                client = identity.bytes
                if message.request_id > self.newest_request.get(client, 0):
                    self.newest_request[client] = message.request_id
                    requests.append((client, message))
        return requests

    def _serve(self, requests: list[tuple[bytes, ForwardRequest]], now: float) -> None:
        """Serve ``requests`` and the pending ones whose weights arrived; answer ``missing`` for those
        whose weights are not on their way, or did not come in time."""
        groups: dict[Key, list[tuple[bytes, ForwardRequest]]] = {}
        waiting, self.pending = self.pending, []
        waited = set()  # the requests that waited for their weights: they wait no more
        for entry in waiting:
            if entry.request.weights_key in self.models or now >= entry.deadline:
                requests.append((entry.identity, entry.request))
                waited.add(id(entry.request))
            else:
                self.pending.append(entry)
        for identity, request in requests:
            key = request.weights_key
            if request.weights is not None:
                self.stats.uploads += 1
                self.total.uploads += 1
            if key not in self.models and request.weights is not None:
                if not self._add(key, request.weights, identity.decode(errors="replace")):
                    self._refuse(
                        identity, request, "the weights sent do not fit the server's model"
                    )
                    continue
            if key in self.models:
                groups.setdefault(key, []).append((identity, request))
            elif self._on_their_way(key) and id(request) not in waited:
                self.pending.append(_Pending(identity, request, now + VERSION_WAIT_S))
            else:
                self.stats.missing += 1
                self.total.missing += 1
                self._reply(identity, InferenceReply(request.request_id, "missing"))
        for key, group in groups.items():
            served = self.models.get(key)
            assert served is not None
            self._forward(*served, group)

    def _on_their_way(self, key: Key) -> bool:
        """Weights newer than the newest held: published, and soon read from the weights channel."""
        newest = self.models.newest
        return self.weights is not None and newest is not None and key > newest

    def _forward(
        self, model: ActorCritic, forward: Any, group: list[tuple[bytes, ForwardRequest]]
    ) -> None:
        """One forward pass (``forward``, of ``model``) of the requests of ``group`` (those that fit
        the model) and their replies."""
        valid = []
        for identity, request in group:
            problem = _mismatch(model, request)
            if problem is None:
                valid.append((identity, request))
            else:
                self._refuse(identity, request, problem)
        if not valid:
            return
        requests = [request for _, request in valid]
        try:
            outputs = _batched_forward(model, forward, requests, self.device)
        except (ValueError, RuntimeError) as error:  # a forward pass the model refuses
            for identity, request in valid:
                self._refuse(identity, request, f"{type(error).__name__}: {error}")
            return
        bounds = np.cumsum([0, *(request.rows for request in requests)])
        clients = [identity.decode(errors="replace").rpartition("/")[0] for identity, _ in valid]
        for stats in (self.stats, self.total):
            stats.served(clients, int(bounds[-1]))
        for index, (identity, request) in enumerate(valid):
            rows = slice(bounds[index], bounds[index + 1])
            reply = InferenceReply(request.request_id, "outputs", tuple(o[rows] for o in outputs))
            self._reply(identity, reply)

    def _refuse(self, identity: bytes, request: ForwardRequest, detail: str) -> None:
        self.stats.errors += 1
        self.total.errors += 1
        log.warning(
            "inference: request of %s refused: %s", identity.decode(errors="replace"), detail
        )
        self._reply(identity, InferenceReply(request.request_id, "error", detail=detail))

    def _reply(self, identity: bytes, reply: InferenceReply) -> None:
        try:
            self.router.send_multipart([identity, encode_inference_message(reply)], zmq.NOBLOCK)
        except zmq.Again:  # the client is gone (its queue full): it times out
            pass


def _mismatch(model: ActorCritic, request: ForwardRequest) -> str | None:
    """Why ``request``'s arrays do not fit ``model`` (keys, trailing shapes, dtypes, the state), or None."""
    layout = model.observation_layout
    if set(request.observations) != set(layout):
        return f"observation keys {sorted(request.observations)}, the model takes {sorted(layout)}"
    for key, (shape, dtype) in layout.items():
        array = request.observations[key]
        if array.dtype != dtype or array.shape[1:] != tuple(shape):
            return (
                f"observations[{key!r}] {array.dtype} {array.shape[1:]}, the model takes "
                f"{np.dtype(dtype)} {tuple(shape)}"
            )
    state = request.state
    if model.recurrent:
        if (
            state is None
            or state.dtype != np.float32
            or state.shape != (request.rows, model.state_size)
        ):
            return f"a recurrent model takes a ({request.rows}, {model.state_size}) float32 state"
    elif state is not None:
        return "a feed-forward model takes no state"
    return None


@torch.no_grad()
def _batched_forward(
    model: ActorCritic, forward: Any, requests: list[ForwardRequest], device: torch.device
) -> list[np.ndarray]:
    """The outputs of ``forward`` (``model``'s forward pass) on all ``requests`` at once (their rows
    concatenated in order), as CPU float32 arrays; raises ValueError on non-finite outputs."""
    columns = {
        key: torch.from_numpy(np.concatenate([r.observations[key] for r in requests])).to(device)
        for key in model.observation_layout
    }
    observations = columns if model.is_dict else columns[""]
    if model.recurrent:
        state = torch.from_numpy(np.concatenate([r.state for r in requests])).to(device)  # type: ignore[misc]
        outputs = forward(observations, state)
    else:
        outputs = forward(observations)
    arrays = [output.to("cpu", torch.float32).numpy() for output in outputs]
    if not all(np.isfinite(array).all() for array in arrays):
        raise ValueError("the policy computed NaN or infinite outputs")
    return arrays


def build_served_models(config: OakEmuConfig, device: str) -> ServedModels:
    """The models of ``config``'s env and network on ``device`` (as an actor builds its own)."""
    spec = env_spec(
        config.env_id, settings_file=config.emulator_settings, options=config.env_options
    )
    distribution = schema_for_env(spec, config.network).distribution

    def build() -> ActorCritic:
        model = build_model(
            spec.observation_layout,
            distribution,
            normalize_observations=config.normalize_observations,
            network=config.network,
        )
        return model.to(device).eval()

    return ServedModels(build)


def serve(config: OakEmuConfig, address: str, stop: threading.Event) -> int:
    """Build the models, bind ``address``, follow the learner's weights channel and serve until the run
    ends; 0. Raises UserError when the device or the model cannot be set up."""
    device = resolved_device(config, "inference_device")
    if device.startswith("cuda"):  # float32 as the actors' CPUs compute it (the learner's setting)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # As many threads as one actor's forward passes take: more spin beside the actors and the learner.
    torch.set_num_threads(config.torch_threads)
    models = build_served_models(config, device)
    context = zmq.Context()
    try:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        weights = context.socket(zmq.SUB)
        security = client_security(config)
        if security is not None:
            security.apply(weights)
        keep_alive(weights)
        weights.setsockopt(zmq.RCVHWM, WEIGHTS_QUEUE_MESSAGES)
        weights.setsockopt(zmq.SUBSCRIBE, b"")
        weights.setsockopt(zmq.LINGER, 0)
        weights.connect(config.learner_address(config.weights_port))
        server = InferenceServer(
            models, router, weights, device=device, max_bytes=config.max_message_bytes
        )
        log.info(
            "inference server on %s: %s forward passes for the actors at %s (%d torch threads)",
            device,
            config.env_id,
            address,
            torch.get_num_threads(),
        )
        startup_done()
        server.run(stop)
    finally:
        context.destroy(linger=0)
    return 0


def main(config: OakEmuConfig) -> int:
    """The server process: 0 at the run's end or on SIGTERM (130 after Ctrl-C);
    :data:`~oakemu_services.runtime.SETUP_ERROR_EXIT_STATUS` when it cannot set up (no address, no
    such device, a model that cannot be built): restarting it would fail the same way."""
    setup_logging(config.log_level, config.log_format)
    stop = install_stop_signals()
    address = os.environ.get(INFERENCE_ADDRESS_ENV)
    if not address:
        log.error(
            "inference: %s is not set (oakemu train sets it for its inference server)",
            INFERENCE_ADDRESS_ENV,
        )
        return SETUP_ERROR_EXIT_STATUS
    try:
        return interrupted_status(serve(config, address, stop), stop)
    except (UserError, zmq.ZMQError) as error:
        log.error("inference: %s", error)
        return SETUP_ERROR_EXIT_STATUS
    except KeyboardInterrupt:
        return interrupted_status(0, stop)


def run(argv: list[str] | None = None) -> int:
    """``python -m oakemu_services.inference``: the settings of ``OAKEMU_CONFIG_FILE`` and ``OAKEMU_*``."""
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"oakemu inference: error: {error}", file=sys.stderr)
        return 2
    return main(config)


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
