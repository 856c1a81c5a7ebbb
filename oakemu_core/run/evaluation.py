"""Play whole episodes with a policy and report raw episodic returns (``oakemu evaluate``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oakemu_core.envs.factory import make_eval_env
from oakemu_core.envs.options import EnvOptions
from oakemu_core.envs.vector import VectorEnv
from oakemu_core.policy.episodic import EpisodicActor
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.policy.network import NetworkSpec

if TYPE_CHECKING:
    from oakemu_core.envs.render import FrameSink

__all__ = ["EvaluationResult", "build_evaluation", "play_episodes"]


@dataclass(frozen=True)
class EvaluationResult:
    """Raw (unclipped) returns and lengths (agent steps) of the evaluated episodes, in the order
    they finished."""

    returns: list[float]
    lengths: list[int]

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std(self) -> float:
        """Population std (ddof 0)."""
        return float(np.std(self.returns))


def build_evaluation(
    env_id: str,
    schema_dict: Mapping[str, Any],
    *,
    seed: int | None,
    max_episode_steps: int | None = None,
    settings_file: str | None = None,
    normalize_observations: bool = False,
    env_options: EnvOptions | None = None,
    frame_sink: FrameSink | None = None,
    network: Mapping[str, Any] | None = None,
) -> tuple[ActorCritic, VectorEnv]:
    """The one place that builds an evaluation's policy and env (``oakemu evaluate`` and the tester).

    Seeds torch's global RNG with ``seed`` (sampled actions are reproducible), builds one env of
    ``env_id`` without reward clipping (:func:`oakemu_core.envs.make_eval_env`, so returns are the
    raw game score) and a CPU model in eval mode with freshly initialised weights for its
    observation layout and the schema's action distribution. The caller loads weights
    (``model.load_state_dict`` or :func:`oakemu_core.policy.models.load_weight_arrays`), calls
    :func:`play_episodes` and closes the env. Building anew for every evaluation makes two
    evaluations with the same seed play the same episodes (the env is seeded on its first reset).

    Args:
        env_id: the run's env id.
        schema_dict: the run's step schema as :meth:`StepSchema.to_dict` wrote it (a checkpoint's
            ``state["env"]["schema"]``).
        seed: env and torch seed; None leaves both unseeded.
        max_episode_steps, settings_file, normalize_observations: the run's settings of these names
            (``config.max_episode_steps``, ``config.emulator_settings``, ``config.normalize_observations``).
        env_options: the run's ``gymnasium.make`` keyword arguments and Atari preprocessing (``config.env_options``).
        frame_sink: receives the full-colour frames of the episodes played
            (:class:`oakemu_core.run.video.EpisodeVideos`); rendering changes neither the actions nor
            the returns. None: nothing renders.
        network: the run's architecture (:meth:`NetworkSpec.to_dict`; a checkpoint's settings hold its
            fields); None: the default.

    Raises:
        ValueError: a malformed schema dict (from ``schema_from_dict``).
        oakemu_core.envs.UnsupportedEnvironmentError: unknown env id or unsupported spaces.
    """
    from oakemu_core.policy.schemas import schema_from_dict

    schema = schema_from_dict(dict(schema_dict))
    if seed is not None:
        torch.manual_seed(seed)
    env = make_eval_env(
        env_id,
        seed=seed,
        max_episode_steps=max_episode_steps,
        settings_file=settings_file,
        options=env_options,
        frame_sink=frame_sink,
    )
    try:
        model = build_model(
            env.spec.observation_layout,
            schema.distribution,
            normalize_observations=bool(normalize_observations),
            network=NetworkSpec.from_dict(network or {}),
        )
        model.eval()
    except BaseException:
        env.close()
        raise
    return model, env


def play_episodes(
    model: ActorCritic, env: VectorEnv, *, episodes: int, greedy: bool
) -> EvaluationResult:
    """Play until ``episodes`` episodes have finished, acting with ``model`` (masks applied).

    A recurrent model carries its state per env from step to step, from zeros, and starts each
    env's next episode from zeros again (:class:`~oakemu_core.policy.episodic.EpisodicActor`).

    Args:
        model: the policy (its observation layout and distribution fit ``env``).
        env: a vector env without reward clipping (:func:`oakemu_core.envs.make_eval_env`); reset here.
        episodes: episodes to finish, >= 1.
        greedy: act with the distribution's mode instead of sampling.

    Raises:
        ValueError: ``episodes`` < 1.
    """
    if episodes < 1:
        raise ValueError(f"episodes: expected >= 1, received {episodes}")
    returns: list[float] = []
    lengths: list[int] = []
    actor = EpisodicActor(model)
    observations = env.reset()
    masks = env.action_masks()
    while len(returns) < episodes:
        step = env.step(actor.act(observations, action_mask=masks, greedy=greedy).actions)
        actor.reset(step.dones)
        returns.extend(step.episode_returns)
        lengths.extend(step.episode_lengths)
        observations, masks = step.observations, step.action_masks
    return EvaluationResult(returns[:episodes], lengths[:episodes])
