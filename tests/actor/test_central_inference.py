"""Central inference (``actor_inference = "central"``): the actors' backend
(:class:`~oakemu_core.actor.central_inference.CentralForward`) against the inference server's loop
(:class:`oakemu_services.inference.InferenceServer`), in one process over ``inproc://`` sockets.

Batched requests of several clients get the local model's outputs; weights the server does not hold
are waited for (on the weights channel) or sent by the actor; refusals and a dead server are one clear
error, fast."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from oakemu_services.inference import InferenceServer, ServedModels

from oakemu_core.actor.central_inference import (
    CentralForward,
    CentralInferenceError,
    InferenceClient,
)
from oakemu_core.policy.distributions import Categorical
from oakemu_core.policy.models import ActorCritic
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.policy.weights import weights_to_arrays
from oakemu_core.transport.control import WeightsMessage, encode_weights
from oakemu_core.transport.inference_wire import (
    ForwardRequest,
    decode_inference_message,
    encode_inference_message,
)

ADDRESS = "inproc://inference"
WEIGHTS_ADDRESS = "inproc://weights"
MAX_BYTES = 64 * 1024 * 1024
TOLERANCE = 1e-5


def vector_model(seed: int = 0, network: NetworkSpec | None = None) -> ActorCritic:
    torch.manual_seed(seed)
    return ActorCritic({"": ((4,), np.dtype(np.float32))}, Categorical(2), network=network).eval()


def dict_model(seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    layout = {"position": ((3,), np.dtype(np.float32)), "grid": ((5, 5, 2), np.dtype(np.uint8))}
    return ActorCritic(layout, Categorical(3)).eval()


def observations_for(model: ActorCritic, rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        key: (
            rng.integers(0, 5, (rows, *shape))
            if dtype == np.uint8
            else rng.standard_normal((rows, *shape))
        ).astype(dtype)
        for key, (shape, dtype) in model.observation_layout.items()
    }


def as_tensors(model: ActorCritic, observations: dict[str, np.ndarray]) -> Any:
    tensors = {key: torch.from_numpy(array) for key, array in observations.items()}
    return tensors if model.is_dict else tensors[""]


class Server:
    """An :class:`InferenceServer` on ``inproc://`` sockets of ``context``, turned by the test
    (:meth:`turn`) or by a thread of its own (:meth:`running`), with the learner's weights channel a
    PUB socket of the test (:meth:`publish`)."""

    def __init__(
        self, context: zmq.Context, build: Callable[[], ActorCritic], max_bytes: int = MAX_BYTES
    ) -> None:
        self.publisher = context.socket(zmq.PUB)
        self.publisher.bind(WEIGHTS_ADDRESS)
        router = context.socket(zmq.ROUTER)
        router.bind(ADDRESS)
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(WEIGHTS_ADDRESS)
        self.models = ServedModels(build)
        self.server = InferenceServer(self.models, router, sub, device="cpu", max_bytes=max_bytes)
        self.sockets = [self.publisher, router, sub]

    def publish(self, version: int, model: ActorCritic, revision: int = 0) -> None:
        self.publisher.send(
            encode_weights(WeightsMessage(version, weights_to_arrays(model), revision))
        )

    def turn(self, times: int = 1) -> None:
        for _ in range(times):
            self.server.turn(timeout_s=0.05)

    @contextmanager
    def running(self) -> Iterator[None]:
        stop = threading.Event()
        thread = threading.Thread(target=self.server.run, args=(stop,), daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5.0)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def client(
    context: zmq.Context, name: str, timeout_s: float = 10.0, address: str = ADDRESS
) -> InferenceClient:
    return InferenceClient(context, address, name=name, timeout_s=timeout_s, max_bytes=MAX_BYTES)


@pytest.mark.parametrize("make_model", [vector_model, dict_model], ids=["vector", "dict"])
def test_requests_of_two_clients_are_one_forward_pass_with_the_local_outputs(
    context: zmq.Context, make_model: Callable[..., ActorCritic]
) -> None:
    """Two actors' requests of 3 and 5 rows waiting together are served by one forward pass; each gets
    its own rows of the model's outputs (within float32 rounding of its local forward pass)."""
    model = make_model()
    server = Server(
        context, lambda: make_model(seed=9)
    )  # the server's weights come from the model's
    server.models.add((4, 1), weights_to_arrays(model))
    dealers = [context.socket(zmq.DEALER) for _ in range(2)]
    try:
        for index, dealer in enumerate(dealers):
            dealer.routing_id = f"actor-{index}/0".encode()
            dealer.connect(ADDRESS)
        batches = [observations_for(model, rows, seed) for rows, seed in ((3, 1), (5, 2))]
        for index, (dealer, observations) in enumerate(zip(dealers, batches)):
            dealer.send(encode_inference_message(ForwardRequest(index + 1, 4, 1, observations)))
        time.sleep(0.1)  # both requests wait on the server's socket
        server.turn()
        assert (server.server.total.batches, server.server.total.most_requests) == (1, 2)
        assert server.server.total.most_rows == 8
        assert dict(server.server.total.per_client) == {"actor-0": 1, "actor-1": 1}
        for index, (dealer, observations) in enumerate(zip(dealers, batches)):
            assert dealer.poll(2000)
            reply = decode_inference_message(dealer.recv(), MAX_BYTES)
            assert reply.request_id == index + 1 and reply.status == "outputs"
            with torch.no_grad():
                expected = model(as_tensors(model, observations))
            assert len(reply.outputs) == 2
            for got, want in zip(reply.outputs, expected):
                assert got.shape == tuple(want.shape)
                np.testing.assert_allclose(got, want.numpy(), rtol=TOLERANCE, atol=TOLERANCE)
    finally:
        for dealer in dealers:
            dealer.close(linger=0)
        server.close()


def test_the_backend_acts_as_the_local_model_from_two_threads(context: zmq.Context) -> None:
    """Two actors' backends, each in a thread of its own, act exactly as their local models would:
    the server holds nothing at first, so the join's weights are sent (once, or by each when both
    ask at once), then every call is answered from the server's model."""
    model = vector_model()
    server = Server(context, lambda: vector_model(seed=9))
    results: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    backends: dict[int, CentralForward] = {}

    locals_ = [vector_model() for _ in range(2)]  # here: the threads would share torch's seed

    def act(index: int) -> None:
        local = locals_[index]
        backend = CentralForward(local, client(context, f"actor-{index}"), policy_version=0)
        backends[index] = backend
        local.use_inference_backend(backend)
        bundles = []
        for step in range(20):
            observations = observations_for(local, 2 + index, seed=100 * index + step)[""]
            generator = torch.Generator().manual_seed(step)
            bundle = local.act(observations, generator=generator)
            bundles.append((bundle.log_probs, bundle.values))
        results[index] = bundles

    with server.running():
        threads = [threading.Thread(target=act, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30.0)
    server.close()
    assert sorted(results) == [0, 1]
    model.use_inference_backend(None)
    uploads = [backends[index].uploads for index in range(2)]
    assert 1 <= sum(uploads) <= 2 and sum(uploads) == server.server.total.uploads  # the first one's
    for index in range(2):
        for step, (log_probs, values) in enumerate(results[index]):
            observations = observations_for(model, 2 + index, seed=100 * index + step)[""]
            bundle = model.act(observations, generator=torch.Generator().manual_seed(step))
            np.testing.assert_allclose(log_probs, bundle.log_probs, rtol=TOLERANCE, atol=TOLERANCE)
            np.testing.assert_allclose(values, bundle.values, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_recurrent_policy_gets_its_next_state(context: zmq.Context) -> None:
    """A GRU policy's state goes with the observations and the state after comes back."""
    model = vector_model(network=NetworkSpec(recurrent="gru", recurrent_hidden=16))
    server = Server(
        context,
        lambda: vector_model(seed=9, network=NetworkSpec(recurrent="gru", recurrent_hidden=16)),
    )
    observations = torch.from_numpy(observations_for(model, 3, seed=1)[""])
    state = torch.randn((3, model.state_size), generator=torch.Generator().manual_seed(2))
    with server.running():
        backend = CentralForward(model, client(context, "actor-0"), policy_version=2)
        got = backend(observations, state)
    server.close()
    with torch.no_grad():
        expected = model(observations, state)
    assert len(got) == 3
    for output, want in zip(got, expected):
        torch.testing.assert_close(output, want, rtol=TOLERANCE, atol=TOLERANCE)


class Version:
    """What a stepper records: the weights loaded (``CentralForward.follow``)."""

    def __init__(self, policy_version: int, weights_revision: int = 0) -> None:
        self.policy_version = policy_version
        self.weights_revision = weights_revision


def test_weights_not_held_yet_are_waited_for_then_served(context: zmq.Context) -> None:
    """A request for weights newer than the server's newest waits for them on the weights channel
    (the actor heard of them first) and is answered with them: no upload, no ``missing``."""
    old, new = vector_model(seed=1), vector_model(seed=2)
    server = Server(context, lambda: vector_model(seed=9))
    time.sleep(0.1)  # the SUB is connected before anything is published
    server.publish(1, old)
    server.turn(3)
    assert server.models.keys() == [(1, 0)]
    with server.running():  # built on version 1, which the server holds: nothing sent
        backend = CentralForward(vector_model(seed=1), client(context, "actor-0"), policy_version=1)
    backend.load(vector_model(seed=2))  # the actor loads version 2, heard of before the server
    backend.follow(Version(2))
    observations = torch.from_numpy(observations_for(new, 4, seed=3)[""])
    outputs: list[Any] = []
    thread = threading.Thread(target=lambda: outputs.append(backend(observations)))
    thread.start()
    deadline = time.monotonic() + 5.0
    while not server.server.pending and time.monotonic() < deadline:
        server.turn()
    assert len(server.server.pending) == 1, "the request waits for version 2"
    server.publish(2, new)
    while thread.is_alive() and time.monotonic() < deadline:
        server.turn()
    thread.join(1.0)
    server.close()
    assert outputs, "no answer"
    with torch.no_grad():
        expected = new(observations)
    for got, want in zip(outputs[0], expected):
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    assert (backend.uploads, server.server.total.uploads, server.server.total.missing) == (0, 0, 0)
    assert server.models.keys() == [(1, 0), (2, 0)]


def test_weights_gone_from_the_server_are_sent_by_the_actor(context: zmq.Context) -> None:
    """Weights the server no longer holds (older than its newest, dropped or never read) are answered
    ``missing`` at once, and the actor sends them: the outputs are still those of the weights it acts
    with."""
    acting, newer = vector_model(seed=1), vector_model(seed=2)
    server = Server(context, lambda: vector_model(seed=9))
    time.sleep(0.1)
    server.publish(7, newer)
    server.turn(3)
    with server.running():
        backend = CentralForward(acting, client(context, "actor-0"), policy_version=5)
        observations = torch.from_numpy(observations_for(acting, 3, seed=4)[""])
        got = backend(observations)
    server.close()
    assert backend.uploads == 1  # once, during the probe of the constructor
    assert server.server.total.missing == 1 and server.server.total.uploads == 1
    with torch.no_grad():
        expected = acting(observations)
    for output, want in zip(got, expected):
        torch.testing.assert_close(output, want, rtol=TOLERANCE, atol=TOLERANCE)
    assert server.models.keys() == [(5, 0), (7, 0)]


def test_weights_that_do_not_fit_the_server_are_a_clear_error(context: zmq.Context) -> None:
    """An actor whose model is not the server's (another network): its weights are refused and the
    backend raises one line that says why."""
    server = Server(context, lambda: vector_model(seed=9))
    other = vector_model(network=NetworkSpec(net_arch="32"))
    with server.running(), pytest.raises(CentralInferenceError) as raised:
        CentralForward(other, client(context, "actor-0"), policy_version=0)
    server.close()
    message = str(raised.value)
    assert "refused a forward pass of policy version 0" in message
    assert "do not fit the server's model" in message and "\n" not in message


def test_a_dead_server_is_an_error_within_the_timeout(context: zmq.Context) -> None:
    """Nothing answers at the address: the call raises within about the client's timeout, naming the
    address, instead of hanging the actor."""
    address = "inproc://nobody"
    model = vector_model()
    started = time.monotonic()
    with pytest.raises(CentralInferenceError, match="did not answer within"):
        CentralForward(
            model, client(context, "actor-0", timeout_s=0.3, address=address), policy_version=0
        )
    assert time.monotonic() - started < 3.0


def test_waiting_for_a_server_that_never_comes_up_gives_up(context: zmq.Context) -> None:
    """``wait_ready`` pings until its patience is spent, then raises naming the address."""
    stop = threading.Event()
    with pytest.raises(
        CentralInferenceError, match="no answer within 1 s from the inference server"
    ):
        client(context, "actor-0", address="inproc://nobody").wait_ready(stop, patience_s=1.0)


def test_a_request_sent_again_is_served_once(context: zmq.Context) -> None:
    """A request a client sends again (no answer for a while) while the first is waiting or already
    answered is dropped: one forward pass, one reply."""
    model = vector_model()
    server = Server(context, lambda: vector_model(seed=9))
    server.models.add((0, 0), weights_to_arrays(model))
    dealer = context.socket(zmq.DEALER)
    dealer.routing_id = b"actor-0/0"
    dealer.connect(ADDRESS)
    try:
        frame = encode_inference_message(
            ForwardRequest(1, 0, 0, observations_for(model, 2, seed=1))
        )
        dealer.send(frame)
        dealer.send(frame)
        time.sleep(0.1)
        server.turn()
        dealer.send(frame)  # after the answer
        time.sleep(0.1)
        server.turn()
        replies = []
        while dealer.poll(200):
            replies.append(decode_inference_message(dealer.recv(), MAX_BYTES))
        assert [reply.request_id for reply in replies] == [1]
        assert (server.server.total.batches, server.server.total.requests) == (1, 1)
    finally:
        dealer.close(linger=0)
        server.close()


def test_a_request_too_large_for_the_server_is_a_clear_error(context: zmq.Context) -> None:
    """The weights of a request are more bytes than the server reads: it cannot read the request and
    says why; the actor raises that at once instead of waiting out its timeout."""
    server = Server(context, lambda: vector_model(seed=9), max_bytes=4096)
    started = time.monotonic()
    with server.running(), pytest.raises(CentralInferenceError, match="oversized"):
        CentralForward(vector_model(), client(context, "actor-0"), policy_version=0)
    server.close()
    assert time.monotonic() - started < 5.0
