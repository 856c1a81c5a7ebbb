"""What crosses between the learner's threads, and the learner's seams: the trainer's counters
(iterations, learning rate, checkpoint failures) reach the ingest thread only with the results it
collects; the checkpoint policy judges any learner of the small ``JudgedLearner`` protocol; the
health module does not import the learner."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import oakemu_core.algo.health as health_module
from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.algo.handshake import RolloutHandshake, TrainerCounters, TrainResult
from oakemu_core.algo.health import CheckpointPolicy, HealthMonitor
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.run.checkpoint import save_run_checkpoint
from tests.algo.test_learner import (  # noqa: F401 (cartpole is a fixture)
    cartpole,
    fill,
    make_learner,
    running,
    save_numbered,
)


def test_trainer_counters_reach_the_ingest_thread_with_the_results_it_collects() -> None:
    handshake = RolloutHandshake()
    try:
        assert handshake.trainer_counters.iterations == 0
        assert math.isnan(handshake.trainer_counters.learning_rate)
        handshake.report_trainer(TrainerCounters(4, 2.5e-4, 1))  # before the trainer thread starts
        assert handshake.trainer_counters == TrainerCounters(4, 2.5e-4, 1)
        handshake.complete(
            TrainResult(None, 5, {}, None, iterations=5, learning_rate=2e-4, checkpoint_failures=2)
        )
        # Handed back but not collected: the ingest thread still sees the previous counters.
        assert handshake.trainer_counters == TrainerCounters(4, 2.5e-4, 1)
        (result,) = handshake.results()
        assert handshake.trainer_counters == TrainerCounters(5, 2e-4, 2)
        assert result.learning_rate == 2e-4
    finally:
        handshake.close()


def test_the_trainer_thread_hands_its_counters_over_with_each_result(cartpole, tmp_path) -> None:  # noqa: F811
    env, _schema, buffer, model = cartpole
    learner = make_learner(model, PPOSettings(num_minibatches=2, ppo_epochs=1))
    handshake = RolloutHandshake()
    policy = CheckpointPolicy(
        tmp_path,
        state_fn=learner.checkpoint_state,
        save_fn=save_numbered,
        every_updates=0,
        write_failures=lambda: 7,
    )
    with running(learner, handshake, policy):
        with learner.learner_model.locked():
            handshake.publish(fill(buffer, PolicyStepper(env, model), learner.policy_version))
        while not (results := handshake.results()):
            pass
        # The update's result: the schedule moved on one update (1e-3 annealed over 100).
        (result,) = results
        assert result.iterations == 1
        assert handshake.trainer_counters == TrainerCounters(1, pytest.approx(0.99e-3), 7)
    handshake.close()


class _FakeLearner:
    """A learner as :class:`CheckpointPolicy` sees it (``JudgedLearner``), no PPOLearner."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 1)
        self.iterations = 3
        self.policy_version = 3
        self.device = torch.device("cpu")
        self.lr_scale = 1.0
        self.restored: list[float] = []

    def restore_weights(self, state: dict[str, Any], *, lr_factor: float) -> None:
        self.model.load_state_dict(state["model"])
        self.lr_scale *= lr_factor
        self.policy_version += 1
        self.restored.append(lr_factor)


def test_the_checkpoint_policy_judges_any_learner_of_the_protocol(tmp_path: Path) -> None:
    learner = _FakeLearner()
    good = {key: value.clone() for key, value in learner.model.state_dict().items()}

    def state() -> dict[str, Any]:
        return {"model": learner.model.state_dict()}

    save_run_checkpoint(tmp_path, 3, {"model": good})
    policy = CheckpointPolicy(
        tmp_path, state_fn=state, save_fn=save_numbered, health=HealthMonitor(), lr_factor=0.5
    )
    with torch.no_grad():
        learner.model.weight.fill_(math.nan)
    (note,) = policy.after_update(learner, None)
    assert "rollback 1/3" in note and "non-finite weights" in note
    assert learner.restored == [0.5] and learner.policy_version == 4
    np.testing.assert_array_equal(learner.model.weight.detach(), good["weight"])


def test_the_health_module_does_not_import_the_learner() -> None:
    """The learner depends on the health checks, never the other way (no import, not even one for
    type checking): the checks see the learner through ``JudgedLearner``."""
    tree = ast.parse(Path(health_module.__file__).read_text(encoding="utf-8"))
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not {name for name in imported if name.startswith("oakemu_core.algo.learner")}
