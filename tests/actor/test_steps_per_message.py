"""Several vector steps per step message, vectorised step records, bounded policy lag.

* a block of K steps decodes to exactly the rows of the K one-step messages (same buffer contents
  after ingest); a malformed block is rejected whole (nothing written);
* ``steps_per_message`` is agreed at join, divides the rollout length (config and assembler);
* buffers train in generation order (a newer full buffer waits for an older filling one);
* through real processes, with a deliberately slow PPO update and one slow actor, no update ever
  trains a row older than ``max_policy_lag`` (``charts/policy_lag_max``, ``charts/stale_rows``).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from oakemu_core.config import OakEmuConfig
from oakemu_core.policy.distributions import Categorical
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.assembler import RolloutAssembler, SlotState
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from oakemu_core.transport.batching import auto_steps_per_message
from oakemu_core.transport.codec import MessageRejected
from oakemu_core.transport.step_blocks import StepBlock
from oakemu_core.transport.steps import StepMessage, StepSpec, decode_step, encode_step
from tests.e2e_helpers import (
    E2EProcesses,
    common_flags,
    e2e_fixture,  # noqa: F401
    new_ports,
    only_run_dir,
    python_path_with_site_hook,
    update_records,
    wait_for,
)

SCHEMA = build_schema(
    {"": ((3,), np.float32)},
    Categorical(4),
)
N, T, K = 3, 8, 4
MAX_BYTES = 1 << 20


def one_step(
    rng: np.random.Generator, step: int
) -> tuple[dict[str, np.ndarray], list[float], list[int]]:
    """A valid vector step of N envs (some done, one truncated with a bootstrap value)."""
    dones = rng.random(N) < 0.3
    truncated = dones & (rng.random(N) < 0.5)
    fields = {
        "observations": rng.standard_normal((N, 3)).astype(np.float32),
        "actions": rng.integers(0, 4, N).astype(np.int64),
        "log_probs": -rng.random(N).astype(np.float32),
        "values": rng.standard_normal(N).astype(np.float32),
        "rewards": rng.standard_normal(N).astype(np.float32),
        "dones": dones,
        "truncated": truncated,
        "bootstrap_values": np.where(truncated, rng.standard_normal(N), 0).astype(np.float32),
        "next_values": rng.standard_normal(N).astype(np.float32),
        "trainable": rng.random(N) < 0.9,
    }
    ended = int(dones.sum())
    return fields, [float(step + i) for i in range(ended)], [step + 1] * ended


@pytest.fixture
def buffers() -> Iterator[list[RolloutBuffer]]:
    made = [RolloutBuffer(T, N, schema=SCHEMA) for _ in range(4)]
    yield made
    for b in made:
        b.close()


def ingest_all(assembler: RolloutAssembler, frames: list[bytes]) -> None:
    for frame in frames:
        message = decode_step(frame, assembler.spec_for, max_bytes=MAX_BYTES)
        assembler.ingest(message, current_policy_version=3, now=0.0)


def test_a_block_carries_the_oldest_weights_that_acted_on_it() -> None:
    """(version, revision) pairs ordered as tuples: revision 3 of version 2 is older than version 3."""
    rng = np.random.default_rng(0)
    block = StepBlock(SCHEMA, N, 3)
    for version, revision in [(3, 0), (2, 3), (2, 5)]:
        block.record(one_step(rng, 0)[0], version, revision=revision)
    message = block.message("a", "inc", 0)
    assert (message.policy_version, message.revision) == (2, 3)
    block.clear()
    for version, revision in [(4, 1), (4, 2), (5, 0)]:
        block.record(one_step(rng, 0)[0], version, revision=revision)
    assert (block.policy_version, block.revision) == (4, 1)


def test_a_block_of_k_steps_writes_exactly_the_rows_of_k_single_step_messages(
    buffers: list[RolloutBuffer],
) -> None:
    rng = np.random.default_rng(5)
    steps = [one_step(rng, s) for s in range(T)]
    single, blocked = (
        RolloutAssembler(buffers[:2], actor_timeout_s=10),
        RolloutAssembler(buffers[2:], actor_timeout_s=10),
    )
    single.join("a", "inc", StepSpec(N, SCHEMA), hostname="h", now=0.0)
    blocked.join("a", "inc", StepSpec(N, SCHEMA, steps_per_message=K), hostname="h", now=0.0)
    frames_1 = [
        encode_step(StepMessage("a", "inc", s, 2, fields, r, l, revision=1), StepSpec(N, SCHEMA))
        for s, (fields, r, l) in enumerate(steps)
    ]
    block = StepBlock(SCHEMA, N, K)
    frames_k = []
    for b in range(T // K):
        block.clear()
        for fields, r, l in steps[b * K : (b + 1) * K]:
            block.record(fields, 2, r, l, revision=1)
        frames_k.append(
            [
                bytes(frame)
                for frame in encode_step(  # as sent: copied before the block's next record
                    block.message("a", "inc", b), blocked.spec_for("a", "inc")
                )
            ]
        )
    decoded = decode_step(frames_k[0], blocked.spec_for, max_bytes=MAX_BYTES)
    assert (
        decoded.num_steps == K
        and decoded.num_envs == N
        and decoded.fields["observations"].shape == (K, N, 3)
    )
    for name in decoded.fields:
        np.testing.assert_array_equal(
            decoded.fields[name], np.stack([s[0][name] for s in steps[:K]])
        )

    ingest_all(single, frames_1)
    ingest_all(blocked, frames_k)
    one, many = buffers[0], buffers[2]
    assert (one.policy_versions == 2).all() and (one.policy_revisions == 1).all()
    for name in [f.name for f in SCHEMA.stored] + ["column_steps"]:
        np.testing.assert_array_equal(getattr(one, name), getattr(many, name), err_msg=name)
    assert single.states == blocked.states == [SlotState.FULL, SlotState.FILLING]
    assert single.counters.env_steps == blocked.counters.env_steps == T * N
    a, b = single.take_full_rollout(), blocked.take_full_rollout()
    np.testing.assert_array_equal(a.last_values, b.last_values)
    np.testing.assert_array_equal(a.last_dones, b.last_dones)
    assert single.take_episodes() == blocked.take_episodes()


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (lambda f: f["rewards"].__setitem__((2, 1), np.nan), "schema"),
        (lambda f: f["actions"].__setitem__((3, 0), 7), "value_range"),
        (
            lambda f: (
                f["truncated"].__setitem__((1, 2), True),
                f["dones"].__setitem__((1, 2), False),
            ),
            "value_range",
        ),
        (
            lambda f: (
                f["bootstrap_values"].__setitem__((0, 0), 1.5) if not f["truncated"][0, 0] else None
            ),
            "value_range",
        ),
    ],
)
def test_a_malformed_block_is_rejected_whole(
    buffers: list[RolloutBuffer], corrupt, reason: str
) -> None:
    rng = np.random.default_rng(9)
    assembler = RolloutAssembler(buffers[:2], actor_timeout_s=10)
    spec = StepSpec(N, SCHEMA, steps_per_message=K)
    assembler.join("a", "inc", spec, hostname="h", now=0.0)
    block = StepBlock(SCHEMA, N, K)
    for s in range(K):
        fields, r, l = one_step(rng, s)
        fields["truncated"][:] = False
        fields["bootstrap_values"][:] = 0
        block.record(fields, 0, r, l)
    corrupt(block.arrays)
    frame = encode_step(block.message("a", "inc", 0), spec)
    with pytest.raises(MessageRejected) as info:
        decode_step(frame, assembler.spec_for, max_bytes=MAX_BYTES)
    assert info.value.reason == reason
    assert buffers[0].column_steps.sum() == 0


def test_a_block_of_the_wrong_length_or_layout_is_rejected(buffers: list[RolloutBuffer]) -> None:
    rng = np.random.default_rng(1)
    spec = StepSpec(N, SCHEMA, steps_per_message=K)
    fields = {name: np.stack([a] * (K - 1)) for name, a in one_step(rng, 0)[0].items()}
    short = encode_step(
        StepMessage("a", "i", 0, 0, fields), StepSpec(N, SCHEMA, steps_per_message=K - 1)
    )
    with pytest.raises(MessageRejected) as info:
        decode_step(short, lambda a, i: spec, max_bytes=MAX_BYTES)
    assert info.value.reason == "size"
    single = one_step(rng, 0)[0]  # a one-step message where the spec agreed on blocks of K
    with pytest.raises(MessageRejected) as info:
        decode_step(
            encode_step(StepMessage("a", "i", 0, 0, single), StepSpec(N, SCHEMA)),
            lambda a, i: spec,
            max_bytes=MAX_BYTES,
        )
    assert info.value.reason == "size"
    too_many = {name: np.stack([a] * K) for name, a in single.items()}
    with pytest.raises(MessageRejected) as info:  # more episodes than K x N
        decode_step(
            encode_step(
                StepMessage("a", "i", 0, 0, too_many, [1.0] * (K * N + 1), [1] * (K * N + 1)), spec
            ),
            lambda a, i: spec,
            max_bytes=MAX_BYTES,
        )
    assert info.value.reason == "schema"


def test_steps_per_message_is_agreed_at_join_and_divides_the_rollout(
    buffers: list[RolloutBuffer],
) -> None:
    assert (
        StepSpec.from_dict(StepSpec(N, SCHEMA, steps_per_message=K).to_dict()).steps_per_message
        == K
    )
    with pytest.raises(MessageRejected):
        StepSpec.from_dict({**StepSpec(N, SCHEMA).to_dict(), "steps_per_message": 0})
    with pytest.raises(ValueError, match="steps_per_message"):
        StepSpec(N, SCHEMA, steps_per_message=0)
    assembler = RolloutAssembler(buffers[:2], actor_timeout_s=10)
    with pytest.raises(ValueError, match="divisor of rollout_length"):
        assembler.join("a", "inc", StepSpec(N, SCHEMA, steps_per_message=3), hostname="h", now=0.0)
    with pytest.raises(ValueError, match="steps_per_message"):
        OakEmuConfig(rollout_length=128, steps_per_message=3)
    assert (
        OakEmuConfig(rollout_length=128, steps_per_message=8).resolved_steps_per_message(5, 2) == 8
    )
    # auto: 1 for steps of raw RGB frames (8 x 100 KB per vector step), more for small ones, bounded by rollout_length / 32 (with a ring and a
    # rollout under 64 steps: up to 32 rows within an eighth of it), 32 steps and 128 env steps (rows) per message.
    assert auto_steps_per_message(210 * 160 * 3, 128, num_envs=8) == 1
    assert auto_steps_per_message(210 * 160 * 3, 128, num_envs=4) == 2  # 2 x 4 x 100 KB <= 1 MiB
    assert auto_steps_per_message(41, 128, num_envs=8) == 4
    assert (
        auto_steps_per_message(41, 32, num_envs=8) == 1
    )  # through the sockets: rollout_length / 32
    # With a step ring and a rollout under 64 steps, up to 32 rows per message within an eighth of it (min_rows).
    assert (
        auto_steps_per_message(41, 32, num_envs=8, target_bytes=None, min_rows=32) == 4
    )  # the rl-zoo's CartPole
    assert (
        auto_steps_per_message(41, 32, num_envs=1, target_bytes=None, min_rows=32) == 4
    )  # an eighth of it
    assert auto_steps_per_message(41, 16, num_envs=8, target_bytes=None, min_rows=32) == 2
    assert auto_steps_per_message(41, 8, num_envs=8, target_bytes=None, min_rows=32) == 1
    assert auto_steps_per_message(41, 32, num_envs=16, target_bytes=None, min_rows=32) == 2
    assert auto_steps_per_message(41, 32, num_envs=64, target_bytes=None, min_rows=32) == 1
    assert (
        auto_steps_per_message(41, 32, num_envs=12, target_bytes=None, min_rows=32) == 2
    )  # 24 rows: up to 32
    assert (
        auto_steps_per_message(41, 128, num_envs=8, target_bytes=None, min_rows=32) == 4
    )  # 64 steps and more:
    assert (
        auto_steps_per_message(41, 128, num_envs=2, target_bytes=None, min_rows=32) == 4
    )  # rollout_length / 32
    assert auto_steps_per_message(41, 64, num_envs=1, target_bytes=None, min_rows=32) == 2
    assert OakEmuConfig(rollout_length=32).resolved_steps_per_message(41, 8, step_ring=True) == 4
    assert OakEmuConfig(rollout_length=32).resolved_steps_per_message(41, 8) == 1
    assert auto_steps_per_message(50, 1024, num_envs=16) == 8  # 128 rows
    assert (
        auto_steps_per_message(30_000, 1024, num_envs=4) == 8
    )  # 8 x 4 envs x 30,000 bytes <= 1 MiB
    assert auto_steps_per_message(40_000, 1024, num_envs=4) == 4  # 8 x 4 x 40,000 bytes > 1 MiB
    assert auto_steps_per_message(50, 1024, num_envs=2) == 32  # rollout_length / 32
    assert auto_steps_per_message(50, 2048, num_envs=1) == 32  # at most 32 steps
    assert auto_steps_per_message(50, 1024, num_envs=65) == 1  # 2 x 65 rows > 128
    assert auto_steps_per_message(50, 1024, num_envs=200) == 1
    assert OakEmuConfig(rollout_length=1024).resolved_steps_per_message(50, 16) == 8
    with pytest.raises(ValueError, match="num_envs"):
        auto_steps_per_message(50, 1024, num_envs=0)


def test_step_block_reports_the_oldest_acting_version_and_refuses_overflow() -> None:
    rng = np.random.default_rng(2)
    block = StepBlock(SCHEMA, N, 2)
    with pytest.raises(ValueError, match="0 of 2"):
        block.message("a", "i", 0)
    block.record(one_step(rng, 0)[0], 5)
    block.record(one_step(rng, 1)[0], 4)
    assert block.message("a", "i", 0).policy_version == 4
    with pytest.raises(OverflowError):
        block.record(one_step(rng, 2)[0], 5)


def test_buffers_train_in_generation_order(buffers: list[RolloutBuffer]) -> None:
    """A newer full buffer waits while an older one is still filling (a stalled actor's segment
    must not age while the other buffer trains again and again)."""
    rng = np.random.default_rng(3)
    assembler = RolloutAssembler(buffers[:2], actor_timeout_s=10)
    spec = StepSpec(N, SCHEMA)
    assembler.join("slow", "s", spec, hostname="h", now=0.0)
    assembler.join("fast", "f", spec, hostname="h", now=0.0)
    send = lambda actor, inc, seq: assembler.ingest(  # noqa: E731
        StepMessage(actor, inc, seq, 0, one_step(rng, seq)[0]), current_policy_version=0, now=0.0
    )
    send("slow", "s", 0)  # the slow actor holds all N columns of buffer 0 with 1 row
    for seq in range(T):
        send("fast", "f", seq)  # the fast actor fills buffer 1
    assert assembler.states == [SlotState.FILLING, SlotState.FULL]
    assert assembler.take_full_rollout() is None  # buffer 1 waits for buffer 0
    for seq in range(1, T):
        send("slow", "s", seq)
    first, second = assembler.take_full_rollout(), None
    assert first is not None and first.slot == 0
    assembler.release(first.slot)
    second = assembler.take_full_rollout()
    assert second is not None and second.slot == 1


SITE = textwrap.dedent('''
    """Test hooks (tests/actor/test_steps_per_message.py): a slow PPO update, a slow actor."""
    import os, time
    _update = float(os.environ.get("LAGTEST_UPDATE_SLEEP_S") or 0)
    _step = float(os.environ.get("LAGTEST_STEP_SLEEP_S") or 0)
    if _update:
        import oakemu_core.algo.learner as _learner
        _original_step = _learner.PPOLearner.step
        def _slow_step(self, *args, **kwargs):
            time.sleep(_update)
            return _original_step(self, *args, **kwargs)
        _learner.PPOLearner.step = _slow_step
    if _step:
        import oakemu_core.actor.stepper as _stepper
        _original = _stepper.PolicyStepper.step
        def _slow(self, *args, **kwargs):
            time.sleep(_step)
            return _original(self, *args, **kwargs)
        _stepper.PolicyStepper.step = _slow
''')


@pytest.mark.slow
def test_no_row_older_than_max_policy_lag_with_slow_updates_and_a_slow_actor(
    e2e: E2EProcesses, tmp_path: Path
) -> None:
    """Real learner and actor processes; every PPO update sleeps 0.3 s and one actor is 10x slower
    than the other. Every logged update must have trained no row older than ``max_policy_lag``."""
    path = python_path_with_site_hook(tmp_path, SITE)
    runs_dir = tmp_path / "runs"
    ports = new_ports()
    budget = 24 * 32 * 8
    learner = e2e.start(
        "learner",
        [
            "learner",
            "--env",
            "CartPole-v1",
            "--num-actors",
            "2",
            "--envs-per-actor",
            "4",
            "--rollout-length",
            "32",
            "--ppo-epochs",
            "2",
            "--num-minibatches",
            "2",
            "--max-policy-lag",
            "2",
            "--total-env-steps",
            str(budget),
            "--checkpoint-every-updates",
            "0",
            "--run-name",
            "lag",
            *common_flags(ports, runs_dir),
        ],
        env={"PYTHONPATH": path, "LAGTEST_UPDATE_SLEEP_S": "0.3"},
    )
    actor_flags = ["actor", "--envs-per-actor", "4", *ports.flags("actor")]
    e2e.start("fast", [*actor_flags, "--actor-id", "fast"], env={"PYTHONPATH": path})
    e2e.start(
        "slow",
        [*actor_flags, "--actor-id", "slow"],
        env={"PYTHONPATH": path, "LAGTEST_STEP_SLEEP_S": "0.02"},
    )
    status = learner.wait(timeout_s=300)
    assert status == 0, learner.describe()
    updates = update_records(only_run_dir(runs_dir))
    assert len(updates) >= 10, f"only {len(updates)} updates"
    too_old = [
        (
            u["charts/update"] if "charts/update" in u else i,
            u["charts/policy_lag_max"],
            u["charts/stale_rows"],
        )
        for i, u in enumerate(updates)
        if u["charts/policy_lag_max"] > 2 or u["charts/stale_rows"] != 0
    ]
    assert too_old == [], (
        f"updates that trained rows older than max_policy_lag 2 (update, lag max, stale rows): {too_old}"
    )
    assert all("charts/policy_lag_sgd_steps_max" in u for u in updates)
    assert (
        max(u["charts/policy_lag_sgd_steps_max"] for u in updates) <= 2 * 2 * 2
    )  # 2 versions x 4 SGD steps
    # The fast actor waits for newer weights instead of computing steps the learner cannot store.
    dropped = learner_dropped_counts(learner.stdout() + learner.stderr())
    written = budget
    # 20 % of the steps were dropped before actors waited for newer weights; 0.5-1.6 % after.
    assert dropped.get("no_capacity_steps", 0) <= 0.05 * written, (
        f"steps computed and thrown away: {dropped}"
    )
    wait_for(lambda: e2e.alive() == [], 30, "actors to exit after the learner")


def learner_dropped_counts(log_text: str) -> dict[str, int]:
    """The ``dropped {...}`` counters of the learner's last ``ingest:`` log line."""
    lines = [line for line in log_text.splitlines() if "ingest:" in line and "dropped {" in line]
    assert lines, "the learner logged no ingest summary"
    return ast.literal_eval(lines[-1].split("dropped ", 1)[1].split("}", 1)[0] + "}")
