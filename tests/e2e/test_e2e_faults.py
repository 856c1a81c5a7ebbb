"""End to end under faults: a killed actor, a late joiner, malformed messages, stop signals.

The learner and actors run as separate ``oakemu learner`` / ``oakemu actor`` processes (as on
several machines) on CartPole-v1 with tiny rollouts; the test watches the learner through its
telemetry socket.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from oakemu_core.policy.distributions import Categorical
from oakemu_core.run.telemetry import TelemetrySnapshot
from oakemu_core.step_schema import build_schema
from oakemu_core.transport.auth import new_routing_id
from oakemu_core.transport.control import (
    JoinReply,
    JoinRequest,
    decode_message,
    encode_join_request,
)
from oakemu_core.transport.steps import StepMessage, StepSpec, encode_step
from tests.e2e_helpers import (
    E2EProcesses,
    ServiceProcess,
    describe_all,
    read_jsonl,
    update_records,
)

pytestmark = pytest.mark.slow

RUN_NAME = "faults"
LEARNER_MAX_MESSAGE_BYTES = 65_536


def learner_args(e2e: E2EProcesses, *extra: str) -> list[str]:
    """A CartPole learner for 2 actors x 2 envs, rollouts of 32 steps, a budget it never reaches."""
    return [
        "learner",
        "--env",
        "CartPole-v1",
        "--num-actors",
        "2",
        "--envs-per-actor",
        "2",
        "--rollout-length",
        "32",
        "--ppo-epochs",
        "2",
        "--num-minibatches",
        "2",
        "--total-env-steps",
        "100000000",
        "--checkpoint-every-updates",
        "0",
        "--run-name",
        RUN_NAME,
        *e2e.flags(*extra),
    ]


def actor_args(e2e: E2EProcesses, actor_id: str, *extra: str) -> list[str]:
    return [
        "actor",
        "--envs-per-actor",
        "2",
        "--actor-id",
        actor_id,
        *e2e.flags(*extra, role="actor"),
    ]


def actor_ids(snapshot: TelemetrySnapshot) -> set[str]:
    return {actor.actor_id for actor in snapshot.actors}


def dropped_actors(snapshot: TelemetrySnapshot) -> int:
    return snapshot.dropped.get("exited_actors", 0) + snapshot.dropped.get("timed_out_actors", 0)


def episode_actor_ids(run_dir: Path) -> set[str]:
    return {e["actor_id"] for e in read_jsonl(run_dir / "episodes.jsonl")}


def stop_learner_and_check(learner: ServiceProcess, run_dir: Path, iterations_before: int) -> None:
    """SIGTERM: the learner writes a final checkpoint (numbered by its last update) and exits 0."""
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout_s=60) == 0, learner.describe()
    log = learner.stderr()
    assert "final checkpoint" in log and "Traceback" not in log, learner.describe()
    latest = run_dir / "checkpoints" / "latest.pt"
    assert latest.is_file()
    assert int(latest.resolve().stem.split("_")[1]) >= iterations_before


# -------------------------------------------------------------------- (a) kill, join, leave
def test_killed_actor_is_dropped_and_a_late_actor_joins_and_contributes(e2e: E2EProcesses) -> None:
    run_dir = e2e.runs_dir / RUN_NAME
    telemetry = e2e.telemetry()
    # The learner drops actors silent for 2 s. (Actors keep the default patience: an actor
    # gives up joining after 3 x its own actor_timeout_s, and a learner on a busy 2-core
    # machine may need more than 6 s to start.)
    learner = e2e.start("learner", learner_args(e2e, "--actor-timeout-s", "2"))
    telemetry.wait(
        lambda s: True, 60, "the learner's first telemetry snapshot", describe_all(learner)
    )
    actor_a = e2e.start("actor-a", actor_args(e2e, "actor-a"))
    actor_b = e2e.start("actor-b", actor_args(e2e, "actor-b"))
    why = describe_all(learner, actor_a, actor_b)
    # Both listed is not enough: on a loaded machine actor-b alone can fill every column while
    # actor-a is still starting. Wait until actor-a's own episodes reached the learner.
    before = telemetry.wait(
        lambda s: (
            s.iterations >= 3
            and actor_ids(s) == {"actor-a", "actor-b"}
            and {"actor-a", "actor-b"} <= episode_actor_ids(run_dir)
        ),
        90,
        "3 updates with episodes from both actors",
        why,
    )

    # SIGKILL one actor while it streams (it cannot say goodbye): dropped as soon as the learner sees
    # its process gone (a local process), else after the 2 s timeout.
    actor_a.popen.kill()
    actor_a.wait(timeout_s=10)
    killed_at = before.iterations
    after_kill = telemetry.wait(
        lambda s: (
            s.iterations >= killed_at + 3 and actor_ids(s) == {"actor-b"} and dropped_actors(s) >= 1
        ),
        60,
        "3 more updates without actor-a, which was dropped",
        why,
    )
    assert after_kill.dropped.get("exited_actors", 0) == 1 and dropped_actors(after_kill) == 1

    # A new actor joins later; the remaining original one leaves (Ctrl-C: says goodbye, exits 130).
    actor_c = e2e.start("actor-c", actor_args(e2e, "actor-c"))
    why = describe_all(learner, actor_b, actor_c)
    telemetry.wait(lambda s: "actor-c" in actor_ids(s), 60, "actor-c joined", why)
    actor_b.send_signal(signal.SIGINT)
    assert actor_b.wait(timeout_s=20) == 130, actor_b.describe()
    assert "Traceback" not in actor_b.stderr(), actor_b.describe()
    left_at = telemetry.wait(
        lambda s: actor_ids(s) == {"actor-c"}, 30, "actor-b left", why
    ).iterations
    final = telemetry.wait(
        lambda s: s.iterations >= left_at + 3 and actor_ids(s) == {"actor-c"},
        60,
        "3 more updates from actor-c alone",
        why,
    )
    assert dropped_actors(final) == 1  # actor-b left, it was not dropped
    # Rollouts after actor-b left hold only actor-c's steps, so actor-c's episodes reach the learner.
    assert {"actor-a", "actor-b", "actor-c"} <= episode_actor_ids(run_dir)

    stop_learner_and_check(learner, run_dir, final.iterations)
    assert actor_c.wait(timeout_s=30) == 0, actor_c.describe()
    records = update_records(run_dir)
    versions = [u["charts/policy_version"] for u in records]
    # Every update logged once, in order; an evaluation rollback uses up one version (best.pt restored).
    assert versions == sorted(set(versions)) and versions[0] == 1
    assert int(versions[-1]) - len(versions) == int(records[-1]["charts/rollbacks"])
    e2e.assert_clean(timeout_s=10)


# ------------------------------------------------------------------------ (b) malformed input
class _PickleBomb:
    """Unpickling this creates a folder: proof that nobody unpickled the payload."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.makedirs, (str(self.path),))


def _valid_step(actor_id: str, incarnation: str, num_envs: int) -> list[bytes]:
    """A valid step message of the intruder, its frames (to be damaged by the test): the header, then
    observations, actions, log_probs, values, rewards, ... (the schema's order)."""
    n = num_envs
    schema = build_schema({"": ((4,), np.float32)}, Categorical(2))
    frames = encode_step(
        StepMessage(
            actor_id=actor_id,
            incarnation=incarnation,
            seq=0,
            policy_version=0,
            fields={
                "observations": np.zeros((n, 4), np.float32),
                "actions": np.zeros(n, np.int64),
                "log_probs": np.zeros(n, np.float32),
                "values": np.zeros(n, np.float32),
                "rewards": np.zeros(n, np.float32),
                "dones": np.zeros(n, bool),
                "truncated": np.zeros(n, bool),
                "bootstrap_values": np.zeros(n, np.float32),
                "next_values": np.zeros(n, np.float32),
                "trainable": np.ones(n, bool),
            },
        ),
        StepSpec(n, schema),
    )
    return [bytes(frame) for frame in frames]


def test_malformed_messages_are_rejected_and_counted_while_training_goes_on(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    run_dir = e2e.runs_dir / RUN_NAME
    telemetry = e2e.telemetry()
    context = zmq.Context()
    e2e.defer(context.destroy, linger=0)
    learner = e2e.start(
        "learner",
        learner_args(
            e2e, "--max-message-bytes", str(LEARNER_MAX_MESSAGE_BYTES), "--num-actors", "1"
        ),
    )
    actor = e2e.start("actor", actor_args(e2e, "actor-0"))
    why = describe_all(learner, actor)
    before = telemetry.wait(lambda s: s.iterations >= 2, 90, "2 updates", why)
    rejected_before = dict(before.rejected_messages)

    # An intruder joins properly (so its steps are checked against its spec), then misbehaves.
    control = context.socket(zmq.REQ)
    control.setsockopt(zmq.LINGER, 0)
    control.routing_id = new_routing_id()  # as an actor's control socket
    control.connect(e2e.ports.control_address)
    control.send(encode_join_request(JoinRequest("intruder", "inc-intruder", 2, "test")))
    assert control.poll(10_000), "no join reply"
    reply = decode_message(control.recv(), max_bytes=64 * 2**20)
    assert isinstance(reply, JoinReply) and reply.accepted

    valid = _valid_step("intruder", "inc-intruder", 2)
    header, observations, rest = valid[0], valid[1], valid[2:]
    bomb_path = tmp_path / "unpickled"
    messages = {
        "garbage": [b"\xc1\xc1 definitely not msgpack \x00\xff"],
        "missing frame (rewards)": [header, observations, *rest[:3], *rest[4:]],
        "extra frame": [*valid, valid[-1]],
        "wrong dtype (float64 observations)": [header, bytes(2 * 4 * 8), *rest],
        "wrong shape (3 envs)": [header, bytes(3 * 4 * 4), *rest],
        "truncated frame": [header, observations[:-1], *rest],
        "oversized frame": [header, observations * 1000, *rest],
        "pickle": [pickle.dumps(_PickleBomb(bomb_path))],
        "oversized": [bytes(LEARNER_MAX_MESSAGE_BYTES + 1)],
    }
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(e2e.ports.data_address)
    for frames in messages.values():
        assert push.poll(10_000, zmq.POLLOUT)
        push.send_multipart(frames)
    # Garbage on the control socket too: the learner answers (REQ must get a reply) and counts it.
    control.send(b"\xc1 not a control message")
    assert control.poll(10_000), "the learner did not answer a garbage control request"
    decode_message(control.recv(), max_bytes=64 * 2**20)

    expected = {"garbage": 3, "schema": 2, "size": 4, "oversized": 1}

    def counted(s: TelemetrySnapshot) -> bool:
        return all(
            s.rejected_messages.get(k, 0) - rejected_before.get(k, 0) >= n
            for k, n in expected.items()
        )

    seen = telemetry.wait(counted, 30, f"rejections {expected}", why)
    delta = {k: v - rejected_before.get(k, 0) for k, v in seen.rejected_messages.items()}
    delta = {k: v for k, v in delta.items() if v}
    assert delta == expected
    assert not bomb_path.exists(), "the pickle payload was unpickled"

    # Training is unaffected: more updates complete, with finite losses, and the actor is still there.
    telemetry.wait(lambda s: s.iterations >= seen.iterations + 3, 60, "3 more updates", why)
    # (A rollout whose rows all exceeded max_policy_lag is logged without losses: skip those.)
    trained = [u for u in update_records(run_dir) if "losses/policy_loss" in u]
    assert len(trained) >= seen.iterations + 3
    for update in trained:
        for key in (
            "losses/policy_loss",
            "losses/value_loss",
            "losses/entropy",
            "losses/approx_kl",
        ):
            assert update[key] is not None and np.isfinite(update[key]), (key, update)
    assert "actor-0" in actor_ids(telemetry.latest)
    log = learner.stderr()
    assert "Traceback" not in log
    assert "rejected step message" in log and "rejected control message" in log

    stop_learner_and_check(learner, run_dir, seen.iterations)
    assert actor.wait(timeout_s=30) == 0, actor.describe()
    e2e.assert_clean(timeout_s=10)


# ------------------------------------------------------------------- (c) Ctrl-C on oakemu train
def test_sigint_to_oakemu_train_stops_everything_cleanly(e2e: E2EProcesses) -> None:
    run_dir = e2e.runs_dir / RUN_NAME
    telemetry = e2e.telemetry()
    train = e2e.start(
        "train",
        [
            "train",
            "--env",
            "CartPole-v1",
            "--num-actors",
            "2",
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "32",
            "--ppo-epochs",
            "2",
            "--num-minibatches",
            "2",
            "--total-env-steps",
            "100000000",
            "--run-name",
            RUN_NAME,
            "--checkpoint-every-updates",
            "0",
            *e2e.flags(),
        ],
    )
    telemetry.wait(
        lambda s: s.iterations >= 2 and s.num_actors == 2,
        90,
        "2 updates with 2 actors",
        describe_all(train),
    )
    commands = [command for _, command in e2e.alive()]
    roles = sorted(
        c.split("oakemu_services.cli ")[1].split()[0]
        for c in commands
        if "oakemu_services.cli " in c
    )
    assert roles == ["actor", "actor", "learner", "train"], commands

    started = time.monotonic()
    train.send_signal(signal.SIGINT)  # the launcher alone, as Ctrl-C in a terminal would reach it
    status = train.wait(timeout_s=30)
    e2e.assert_all_exited(timeout_s=max(1.0, 30 - (time.monotonic() - started)))
    assert status == 130, train.describe()  # the shell's status for Ctrl-C, after the clean stop
    assert "stopped by SIGINT" in train.stderr() and "done:" not in train.stderr()
    assert e2e.leftover_segments() == []
    log = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert "stopping: signal" in log and "final checkpoint" in log and "Traceback" not in log
    assert (run_dir / "checkpoints" / "latest.pt").is_file()


# ------------------------------------------------------------- (d) an env that always crashes
def test_a_run_whose_env_crashes_exits_non_zero_naming_the_env_error(e2e: E2EProcesses) -> None:
    """The env raises after 200 steps, before any rollout of 256 steps is full: the rows discarded with
    each crash never count toward the budget, the actor gives up (no restart allowed), and the launcher
    exits 1 with one line naming the env's error, never "done"."""
    train = e2e.start(
        "train",
        [
            "train",
            "--env",
            "tests.crash_envs:CrashingCartPole-v0",
            "--num-actors",
            "1",
            "--envs-per-actor",
            "2",
            "--rollout-length",
            "256",
            "--total-env-steps",
            "600",
            "--actor-restarts",
            "0",
            "--eval-every-updates",
            "0",
            "--run-name",
            RUN_NAME,
            *e2e.flags(),
        ],
    )
    status = train.wait(timeout_s=90)
    err = train.stderr()
    assert status == 1, train.describe()
    assert "error: every actor stopped for good" in err, err
    assert (
        "first actor error: actor-0: tests.crash_envs.EnvBugError: simulated env bug after 200 steps"
        in err
    )
    assert (
        "done:" not in err
        and "budget reached" not in (e2e.runs_dir / RUN_NAME / "logs" / "learner.log").read_text()
    )
    e2e.assert_clean(timeout_s=10)
