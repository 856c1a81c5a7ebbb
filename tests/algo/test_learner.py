"""The seed-002 learner API (oakemu_core/algo/learner.py), called as the page writes it, and automatic
rollback: a collapse injected into a real learner is detected, rolled back, counted, and training
goes on from the restored weights under a higher policy version; a run that keeps collapsing stops
with a clear message. No sockets: rollouts come from a PolicyStepper on CartPole."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.algo.handshake import RolloutHandshake, TrainResult, WeightsRevision
from oakemu_core.algo.health import CheckpointPolicy, HealthMonitor, RunCollapsedError
from oakemu_core.algo.learner import (
    PPOLearner,
    PPOLearnerRuntimeState,
    RuntimeContext,
    ThreadSafeModel,
)
from oakemu_core.algo.schedules import LinearSchedule
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.algo.trainer_thread import run_trainer
from oakemu_core.envs import make_vector_env
from oakemu_core.policy.distributions import distribution_for_env
from oakemu_core.policy.models import build_model
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.checkpoint import CheckpointWriter, load_checkpoint, save_run_checkpoint
from oakemu_core.storage.assembler import FullRollout
from oakemu_core.storage.rollout_buffer import RolloutBuffer

T, N = 32, 4


def save_numbered(run_dir: Path, update: int, state: dict[str, Any], final: bool) -> Path:
    """CheckpointPolicy's ``save_fn`` without a CheckpointWriter (final or not, the same file)."""
    return save_run_checkpoint(run_dir, update, state)


@pytest.fixture
def cartpole():
    env = make_vector_env("CartPole-v1", N, seed=0)
    spec = env.spec
    schema = schema_for_env(spec)
    buffer = RolloutBuffer(T, N, schema=schema)
    torch.manual_seed(0)
    model = build_model(spec.observation_layout, distribution_for_env(spec))
    yield env, schema, buffer, model
    buffer.close()
    env.close()


def fill(buffer: RolloutBuffer, stepper: PolicyStepper, version: int) -> FullRollout:
    """One full rollout acted by ``stepper``'s model; returns it with its GAE bootstrap data."""
    buffer.reset()
    stepper.policy_version = version
    for _ in range(T):
        row = stepper.step()
        row.buffers.add_to_rollout_buffer(
            buffer, policy_version=row.policy_version, policy_revision=row.policy_revision
        )
    return FullRollout(
        slot=0,
        buffer=buffer,
        last_values=row.next_values.copy(),
        last_dones=row.buffers.dones.copy(),
    )


def make_learner(model, settings: PPOSettings, tester=None, **revisions) -> PPOLearner:
    """A CPU learner (Adam, learning rate 1e-3 annealed over 100 updates); ``revisions``: its
    ``revision_sink`` / ``revision_max_approx_kl`` / ``revision_min_sgd_steps``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    return PPOLearner(
        RuntimeContext(settings, device="cpu", tester=tester),
        ThreadSafeModel(model),
        None,
        optimizer,
        LinearSchedule(1e-3, 0.0, 100),
        **revisions,
    )


def test_seed_002_calls_as_written(cartpole) -> None:
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=4, ppo_epochs=2))
    assert learner.iterations == 0 and learner.rollouts_collected == 0
    stepper = PolicyStepper(env, model)
    rollout = fill(buffer, stepper, learner.policy_version)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner.update(learner.prepare(rollout))
    assert learner.iterations == 1 and learner.rollouts_collected == 1
    assert learner.policy_version == 1
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), (
        "the update changed nothing"
    )

    state = learner.state()
    fresh = make_learner(
        build_model(env.spec.observation_layout, distribution_for_env(env.spec)),
        PPOSettings(),
    )
    fresh.restore_state(PPOLearnerRuntimeState.from_dict(state.to_dict()))
    assert (fresh.iterations, fresh.rollouts_collected, fresh.policy_version) == (1, 1, 1)


def test_run_trains_published_rollouts_and_stops(cartpole, tmp_path: Path) -> None:
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1))
    stepper = PolicyStepper(env, model)
    handshake = RolloutHandshake()
    policy = CheckpointPolicy(
        tmp_path, state_fn=learner.checkpoint_state, save_fn=save_numbered, every_updates=2
    )
    stop_event = threading.Event()
    thread = threading.Thread(
        target=run_trainer, args=(learner, stop_event, lambda: 123, handshake, policy)
    )
    thread.start()
    try:
        for update in range(3):
            with learner.learner_model.locked():  # the actor side reads the model between updates
                rollout = fill(buffer, stepper, learner.policy_version)
            handshake.publish(rollout)
            results = []
            while not results:
                results = handshake.results()
            (result,) = results
            assert (
                result.slot == 0
                and result.policy_version == update + 1
                and result.stats is not None
            )
            assert (
                result.trained_env_steps == (update + 1) * T * N
            )  # the budget's count: every row, none stale
            assert not handshake.busy
            assert set(result.weights) == set(model.state_dict())
    finally:
        stop_event.set()
        thread.join(10)
        handshake.close()
    assert not thread.is_alive()
    assert learner.iterations == 3
    assert (tmp_path / "checkpoints" / "checkpoint_00000002.pt").is_file()  # every 2 updates


def test_only_the_final_checkpoint_save_counts_as_the_final_checkpoint(
    cartpole, tmp_path: Path
) -> None:
    """Periodic checkpoints (every update here), even one written after the stop was asked for, leave
    CheckpointWriter.final_saved None; the save the stopped trainer makes (policy.final) sets it."""
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1))
    stepper = PolicyStepper(env, model)
    handshake = RolloutHandshake()
    writer = CheckpointWriter(tmp_path, keep_last=None)
    policy = CheckpointPolicy(
        tmp_path,
        state_fn=learner.checkpoint_state,
        every_updates=1,
        save_fn=lambda _run_dir, update, state, final: writer.save(update, state, final=final),
    )
    with running(learner, handshake, policy):
        for _ in range(2):
            with learner.learner_model.locked():
                rollout = fill(buffer, stepper, learner.policy_version)
            handshake.publish(rollout)
            while not handshake.results():
                pass
        assert writer.last_saved == tmp_path / "checkpoints" / "checkpoint_00000002.pt"
        assert writer.final_saved is None
    assert (
        writer.final_saved
        == writer.last_saved
        == tmp_path / "checkpoints" / "checkpoint_00000002.pt"
    )


def test_rows_too_stale_to_train_never_count_as_trained_env_steps(cartpole, tmp_path: Path) -> None:
    """A rollout acted by a policy more than max_policy_lag versions old trains nothing: the run's budget
    (trained env steps) does not move, and the count survives a checkpoint."""
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1, max_policy_lag=1))
    stepper = PolicyStepper(env, model)
    handshake = RolloutHandshake()
    policy = CheckpointPolicy(tmp_path, state_fn=learner.checkpoint_state, save_fn=save_numbered)
    trained, stale = [], []
    with running(learner, handshake, policy):
        for acted_by in (0, 1, 0):  # the third rollout: acted by version 0 when the learner is at 2
            with learner.learner_model.locked():
                rollout = fill(buffer, stepper, acted_by)
            handshake.publish(rollout)
            results = []
            while not results:
                results = handshake.results()
            trained.append(results[0].trained_env_steps)
            stale.append(results[0].stale_rows)
    handshake.close()
    # Each env's first row was acted at the end of the previous rollout, by version 1: not stale.
    assert stale == [0, 0, T * N - N]
    assert trained == [T * N, 2 * T * N, 2 * T * N + N]
    restored = PPOLearnerRuntimeState.from_dict(learner.state().to_dict())
    assert restored.trained_env_steps == 2 * T * N + N
    assert (
        PPOLearnerRuntimeState.from_dict(
            {"iterations": 1, "rollouts_collected": 1, "policy_version": 1}
        ).trained_env_steps
        is None
    )  # an older checkpoint


@contextmanager
def running(
    learner: PPOLearner, handshake: RolloutHandshake, policy: CheckpointPolicy
) -> Iterator[threading.Thread]:
    """``run_trainer(learner, ...)`` in a thread of its own while the block runs (global step 123); stopped and
    joined (10 s at most) when it ends."""
    stop_event = threading.Event()
    thread = threading.Thread(
        target=run_trainer, args=(learner, stop_event, lambda: 123, handshake, policy)
    )
    thread.start()
    try:
        yield thread
    finally:
        stop_event.set()
        thread.join(10)


def test_run_writes_the_final_checkpoint_when_it_stops(cartpole, tmp_path: Path) -> None:
    """The documented PPOLearner.run manages periodic and final checkpointing. With periodic checkpoints off, the
    run folder holds the final checkpoint once run() returns, and a last result (no slot) is handed
    back after the update's."""
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1))
    stepper = PolicyStepper(env, model)
    handshake = RolloutHandshake()
    no_periodic = CheckpointPolicy(
        tmp_path, state_fn=learner.checkpoint_state, save_fn=save_numbered, every_updates=0
    )
    with running(learner, handshake, no_periodic) as thread:
        with learner.learner_model.locked():
            handshake.publish(fill(buffer, stepper, learner.policy_version))
        while not handshake.results():
            pass
        assert not list(tmp_path.glob("checkpoints/*.pt")), "no periodic checkpoint"
    assert not thread.is_alive()
    assert [p.name for p in tmp_path.glob("checkpoints/checkpoint_*.pt")] == [
        "checkpoint_00000001.pt"
    ]
    state = load_checkpoint(tmp_path / "checkpoints" / "latest.pt")
    assert state["ppo"]["iterations"] == 1 and state["ppo"]["policy_version"] == 1
    (final,) = handshake.results()
    assert isinstance(final, TrainResult) and final.slot is None and final.policy_version == 1
    handshake.close()


def test_a_handed_back_result_wakes_the_ingest_threads_poller() -> None:
    """``wake_fd`` is readable from ``complete`` until ``results`` collects what was handed back,
    so the ingest loop needs no poll timeout to notice a finished update."""
    import select

    handshake = RolloutHandshake()
    try:
        readable = lambda: bool(select.select([handshake.wake_fd], [], [], 0)[0])  # noqa: E731
        assert not readable()
        for revision in range(1, 70_001):  # more than a pipe holds (64 KiB): complete never blocks
            handshake.complete(WeightsRevision(0, revision, {}))
        assert readable()
        assert len(handshake.results()) == 70_000 and not readable()
        handshake.complete(WeightsRevision(0, 1, {}))
        assert readable()
    finally:
        handshake.close()
    handshake.close()  # idempotent
    handshake.complete(WeightsRevision(0, 2, {}))  # after close: queued, no wake-up, no error


def test_weights_within_an_update_come_before_its_result(cartpole, tmp_path: Path) -> None:
    """With a revision sink (publish_every_epoch) an update of 3 epochs hands back the weights of
    epochs 1 and 2 as revisions of the version in training, then its result; busy until the result."""
    env, _schema, buffer, model = cartpole
    handshake = RolloutHandshake()
    learner = make_learner(
        model,
        PPOSettings(num_minibatches=2, ppo_epochs=3),
        revision_sink=lambda version, revision, weights: handshake.complete(
            WeightsRevision(version, revision, weights)
        ),
    )
    stepper = PolicyStepper(env, model)
    policy = CheckpointPolicy(tmp_path, state_fn=learner.checkpoint_state, save_fn=save_numbered)
    stop_event = threading.Event()
    thread = threading.Thread(
        target=run_trainer, args=(learner, stop_event, lambda: 123, handshake, policy)
    )
    thread.start()
    try:
        for update in range(2):
            with learner.learner_model.locked():
                rollout = fill(buffer, stepper, learner.policy_version)
                before = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
            handshake.publish(rollout)
            received: list = []
            while not received or not isinstance(received[-1], TrainResult):
                assert handshake.busy  # revisions do not end the update
                received += handshake.results()
            *revisions, result = received
            assert [(r.policy_version, r.revision) for r in revisions] == [(update, 1), (update, 2)]
            assert result.policy_version == update + 1 and not handshake.busy
            for older, newer in zip(
                [before, *[r.weights for r in revisions]],
                [*[r.weights for r in revisions], result.weights],
            ):
                assert set(newer) == set(before)
                assert any(not np.array_equal(older[k], newer[k]) for k in before), (
                    "each epoch moves the weights"
                )
    finally:
        stop_event.set()
        thread.join(10)
        handshake.close()
    assert not thread.is_alive()
    # Lag in SGD steps (2 per epoch): (0, 1) came at 2, (0, 2) at 4, (1, 0) at 6, (1, 1) at 8,
    # (1, 2) at 10 and (2, 0) at 12, now. Version 0 itself was never published by an update:
    # 2 versions x 6 nominal SGD steps.
    assert learner.sgd_steps == 12 and learner.policy_version == 2
    lag = learner.lag_in_sgd_steps(
        np.array([[1, 1, 0], [0, 2, 0]]), np.array([[0, 2, 1], [1, 0, 0]])
    )
    assert lag == {"sgd_min": 0.0, "sgd_mean": (6 + 2 + 10 + 10 + 0 + 12) / 6, "sgd_max": 12.0}
    assert (
        learner.lag_in_sgd_steps(np.array([1, 2]))["sgd_mean"] == (6 + 0) / 2
    )  # no revisions given: 0
    # prepare() reads the rows' revisions: a rollout acted by revision 1 of version 1 (its first row
    # maybe by the bundle chosen before, revision 0).
    stepper.weights_revision = 1
    rollout = fill(buffer, stepper, 1)
    assert (buffer.policy_versions == 1).all() and (buffer.policy_revisions == 1).any()
    lag = learner.prepare(rollout).lag
    expected = np.where(buffer.policy_revisions == 1, 12 - 8, 12 - 6).mean()
    assert lag["sgd_mean"] == pytest.approx(expected) and lag["sgd_min"] == 4.0


def test_weights_the_health_check_could_reject_are_not_published_within_an_update(cartpole) -> None:
    _env, _schema, buffer, model = cartpole
    sent: list[tuple[int, int]] = []
    learner = make_learner(
        model,
        PPOSettings(num_minibatches=2, ppo_epochs=3),
        revision_sink=lambda version, revision, weights: sent.append((version, revision)),
        revision_max_approx_kl=0.5,
    )
    learner.publish_revision(1, 0.1, 0, 2)
    learner.publish_revision(2, 0.6, 0, 4)  # kept back: the update's health check may roll it back
    learner.publish_revision(2, 0.1, 1, 4)  # a gradient was skipped as non-finite
    learner.publish_revision(2, math.nan, 0, 4)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    learner.publish_revision(2, 0.1, 0, 4)  # non-finite weights
    assert sent == [(learner.policy_version, 1)]


def test_revisions_are_published_at_most_once_per_min_sgd_steps(cartpole) -> None:
    """With ``revision_min_sgd_steps`` 3, an epoch's weights go out only when 3 SGD steps or more
    passed since the weights last published (a version or a revision)."""
    _env, _schema, buffer, model = cartpole
    sent: list[tuple[int, int]] = []
    learner = make_learner(
        model,
        PPOSettings(num_minibatches=2, ppo_epochs=5),
        revision_sink=lambda version, revision, weights: sent.append((version, revision)),
        revision_min_sgd_steps=3,
    )
    learner.sgd_ledger.sgd_steps = 10
    learner.sgd_ledger.note(
        learner.policy_version, 0, 10
    )  # the version in training was published at 10
    for epochs_done, update_sgd_steps in ((1, 2), (2, 4), (3, 5), (4, 7)):  # at 12, 14, 15, 17
        learner.publish_revision(epochs_done, 0.01, 0, update_sgd_steps)
    version = learner.policy_version
    assert sent == [(version, 2), (version, 4)]  # 14 - 10 = 4 and 17 - 14 = 3; 2 and 1 are too few
    assert (
        learner.sgd_ledger.published[(version, 2)] == 14
        and learner.sgd_ledger.published[(version, 4)] == 17
    )


def test_collapse_is_rolled_back_with_a_higher_policy_version(cartpole, tmp_path: Path) -> None:
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1))
    stepper = PolicyStepper(env, model)
    policy = CheckpointPolicy(
        tmp_path,
        state_fn=learner.checkpoint_state,
        save_fn=save_numbered,
        health=HealthMonitor(),
        every_updates=1,
        lr_factor=0.5,
        max_rollbacks=2,
    )
    rollout = fill(buffer, stepper, learner.policy_version)
    prepared = learner.prepare(rollout)
    assert (
        policy.after_update(learner, learner.update(prepared)) == []
    )  # healthy: checkpoint 1 written
    good = load_checkpoint(tmp_path / "checkpoints" / "latest.pt")["model"]

    # Garbage weights (as a destroyed policy would have): detected after the next update.
    rollout = fill(buffer, stepper, learner.policy_version)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    prepared = learner.prepare(rollout)
    version_before = learner.policy_version
    notes = policy.after_update(learner, learner.update(prepared))
    assert len(notes) == 1 and "rollback 1/2" in notes[0] and "non-finite" in notes[0]
    assert policy.rollbacks == 1
    assert learner.policy_version > version_before
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, good[name])
    assert learner.lr_scale == 0.5

    # Training goes on from the restored weights.
    prepared = learner.prepare(fill(buffer, stepper, learner.policy_version))
    stats = learner.update(prepared)
    assert stats is not None and np.isfinite(stats.policy_loss)
    assert policy.after_update(learner, stats) == []

    # A run that keeps collapsing stops with a clear message.
    rollout = fill(buffer, stepper, learner.policy_version)
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))
    prepared = learner.prepare(rollout)
    policy.after_update(learner, learner.update(prepared))  # rollback 2
    rollout = fill(buffer, stepper, learner.policy_version)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    prepared = learner.prepare(rollout)
    with pytest.raises(RunCollapsedError, match="after 2 rollbacks"):
        policy.after_update(learner, learner.update(prepared))


def test_learning_rate_that_destroys_the_policy_is_caught_by_the_kl_check(
    cartpole, tmp_path: Path
) -> None:
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=4, ppo_epochs=4))
    stepper = PolicyStepper(env, model)
    policy = CheckpointPolicy(
        tmp_path,
        state_fn=learner.checkpoint_state,
        save_fn=save_numbered,
        health=HealthMonitor(max_approx_kl=0.5),
        every_updates=1,
    )
    prepared = learner.prepare(fill(buffer, stepper, 0))
    policy.after_update(learner, learner.update(prepared))
    learner.lr_schedule = None
    for group in learner.optimizer.param_groups:
        group["lr"] = 50.0  # destroys the policy within one update
    prepared = learner.prepare(fill(buffer, stepper, learner.policy_version))
    stats = learner.update(prepared)
    assert stats is not None
    notes = policy.after_update(learner, stats)
    assert notes and "rollback 1/" in notes[0], (stats.approx_kl, notes)


def test_evaluation_collapse_rolls_back_to_best(cartpole, tmp_path: Path) -> None:
    """Three evaluations in a row below half of the best restore best.pt (the evaluated weights)."""
    from oakemu_core.policy.models import weights_to_arrays
    from oakemu_core.run.tester import EvaluationReport

    def report(mean: float, version: int, weights=None) -> EvaluationReport:
        return EvaluationReport(
            policy_version=version,
            global_step=100 * version,
            episodes=1,
            return_mean=mean,
            return_std=0.0,
            length_mean=10.0,
            returns=(mean,),
            lengths=(10,),
            greedy=True,
            wall_seconds=0.1,
            finished_at=0.0,
            weights=weights,
        )

    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings())
    policy = CheckpointPolicy(
        tmp_path,
        state_fn=learner.checkpoint_state,
        save_fn=save_numbered,
        health=HealthMonitor(eval_fraction=0.5, eval_patience=3),
    )
    policy.after_evaluation(learner, report(10.0, 0, weights_to_arrays(model)))
    best_weights = weights_to_arrays(model)
    notes = policy.after_evaluation(learner, report(200.0, 1, best_weights))
    assert any("best.pt" in n for n in notes) and policy.best_path.is_file()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for mean in (50.0, 40.0):
        assert policy.after_evaluation(learner, report(mean, 2)) == []
    notes = policy.after_evaluation(learner, report(30.0, 2))
    assert notes and "rollback 1/" in notes[0] and "evaluation return" in notes[0]
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), best_weights[name])


def test_the_final_evaluation_does_not_submit_the_run_s_first_weights_twice(cartpole) -> None:
    """A run stopped before its first update: the first weights, submitted at start, are the final
    ones too and go to the tester once; after an update the final weights are submitted."""

    class RecordingTester:
        alive = True

        def __init__(self) -> None:
            self.submitted: list[int] = []

        def submit(
            self, version: int, weights: Any, global_step: int, *, keep: bool = False
        ) -> None:
            self.submitted.append(version)

        def drain(self, timeout_s: float) -> list[Any]:
            return []

    _env, _schema, buffer, model = cartpole
    tester = RecordingTester()
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1), tester=tester)

    def final_evaluation() -> None:
        version, weights = learner.learner_model.snapshot()
        learner.evaluations.final(version, weights, global_step=0, policy=None, learner=learner)

    learner.submit_to_tester(0, force=True)  # what the learner service does at start
    final_evaluation()
    assert tester.submitted == [0]
    learner.learner_model.version += 1  # as an update does
    final_evaluation()
    assert tester.submitted == [0, 1]
