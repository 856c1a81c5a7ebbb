"""OakEmu-RL core library: the data path from an emulator to a PPO minibatch, as sub-packages.

``envs`` (emulators behind one vector-env interface) -> ``actor`` (steps them with the policy,
fills per-step buffers) -> ``transport`` (step and control messages, step rings) -> ``storage``
(the shared-memory rollout buffer, GAE, minibatches) -> ``algo`` (the PPO update, the learner
loop); ``policy`` is what acts, ``run`` what surrounds a run (checkpoints, metrics, evaluation).

The names a user starts from are importable from here: ``train(config=None, preset=None, **settings) -> Run``
(with ``Callback``, ``UpdateInfo``, ``EvaluationInfo`` for its callbacks), ``tune(preset=None, **options) ->
TuneResult`` (a hyperparameter study, extra ``tune``) and ``load_policy(checkpoint) -> Policy`` for training
and acting from Python (``train`` and ``tune`` come from ``oakemu_services.api`` and ``oakemu_services.tune``:
they run the service processes). The rollout-core names load eagerly; the
others load on first use, so ``import oakemu_core`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from oakemu_core.actor.step_buffers import PPOActorStepBuffers
from oakemu_core.policy.action_bundle import PPOActionBundle
from oakemu_core.storage.rollout_buffer import RolloutBuffer, RolloutMinibatch

if TYPE_CHECKING:
    from oakemu_services.api import TrainingFailed, train
    from oakemu_services.tune import TuneResult, tune

    from oakemu_core.algo.handshake import RolloutHandshake
    from oakemu_core.algo.health import CheckpointPolicy
    from oakemu_core.algo.learner import (
        PPOExperimentConfiguration,
        PPOLearner,
        PPOLearnerRuntimeState,
        RuntimeContext,
        ThreadSafeModel,
    )
    from oakemu_core.algo.settings import PPOSettings
    from oakemu_core.algo.trainer import Trainer
    from oakemu_core.config import OakEmuConfig, load_config, make_config
    from oakemu_core.envs import EnvSpec, env_spec, make_vector_env
    from oakemu_core.policy.models import ActorCritic, build_model
    from oakemu_core.run.callbacks import Callback, EvaluationInfo, UpdateInfo
    from oakemu_core.run.checkpoint import load_checkpoint
    from oakemu_core.run.loading import Policy, load_policy
    from oakemu_core.run.results import Run

# name -> the module that defines it (loaded by __getattr__ on first use).
_LAZY = {
    "PPOLearner": "oakemu_core.algo.learner",
    "PPOExperimentConfiguration": "oakemu_core.algo.learner",
    "RuntimeContext": "oakemu_core.algo.learner",
    "PPOLearnerRuntimeState": "oakemu_core.algo.learner",
    "ThreadSafeModel": "oakemu_core.algo.learner",
    "RolloutHandshake": "oakemu_core.algo.handshake",
    "CheckpointPolicy": "oakemu_core.algo.health",
    "PPOSettings": "oakemu_core.algo.settings",
    "Trainer": "oakemu_core.algo.trainer",
    "OakEmuConfig": "oakemu_core.config",
    "load_config": "oakemu_core.config",
    "EnvSpec": "oakemu_core.envs",
    "env_spec": "oakemu_core.envs",
    "make_vector_env": "oakemu_core.envs",
    "ActorCritic": "oakemu_core.policy.models",
    "build_model": "oakemu_core.policy.models",
    "load_checkpoint": "oakemu_core.run.checkpoint",
    "Policy": "oakemu_core.run.loading",
    "load_policy": "oakemu_core.run.loading",
    "Run": "oakemu_core.run.results",
    "Callback": "oakemu_core.run.callbacks",
    "UpdateInfo": "oakemu_core.run.callbacks",
    "EvaluationInfo": "oakemu_core.run.callbacks",
    "make_config": "oakemu_core.config",
    # Names served from the services package: training and tuning from Python start the service processes.
    "train": "oakemu_services.api",
    "TrainingFailed": "oakemu_services.api",
    "tune": "oakemu_services.tune",
    "TuneResult": "oakemu_services.tune",
}

__all__ = ["PPOActionBundle", "PPOActorStepBuffers", "RolloutBuffer", "RolloutMinibatch", *_LAZY]


def __getattr__(name: str) -> Any:
    """Load a lazily exported name (module attribute hook, PEP 562); AttributeError for others."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oakemu_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
