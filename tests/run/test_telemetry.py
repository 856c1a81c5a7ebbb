"""Telemetry: snapshot codec, PUB/SUB round trip, rejection of malformed messages, Prometheus export."""

from __future__ import annotations

import socket
import time
import urllib.request

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from oakemu_core.run.prometheus import PrometheusExporter
from oakemu_core.run.telemetry import (
    TELEMETRY_PROTOCOL_VERSION,
    TELEMETRY_TOPIC,
    ActorTelemetry,
    TelemetryAddressError,
    TelemetryBindError,
    TelemetryPublisher,
    TelemetryRejected,
    TelemetrySnapshot,
    TelemetrySubscriber,
    decode_snapshot,
    encode_snapshot,
)


def make_snapshot(**overrides) -> TelemetrySnapshot:
    fields = dict(
        time=1_700_000_000.5,
        run_name="test-run",
        env_id="CartPole-v1",
        global_step=1234,
        sps=456.5,
        policy_version=7,
        iterations=6,
        episodes=42,
        episodic_return_mean=21.5,
        episodic_return_min=9.0,
        episodic_return_max=80.0,
        episodic_length_mean=21.5,
        policy_loss=-0.012,
        value_loss=3.25,
        entropy=0.69,
        approx_kl=0.004,
        clip_fraction=0.125,
        explained_variance=0.3,
        learning_rate=2.5e-4,
        buffer_fill=0.5,
        rejected_messages={"bad_dtype": 2, "garbage": 1},
        dropped={"stale_rows": 16, "timed_out_actors": 1},
        policy_lag_min=0.0,
        policy_lag_mean=0.75,
        policy_lag_max=2.0,
        actors=[
            ActorTelemetry(
                actor_id="a1",
                incarnation="inc-1",
                num_envs=4,
                sps=200.0,
                policy_lag=0.5,
                last_heard_s=0.1,
            ),
            ActorTelemetry(
                actor_id="a2",
                incarnation="inc-2",
                num_envs=4,
                sps=256.5,
                policy_lag=None,
                last_heard_s=1.5,
            ),
        ],
        is_update=True,
    )
    fields.update(overrides)
    return TelemetrySnapshot(**fields)


def valid_payload_dict() -> dict:
    return make_snapshot().model_dump(mode="python")


def receive_after_connect(
    publisher: TelemetryPublisher,
    subscriber: TelemetrySubscriber,
    snapshot: TelemetrySnapshot,
    deadline_s: float = 10.0,
) -> TelemetrySnapshot:
    """Publish until the subscriber has joined (PUB/SUB drops messages sent before that)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        publisher.publish(snapshot)
        received = subscriber.receive(0.05)
        if received is not None:
            return received
    raise AssertionError("subscriber received nothing within the deadline")


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- codec, no sockets -------------------------------------------------------------------------


def test_encode_decode_round_trip_keeps_every_field():
    snapshot = make_snapshot()
    decoded = decode_snapshot(encode_snapshot(snapshot))
    assert decoded == snapshot
    assert decoded.actors[1].policy_lag is None
    assert decoded.num_actors == 2
    assert decoded.protocol_version == TELEMETRY_PROTOCOL_VERSION


def test_numeric_actor_ids_become_strings():
    actor = ActorTelemetry(actor_id=3, incarnation=99, num_envs=1, sps=0.0, last_heard_s=0.0)
    assert (actor.actor_id, actor.incarnation) == ("3", "99")


def _without(field: str) -> dict:
    payload = valid_payload_dict()
    del payload[field]
    return payload


@pytest.mark.parametrize(
    ("payload", "reason_part"),
    [
        (b"\xc1\xff garbage", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "expected a map"),
        (msgpack.packb(_without("global_step")), "global_step"),
        (msgpack.packb(valid_payload_dict() | {"global_step": "many"}), "global_step"),
        (msgpack.packb(valid_payload_dict() | {"buffer_fill": 1.5}), "buffer_fill"),
        (msgpack.packb(valid_payload_dict() | {"unexpected": 1}), "unexpected"),
        (msgpack.packb(valid_payload_dict() | {"protocol_version": 99}), "protocol_version"),
        (msgpack.packb(valid_payload_dict() | {"dropped": {"stale_rows": -1}}), "dropped"),
        (msgpack.packb(valid_payload_dict() | {"actors": [{"actor_id": "a"}]}), "actors"),
    ],
)
def test_decode_rejects_malformed_payload_naming_the_problem(payload, reason_part):
    with pytest.raises(TelemetryRejected) as info:
        decode_snapshot(payload)
    assert reason_part in info.value.reason


def test_protocol_version_mismatch_says_expected_and_received():
    with pytest.raises(TelemetryRejected) as info:
        decode_snapshot(msgpack.packb(valid_payload_dict() | {"protocol_version": 99}))
    assert (
        "99" in info.value.reason and f"expected {TELEMETRY_PROTOCOL_VERSION}" in info.value.reason
    )


# --- sockets -------------------------------------------------------------------------------------


def test_publisher_to_subscriber_round_trip_over_tcp():
    with TelemetryPublisher("tcp://127.0.0.1:*") as publisher:
        assert publisher.address.startswith("tcp://127.0.0.1:")
        with TelemetrySubscriber(publisher.address) as subscriber:
            snapshot = make_snapshot()
            received = receive_after_connect(publisher, subscriber, snapshot)
            assert received == snapshot
            assert subscriber.rejected == 0


def test_publisher_to_subscriber_round_trip_over_ipc(tmp_path):
    address = f"ipc://{tmp_path}/telemetry.sock"
    with TelemetryPublisher(address) as publisher, TelemetrySubscriber(address) as subscriber:
        received = receive_after_connect(publisher, subscriber, make_snapshot(global_step=5))
        assert received.global_step == 5


def test_malformed_frames_are_rejected_counted_and_skipped():
    context = zmq.Context.instance()
    raw = context.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    subscriber = TelemetrySubscriber(f"tcp://127.0.0.1:{port}")
    try:
        # Join first with valid messages, then send 4 malformed ones and a valid one.
        deadline = time.monotonic() + 10
        while subscriber.receive(0.05) is None:
            assert time.monotonic() < deadline, "subscriber never joined"
            raw.send_multipart([TELEMETRY_TOPIC, encode_snapshot(make_snapshot(global_step=1))])
        time.sleep(0.2)  # let in-flight joining messages arrive, then drop them
        while subscriber.receive(0.05) is not None:
            pass
        before = subscriber.rejected
        raw.send_multipart([TELEMETRY_TOPIC, b"\x00\x01 not msgpack \xc1"])
        raw.send_multipart([TELEMETRY_TOPIC])  # one frame only
        raw.send_multipart([TELEMETRY_TOPIC, encode_snapshot(make_snapshot()), b"extra"])
        raw.send_multipart([TELEMETRY_TOPIC, msgpack.packb(_without("env_id"))])
        raw.send_multipart([TELEMETRY_TOPIC, encode_snapshot(make_snapshot(global_step=999))])
        received = subscriber.receive(5.0)
        assert received is not None and received.global_step == 999
        assert subscriber.rejected - before == 4
        assert "env_id" in subscriber.last_rejection
    finally:
        subscriber.close()
        raw.close(linger=0)


def test_receive_returns_none_after_timeout_when_nobody_publishes():
    port = free_tcp_port()
    with TelemetrySubscriber(f"tcp://127.0.0.1:{port}") as subscriber:
        start = time.monotonic()
        assert subscriber.receive(0.3) is None
        assert 0.25 <= time.monotonic() - start < 2.0


def test_publish_never_blocks_when_the_subscriber_does_not_read():
    with TelemetryPublisher("tcp://127.0.0.1:*", send_hwm=2) as publisher:
        with TelemetrySubscriber(publisher.address) as subscriber:
            receive_after_connect(publisher, subscriber, make_snapshot())
            start = time.monotonic()
            for step in range(5000):
                publisher.publish(make_snapshot(global_step=step))
            assert time.monotonic() - start < 10.0
            assert publisher.published + publisher.dropped >= 5000


def test_publisher_bind_error_names_the_address():
    with TelemetryPublisher("tcp://127.0.0.1:*") as first:
        with pytest.raises(TelemetryBindError, match="OAKEMU_TELEMETRY_PORT") as info:
            TelemetryPublisher(first.address)
        assert first.address in str(info.value)


def test_subscriber_rejects_an_invalid_address():
    with pytest.raises(TelemetryAddressError, match="not-an-endpoint"):
        TelemetrySubscriber("not-an-endpoint")


# --- Prometheus ----------------------------------------------------------------------------------


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """Metric family name -> {sorted label items: value} from the exporter's /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    families: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families


EXPECTED_FAMILIES = {
    "oakemu_env_steps",
    "oakemu_sps",
    "oakemu_policy_version",
    "oakemu_updates",
    "oakemu_episodes",
    "oakemu_episodic_return_mean",
    "oakemu_loss",
    "oakemu_approx_kl",
    "oakemu_clip_fraction",
    "oakemu_learning_rate",
    "oakemu_buffer_fill",
    "oakemu_rejected_messages",
    "oakemu_dropped",
    "oakemu_actors",
    "oakemu_policy_lag",
}


def test_prometheus_endpoint_serves_the_snapshot_figures():
    with PrometheusExporter(0, addr="127.0.0.1") as exporter:
        assert exporter.port > 0
        before = scrape(exporter.port)
        assert EXPECTED_FAMILIES <= set(before)
        assert before["oakemu_env_steps"] == {}  # no sample before the first snapshot

        exporter.update(make_snapshot())
        after = scrape(exporter.port)
        assert EXPECTED_FAMILIES <= set(after)
        assert after["oakemu_env_steps"] == {("oakemu_env_steps_total", ()): 1234.0}
        assert after["oakemu_updates"] == {("oakemu_updates_total", ()): 6.0}
        assert after["oakemu_episodes"] == {("oakemu_episodes_total", ()): 42.0}
        assert after["oakemu_sps"] == {("oakemu_sps", ()): 456.5}
        assert after["oakemu_policy_version"] == {("oakemu_policy_version", ()): 7.0}
        assert after["oakemu_episodic_return_mean"] == {("oakemu_episodic_return_mean", ()): 21.5}
        assert after["oakemu_loss"] == {
            ("oakemu_loss", (("kind", "policy"),)): -0.012,
            ("oakemu_loss", (("kind", "value"),)): 3.25,
            ("oakemu_loss", (("kind", "entropy"),)): 0.69,
        }
        assert after["oakemu_approx_kl"] == {("oakemu_approx_kl", ()): 0.004}
        assert after["oakemu_clip_fraction"] == {("oakemu_clip_fraction", ()): 0.125}
        assert after["oakemu_learning_rate"] == {("oakemu_learning_rate", ()): 2.5e-4}
        assert after["oakemu_buffer_fill"] == {("oakemu_buffer_fill", ()): 0.5}
        assert after["oakemu_rejected_messages"] == {
            ("oakemu_rejected_messages_total", (("reason", "bad_dtype"),)): 2.0,
            ("oakemu_rejected_messages_total", (("reason", "garbage"),)): 1.0,
        }
        assert after["oakemu_dropped"] == {
            ("oakemu_dropped_total", (("kind", "stale_rows"),)): 16.0,
            ("oakemu_dropped_total", (("kind", "stale_steps"),)): 0.0,
            ("oakemu_dropped_total", (("kind", "timed_out_actors"),)): 1.0,
            ("oakemu_dropped_total", (("kind", "no_capacity_steps"),)): 0.0,
            ("oakemu_dropped_total", (("kind", "discarded_segment_rows"),)): 0.0,
            ("oakemu_dropped_total", (("kind", "late_steps"),)): 0.0,
        }
        assert after["oakemu_actors"] == {("oakemu_actors", ()): 2.0}
        assert after["oakemu_policy_lag"] == {
            ("oakemu_policy_lag", (("stat", "min"),)): 0.0,
            ("oakemu_policy_lag", (("stat", "mean"),)): 0.75,
            ("oakemu_policy_lag", (("stat", "max"),)): 2.0,
        }

        exporter.update(make_snapshot(global_step=2000, actors=[]))
        latest = scrape(exporter.port)
        assert latest["oakemu_env_steps"] == {("oakemu_env_steps_total", ()): 2000.0}
        assert latest["oakemu_actors"] == {("oakemu_actors", ()): 0.0}
        assert latest["oakemu_actor_sps"] == {}


def test_two_exporters_in_one_process_and_port_in_use_error():
    with (
        PrometheusExporter(0, addr="127.0.0.1") as first,
        PrometheusExporter(0, addr="127.0.0.1") as second,
    ):
        first.update(make_snapshot(global_step=1))
        second.update(make_snapshot(global_step=2))
        assert scrape(first.port)["oakemu_env_steps"] == {("oakemu_env_steps_total", ()): 1.0}
        assert scrape(second.port)["oakemu_env_steps"] == {("oakemu_env_steps_total", ()): 2.0}
        with pytest.raises(TelemetryBindError, match=f"{first.port}.*OAKEMU_METRICS_PORT"):
            PrometheusExporter(first.port, addr="127.0.0.1")
