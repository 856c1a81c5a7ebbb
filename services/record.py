"""``oakemu record``: play episodes with a checkpoint's policy, random or scripted play, and write
them as a Minari dataset of demonstrations (see :mod:`oakemu_core.algo.recording`).

    oakemu record --env CartPole-v1 --episodes 20 --output demos/cartpole --policy my_pkg.experts:cartpole
    oakemu record --checkpoint runs/<run>/checkpoints/best.pt --episodes 20 --output demos/breakout
    oakemu record --env ALE/Breakout-v5 --episodes 5 --output demos/breakout-random --policy random

The dataset is then used by a run with ``--bc-dataset demos/cartpole``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from oakemu_core.errors import ConfigError

__all__ = ["load_checkpoint_policy", "main", "record"]


def load_checkpoint_policy(checkpoint: Path) -> tuple[Any, str, dict[str, Any]]:
    """``(model in eval mode on the CPU, env id, run config dict)`` of a checkpoint file or run folder.

    Raises:
        FileNotFoundError: no checkpoint there (a run folder is searched for its latest).
        oakemu_core.run.checkpoint.CheckpointError: unreadable checkpoint.
    """
    from oakemu_core.envs import env_spec
    from oakemu_core.envs.options import EnvOptions
    from oakemu_core.policy.models import build_model
    from oakemu_core.policy.network import NetworkSpec
    from oakemu_core.policy.schemas import schema_from_dict
    from oakemu_core.policy.weights import load_model_state
    from oakemu_core.run.checkpoint import load_checkpoint, resolve_checkpoint

    path = resolve_checkpoint(checkpoint)
    state = load_checkpoint(path)
    env_info, config = state["env"], dict(state.get("config") or {})
    schema = schema_from_dict(env_info["schema"])
    spec = env_spec(
        env_info["env_id"],
        settings_file=config.get("emulator_settings"),
        options=EnvOptions.from_settings(config),
    )
    model = build_model(
        spec.observation_layout,
        schema.distribution,
        normalize_observations=bool(config.get("normalize_observations")),
        network=NetworkSpec.from_config(config),
    )
    load_model_state(model, state["model"], source=str(path))
    model.eval()
    return model, str(env_info["env_id"]), config


def record(
    *,
    env_id: str | None,
    episodes: int,
    output: Path,
    checkpoint: Path | None = None,
    policy: str | None = None,
    seed: int = 1,
    num_envs: int = 1,
    greedy: bool = True,
    max_episode_steps: int | None = None,
    overwrite: bool = False,
    env_kwargs: str | None = None,
) -> Any:
    """Record the dataset; returns :class:`oakemu_core.algo.recording.RecordingSummary`.

    Exactly one of ``checkpoint`` and ``policy`` (default: ``"random"``). With a checkpoint the env
    id (and time limit, emulator settings, ``gymnasium.make`` keyword arguments, Atari preprocessing) are the
    run's; another ``env_id`` or ``env_kwargs`` is refused. ``env_kwargs``: a JSON object of ``gymnasium.make``
    keyword arguments (without a checkpoint).

    Raises:
        ValueError: both a checkpoint and a policy, no env id, or an env id other than the
            checkpoint's; see also :func:`oakemu_core.algo.recording.record_dataset`.
    """
    import torch

    from oakemu_core.algo.recording import record_dataset
    from oakemu_core.envs.options import EnvOptions

    torch.set_num_threads(1)
    settings_file = None
    if checkpoint is not None:
        if policy is not None:
            raise ConfigError("record: expected --checkpoint or --policy, not both")
        model, run_env_id, config = load_checkpoint_policy(checkpoint)
        if env_id is not None and env_id != run_env_id:
            raise ConfigError(
                f"--env: the checkpoint {checkpoint} was trained on {run_env_id!r}, received {env_id!r} "
                "(leave --env out to record on the checkpoint's env)"
            )
        env_id = run_env_id
        settings_file = config.get("emulator_settings")
        if env_kwargs is not None:
            raise ConfigError(
                "--env-kwargs: a checkpoint records on its run's env settings; leave it out"
            )
        options = EnvOptions.from_settings(config)
        if max_episode_steps is None:
            max_episode_steps = config.get("max_episode_steps")
        acting: Any = model
        name = f"checkpoint {checkpoint} ({'greedy' if greedy else 'sampled'})"
    else:
        if env_id is None:
            raise ConfigError("--env: expected an env id (or --checkpoint, whose env is used)")
        acting = policy or "random"
        options = EnvOptions.from_settings({"env_kwargs": env_kwargs or "{}"})
        name = f"policy {acting}"
    torch.manual_seed(seed)
    return record_dataset(
        env_id,
        output,
        episodes=episodes,
        policy=acting,
        seed=seed,
        num_envs=num_envs,
        max_episode_steps=max_episode_steps,
        settings_file=settings_file,
        greedy=greedy,
        algorithm_name=f"oakemu record ({name})",
        overwrite=overwrite,
        options=options,
    )


def main(**kwargs: Any) -> int:
    """Entry point (keyword arguments of :func:`record`): prints one summary line and returns 0. A user
    mistake raises a :class:`~oakemu_core.errors.UserError`, which the CLI reports (one line, exit 2)."""
    summary = record(**kwargs)
    print(
        f"{summary.path}: {summary.episodes} episodes, {summary.steps} steps, return mean "
        f"{np.mean(summary.returns):.2f} std {np.std(summary.returns):.2f} (Minari dataset {summary.dataset_id})"
    )
    return 0
