"""Overlapped env groups: ale-py's threaded vector env stepped asynchronously, two
groups per actor, rows identical to one vector env of all the envs stepped with the same actions.

The stepper runs Breakout in 2 groups of 2 envs (group 1 steps while group 0's actions are
chosen); a reference ``make_vector_env`` of 4 envs with the same seed is stepped with the actions
the stepper recorded. Every row must match the reference's step (observations, rewards, dones):
each env stepped exactly once per vector step, with its own action, in its own column. The rows
then go through the wire and :class:`RolloutAssembler`: each buffer column holds one env's
consecutive rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("ale_py")

from oakemu_core.actor.stepper import PolicyStepper  # noqa: E402
from oakemu_core.envs import make_vector_env  # noqa: E402
from oakemu_core.envs.factory import make_env_groups  # noqa: E402
from oakemu_core.envs.vector import EnvGroups  # noqa: E402
from oakemu_core.policy.distributions import distribution_for_env  # noqa: E402
from oakemu_core.policy.models import build_model  # noqa: E402
from oakemu_core.storage.assembler import RolloutAssembler  # noqa: E402
from oakemu_core.storage.rollout_buffer import RolloutBuffer  # noqa: E402
from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step  # noqa: E402

ENV_ID = "ALE/Breakout-v5"
SEED = 11
NUM_ENVS = 4
STEPS = 24  # two rollout segments of T = 12


def test_async_step_matches_step() -> None:
    env_a = make_vector_env(ENV_ID, 2, seed=SEED)
    env_b = make_vector_env(ENV_ID, 2, seed=SEED)
    try:
        assert env_a.asynchronous
        np.testing.assert_array_equal(env_a.reset(), env_b.reset())
        for t in range(10):
            actions = np.array([t % 4, (t + 1) % 4])
            env_a.step_async(actions)
            with pytest.raises(RuntimeError, match="in flight"):
                env_a.step_async(actions)
            a, b = env_a.step_wait(), env_b.step(actions)
            np.testing.assert_array_equal(a.observations, b.observations)
            np.testing.assert_array_equal(a.training_rewards, b.training_rewards)
        with pytest.raises(RuntimeError, match="no step in flight"):
            env_a.step_wait()
    finally:
        env_a.close()
        env_b.close()


def test_overlapped_groups_step_every_env_once_per_row_and_keep_columns() -> None:
    torch.manual_seed(SEED)
    groups = make_env_groups(ENV_ID, NUM_ENVS, 2, seed=SEED)
    assert isinstance(groups, EnvGroups) and [g.num_envs for g in groups.groups] == [2, 2]
    spec = groups.spec
    model = build_model(spec.observation_layout, distribution_for_env(spec))
    stepper = PolicyStepper(groups, model, policy_version=0)
    assert stepper.grouped
    rows = []
    try:
        for _ in range(STEPS):
            row = stepper.step()
            fields = {
                k: v.copy()
                for k, v in row.buffers.sent_fields(row.next_values, stepper.schema).items()
            }
            rows.append((fields, row.policy_version))
        assert not stepper.reselect()  # the next actions are already in flight
    finally:
        groups.close()

    reference = make_vector_env(ENV_ID, NUM_ENVS, seed=SEED)
    try:
        observations = reference.reset()
        for t, (fields, _) in enumerate(rows):
            np.testing.assert_array_equal(fields["observations"], observations, err_msg=f"row {t}")
            step = reference.step(fields["actions"])
            np.testing.assert_array_equal(
                fields["rewards"], step.training_rewards, err_msg=f"row {t}"
            )
            np.testing.assert_array_equal(fields["dones"], step.dones, err_msg=f"row {t}")
            observations = step.observations
    finally:
        reference.close()
    for t in range(
        STEPS - 1
    ):  # next_values of row t are the values of the bundle acting on row t + 1
        np.testing.assert_array_equal(rows[t][0]["next_values"], rows[t + 1][0]["values"])

    # Through the wire into the learner's buffers: column i holds env i's consecutive rows.
    schema = stepper.schema
    T = STEPS // 2
    buffers = [RolloutBuffer(T, NUM_ENVS, schema=schema) for _ in range(2)]
    try:
        assembler = RolloutAssembler(buffers, actor_timeout_s=10.0)
        assembler.join(
            "a", "inc", StepSpec(num_envs=NUM_ENVS, schema=schema), hostname="h", now=0.0
        )
        for seq, (fields, version) in enumerate(rows):
            frame = encode_step(
                StepMessage(
                    actor_id="a", incarnation="inc", seq=seq, policy_version=version, fields=fields
                ),
                assembler.spec_for("a", "inc"),
            )
            assembler.ingest(
                decode_step(frame, assembler.spec_for, max_bytes=1 << 24),
                current_policy_version=0,
                now=0.0,
            )
        assert assembler.counters.env_steps == STEPS * NUM_ENVS
        for s in range(2):
            rollout = assembler.take_full_rollout()
            assert rollout is not None and rollout.slot == s
            for t in range(T):
                np.testing.assert_array_equal(
                    rollout.buffer.field("observations")[t], rows[s * T + t][0]["observations"]
                )
                np.testing.assert_array_equal(
                    rollout.buffer.field("actions")[t], rows[s * T + t][0]["actions"]
                )
    finally:
        for b in buffers:
            b.close()
