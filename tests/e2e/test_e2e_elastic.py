"""End to end: actors die, join and leave while a run trains, in both modes.

Separate ``oakemu learner`` / ``oakemu actor`` processes on CartPole-v1 with tiny rollouts (32 steps x
2 envs per actor). The learner sees a local actor's process exit at once (it watches the processes in
its PID namespace) and drops an actor silent for 2 s (``--actor-timeout-s 2``) otherwise. The test
watches the learner's telemetry.

* Synchronous mode, 3 actors: one is killed mid-rollout; the next update comes within the timeout
  plus one rollout's time (a generous margin for a busy 2-core machine), with the other two actors'
  columns; a fourth actor joins and fills columns from a later rollout on; one that leaves returns
  its columns.
* Asynchronous mode, 2 actors: one is killed; the survivor's steps are never computed and thrown
  away (``no_capacity_steps`` stays 0: it waits while the learner holds its steps) and the next update
  comes within the same bound.
* Both modes, 1 actor whose weights subscription reaches no learner (it misses every publication, as
  a subscriber that connected late or fell behind misses some): it gets each version on the control
  socket once a heartbeat reply names it, and the run trains to its budget.
"""

from __future__ import annotations

import signal
import time

import pytest

from oakemu_core.run.telemetry import TelemetrySnapshot
from tests.e2e_helpers import E2EProcesses, ServiceProcess, describe_all, free_ports

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0
UPDATE_AFTER_KILL_S = TIMEOUT_S + 10.0
"""Longest wait for the first update after a kill: the timeout, a rollout and an update of a few
hundred CartPole rows, and slack for a 2-core machine running other tests."""
ENVS = 2


def learner_args(e2e: E2EProcesses, mode: str, num_actors: int, *extra: str) -> list[str]:
    return [
        "learner",
        "--env",
        "CartPole-v1",
        "--mode",
        mode,
        "--num-actors",
        str(num_actors),
        "--envs-per-actor",
        str(ENVS),
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
        "--eval-every-updates",
        "0",
        "--actor-timeout-s",
        str(TIMEOUT_S),
        "--max-actors",
        "4",
        "--run-name",
        "elastic",
        *extra,
        *e2e.flags(),
    ]


def start_actor(e2e: E2EProcesses, actor_id: str) -> ServiceProcess:
    return e2e.start(
        actor_id,
        ["actor", "--envs-per-actor", str(ENVS), "--actor-id", actor_id, *e2e.flags(role="actor")],
    )


def actor_ids(snapshot: TelemetrySnapshot) -> set[str]:
    return {actor.actor_id for actor in snapshot.actors}


def gone(snapshot: TelemetrySnapshot) -> int:
    """Actors dropped: seen exiting (local processes, at once) or silent past the timeout."""
    return snapshot.dropped.get("exited_actors", 0) + snapshot.dropped.get("timed_out_actors", 0)


def kill_and_time_next_update(telemetry, victim: ServiceProcess, why) -> float:
    """SIGKILL ``victim`` mid-run; the seconds until the learner's second update after it (the first
    may train a rollout that was full before the kill; the second needs rows the victim would have
    given)."""
    before = telemetry.wait(lambda s: s.is_update, 30, "an update before the kill", why)
    victim.popen.kill()
    killed_at = time.time()
    victim.wait(timeout_s=10)
    after = telemetry.wait(
        lambda s: s.is_update and s.iterations >= before.iterations + 2,
        60,
        "updates after the kill",
        why,
    )
    return after.time - killed_at


def test_sync_mode_trains_on_when_an_actor_dies_joins_or_leaves(e2e: E2EProcesses) -> None:
    telemetry = e2e.telemetry()
    learner = e2e.start("learner", learner_args(e2e, "sync", num_actors=3))
    actors = {name: start_actor(e2e, name) for name in ("a1", "a2", "a3")}
    why = describe_all(learner, *actors.values())
    telemetry.wait(
        lambda s: s.iterations >= 2 and s.rollout_columns == 3 * ENVS,
        120,
        "2 updates with 3 actors",
        why,
    )

    seconds = kill_and_time_next_update(telemetry, actors.pop("a2"), why)
    assert seconds <= UPDATE_AFTER_KILL_S, f"{seconds:.1f} s without an update after the kill"
    later = telemetry.wait(
        lambda s: s.is_update and s.rollout_columns == 2 * ENVS and gone(s) == 1,
        30,
        "updates with 2 actors' columns",
        why,
    )
    assert later.planned_columns == 3 * ENVS and actor_ids(later) == {"a1", "a3"}

    actors["a4"] = start_actor(e2e, "a4")
    why = describe_all(learner, *actors.values())
    joined = telemetry.wait(
        lambda s: s.is_update and s.rollout_columns == 3 * ENVS,
        60,
        "a rollout with a4's columns",
        why,
    )
    assert actor_ids(joined) == {"a1", "a3", "a4"}

    actors["a1"].send_signal(signal.SIGTERM)  # leaves: says goodbye
    assert actors.pop("a1").wait(timeout_s=20) == 0
    left = telemetry.wait(
        lambda s: s.is_update and s.rollout_columns == 2 * ENVS and actor_ids(s) == {"a3", "a4"},
        30,
        "updates after a1 left",
        why,
    )
    assert gone(left) == 1, "a1 left; it was not dropped"
    assert left.dropped.get("not_member_steps", 0) == 0, (
        "an actor's steps reached a rollout it was not filling"
    )
    assert left.policy_lag_max == 0, "every trained row was acted by the policy it trains"
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout_s=60) == 0, learner.describe()
    e2e.assert_clean(timeout_s=20)


def test_async_mode_loses_no_healthy_step_when_an_actor_dies(e2e: E2EProcesses) -> None:
    telemetry = e2e.telemetry()
    # One step per message: the learner holds at most one segment + 16 messages of an actor's steps
    # (32 + 16 rows), so an actor acting ahead while the dead one pins a buffer would lose steps.
    learner = e2e.start("learner", learner_args(e2e, "async", 2, "--steps-per-message", "1"))
    actors = {name: start_actor(e2e, name) for name in ("b1", "b2")}
    why = describe_all(learner, *actors.values())
    telemetry.wait(
        lambda s: s.iterations >= 3 and actor_ids(s) == {"b1", "b2"},
        120,
        "3 updates with 2 actors",
        why,
    )

    seconds = kill_and_time_next_update(telemetry, actors.pop("b2"), why)
    assert seconds <= UPDATE_AFTER_KILL_S, f"{seconds:.1f} s without an update after the kill"
    after = telemetry.wait(
        lambda s: s.is_update and gone(s) == 1, 30, "the killed actor dropped", why
    )
    settled = telemetry.wait(
        lambda s: s.is_update and s.iterations >= after.iterations + 3,
        60,
        "3 more updates from the survivor",
        why,
    )
    assert settled.dropped.get("no_capacity_steps", 0) == 0, settled.dropped
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(timeout_s=60) == 0, learner.describe()
    e2e.assert_clean(timeout_s=20)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_an_actor_whose_weights_channel_drops_every_publication_still_trains_to_the_budget(
    e2e: E2EProcesses, mode: str
) -> None:
    """An actor that receives no publication asks the learner for the weights it missed on the control
    socket, so its rows stay within max_policy_lag and the run, asynchronous or synchronous, trains its
    whole budget."""
    budget = 8 * 64  # 8 updates of 32 rows x 2 envs
    learner = e2e.start("learner", learner_args(e2e, mode, 1, "--total-env-steps", str(budget)))
    flags = e2e.flags(role="actor")
    nowhere = str(free_ports(1)[0])  # no learner publishes there
    flags[flags.index("--weights-port") + 1] = nowhere
    actor = e2e.start(
        "deaf", ["actor", "--envs-per-actor", str(ENVS), "--actor-id", "deaf", *flags]
    )
    assert learner.wait(timeout_s=120) == 0, describe_all(learner, actor)()
    log = learner.stdout() + learner.stderr()
    assert "env-step budget reached" in log, describe_all(learner, actor)()
    assert "asked for the weights of version" in log, (
        "the actor got its weights on the control socket"
    )
    assert actor.wait(timeout_s=30) == 0, actor.describe()
    assert "fetched the weights" in actor.stdout() + actor.stderr()
    e2e.assert_clean(timeout_s=20)
