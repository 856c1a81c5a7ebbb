"""Recording demonstrations: whole episodes played by a policy, written as a Minari dataset.

:func:`record_dataset` (``oakemu record``) plays whole episodes through the same
:class:`~oakemu_core.envs.VectorEnv` the actors use and stores them as the policy sees them (the
format: :mod:`oakemu_core.algo.demonstrations`). Each finished episode becomes a Minari
``EpisodeBuffer`` built from the vector-env steps, and ``minari.create_dataset_from_buffers`` writes
the dataset with explicit spaces (:func:`~oakemu_core.algo.demonstrations.dataset_spaces`).
Minari's own ``DataCollector`` would wrap a raw Gymnasium env and store the raw observations, which
the networks never see (and Atari's preprocessing lives in ale-py's vector env, not in wrappers).
Consequences: the dataset has no Minari ``env_spec`` (``recover_environment()`` cannot rebuild the
preprocessing); the env id and the full spec are in the metadata (``oakemu_env_id``,
``oakemu_spec``). Rewards are the raw (unclipped) game rewards. Frames are stored losslessly (no
JPEG encoding). Action masks, where the env has them, are in ``infos["action_mask"]``
(``(T + 1, width)`` bool; the last row, the final observation's mask, is all True).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from oakemu_core.actor.routing import checked_actions, load_callable, random_actions
from oakemu_core.algo.demonstrations import DemonstrationDataError, dataset_spaces, import_minari
from oakemu_core.envs.factory import make_vector_env
from oakemu_core.envs.options import EnvOptions
from oakemu_core.envs.spec import PLAIN_KEY, EnvSpec
from oakemu_core.policy.episodic import EpisodicActor

__all__ = ["RecordingPolicy", "RecordingSummary", "make_recording_policy", "record_dataset"]

RecordingPolicy = Callable[[Any, np.ndarray | None], Any]
"""``(observations of all n envs, action masks (n, width) or None) -> actions (n, *action_shape)``.

One with an ``end_episodes(dones)`` method (a model's, :func:`make_recording_policy`) has it called
after each step with ``dones`` ``(n,)`` bool, the rows whose episode ended (a recurrent model zeroes
their state there)."""

_MINARI_ENV_LOCK = (
    threading.Lock()
)  # MINARI_DATASETS_PATH is process-global while a dataset is written


@dataclass(frozen=True)
class RecordingSummary:
    """What :func:`record_dataset` wrote.

    Attributes:
        path: the dataset folder (``path / "data"`` is the Minari data directory).
        dataset_id: the Minari dataset id in its metadata.
        episodes: episodes written. steps: agent steps written (all episodes).
        returns: raw episodic return of each episode, in order. lengths: their lengths.
    """

    path: Path
    dataset_id: str
    episodes: int
    steps: int
    returns: list[float]
    lengths: list[int]

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.returns))


def make_recording_policy(
    policy: Any, spec: EnvSpec, *, seed: int | None = None, greedy: bool = True
) -> RecordingPolicy:
    """A :data:`RecordingPolicy` from ``"random"``, ``"module:callable"``, a callable or a model.

    Args:
        policy: ``"random"`` (uniform over allowed actions), ``"module:callable"`` or a callable
            ``(observations, action_mask) -> actions`` for all envs, or an
            :class:`~oakemu_core.policy.models.ActorCritic` (its ``act``; greedy by default).
        spec: the env spec (action space, masks).
        seed: seed of the random policy's generator.
        greedy: for a model, take the most probable action instead of sampling.

    Raises:
        ValueError: an unknown policy string or a callable that cannot be imported.
    """
    if isinstance(policy, nn.Module) and hasattr(policy, "act"):
        return _ModelPolicy(policy, greedy=greedy)
    if isinstance(policy, str):
        if policy == "random":
            rng = np.random.default_rng(seed)

            def random_policy(observations: Any, action_mask: np.ndarray | None) -> np.ndarray:
                count = (
                    len(next(iter(observations.values())))
                    if isinstance(observations, dict)
                    else len(observations)
                )
                return random_actions(spec, count, rng, action_mask)

            return random_policy
        if ":" not in policy:
            raise ValueError(f"policy: expected 'random' or 'module:callable', received {policy!r}")
        return load_callable(policy, what="policy")
    if callable(policy):
        return policy
    raise ValueError(
        f"policy: expected 'random', 'module:callable', a callable or a model, received {policy!r}"
    )


class _ModelPolicy:
    """A model as a :data:`RecordingPolicy`: its actions, a recurrent model's state carried from step
    to step and zeroed by :meth:`end_episodes` (:class:`~oakemu_core.policy.episodic.EpisodicActor`)."""

    def __init__(self, model: Any, *, greedy: bool) -> None:
        self.actor = EpisodicActor(model)
        self.greedy = greedy

    def __call__(self, observations: Any, action_mask: np.ndarray | None) -> np.ndarray:
        return self.actor.act(observations, action_mask=action_mask, greedy=self.greedy).actions

    def end_episodes(self, dones: np.ndarray) -> None:
        self.actor.reset(dones)


def _dataset_id_for(path: Path) -> str:
    name = (
        "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in path.name) or "demonstrations"
    )
    return name if _has_version(name) else f"{name}-v0"


def _has_version(name: str) -> bool:
    head, sep, version = name.rpartition("-v")
    return bool(sep and head and version.isdigit())


def record_dataset(
    env_id: str,
    output: str | os.PathLike[str],
    *,
    episodes: int,
    policy: Any = "random",
    seed: int | None = 1,
    num_envs: int = 1,
    max_episode_steps: int | None = None,
    settings_file: str | None = None,
    options: EnvOptions | None = None,
    greedy: bool = True,
    algorithm_name: str | None = None,
    overwrite: bool = False,
) -> RecordingSummary:
    """Play ``episodes`` whole episodes of ``env_id`` with ``policy`` and write them as a Minari dataset.

    Observations are stored as the policy sees them (see the module docstring): per episode
    ``T + 1`` observations (the last one the true final observation), ``T`` actions, raw
    rewards, terminations and truncations. Only complete episodes are written; with
    ``num_envs`` > 1 the first ``episodes`` to finish are kept.

    Args:
        env_id: any id :func:`~oakemu_core.envs.make_vector_env` accepts.
        output: the dataset folder to create (must not exist unless ``overwrite``); written in a
            temporary folder next to it and renamed when complete.
        episodes: episodes to record (>= 1).
        policy: see :func:`make_recording_policy`.
        seed: env seed (env ``i`` gets ``seed + i``) and random-policy seed.
        num_envs: envs played together.
        max_episode_steps: time limit replacing the env's own (None keeps it).
        settings_file: emulator settings file (``gameboy:`` / ``retro:`` ids).
        options: ``gymnasium.make`` keyword arguments and Atari preprocessing (None: the defaults).
        greedy: a model policy acts greedily (default) or samples.
        algorithm_name: Minari ``algorithm_name`` metadata (default: describes ``policy``).
        overwrite: replace an existing ``output`` folder.

    Returns :class:`RecordingSummary`. Raises:
        MinariNotInstalledError: minari / h5py missing.
        DemonstrationDataError: ``output`` exists (without ``overwrite``).
        ValueError: ``episodes`` or ``num_envs`` < 1, a policy returning malformed actions.
        oakemu_core.envs.UnsupportedEnvironmentError: unknown env id or unsupported spaces.
    """
    minari = import_minari()
    output = _checked_output(output, episodes=episodes, num_envs=num_envs, overwrite=overwrite)
    env = make_vector_env(
        env_id,
        int(num_envs),
        seed=seed,
        clip_rewards=False,
        max_episode_steps=max_episode_steps,
        settings_file=settings_file,
        options=options,
    )
    try:
        spec = env.spec
        act = make_recording_policy(policy, spec, seed=seed, greedy=greedy)
        source = f"policy {policy if isinstance(policy, str) else type(policy).__name__}"
        buffers, returns = _play_episodes(env, act, int(episodes), source)
    finally:
        env.close()
    metadata, description = _dataset_notes(env_id, spec, returns, source)
    dataset_id = _dataset_id_for(output)
    _write_dataset(
        minari,
        output,
        dataset_id,
        buffers,
        spec,
        metadata,
        algorithm_name=algorithm_name or f"oakemu record ({source})",
        description=description,
    )
    lengths = [len(buffer.rewards) for buffer in buffers]
    return RecordingSummary(output, dataset_id, len(buffers), int(sum(lengths)), returns, lengths)


def _dataset_notes(
    env_id: str, spec: EnvSpec, returns: list[float], source: str
) -> tuple[dict[str, str], str]:
    """The dataset's OakEmu metadata (env id, spec, episode returns; JSON strings) and its
    description, for episodes of ``env_id`` played by ``source``."""
    metadata = {
        "oakemu_env_id": env_id,
        "oakemu_spec": json.dumps(spec.to_dict()),
        "oakemu_returns": json.dumps(returns),
    }
    description = (
        f"{len(returns)} episodes of {env_id} recorded by `oakemu record` with {source}; "
        "observations as OakEmu-RL's networks see them (see oakemu_core/algo/demonstrations.py)"
    )
    return metadata, description


def _checked_output(
    output: str | os.PathLike[str], *, episodes: int, num_envs: int, overwrite: bool
) -> Path:
    """``output`` as an absolute path (minari's storage mis-joins relative ones), after checking
    :func:`record_dataset`'s arguments. Raises ValueError (``episodes`` or ``num_envs`` < 1) or
    DemonstrationDataError (``output`` exists without ``overwrite``)."""
    if int(episodes) < 1:
        raise ValueError(f"episodes: expected >= 1, received {episodes!r}")
    if int(num_envs) < 1:
        raise ValueError(f"num_envs: expected >= 1, received {num_envs!r}")
    output = Path(output).absolute()
    if output.exists() and not overwrite:
        raise DemonstrationDataError(
            f"{output}: already exists; choose another --output or remove it"
        )
    return output


class _Episode:
    """The steps of one env's running episode, as lists (observations by layout key)."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self.observations: dict[str, list[np.ndarray]] = {key: [] for key in spec.observation_keys}
        self.actions: list[np.ndarray] = []
        self.rewards: list[float] = []
        self.terminated: list[bool] = []
        self.truncated: list[bool] = []
        self.masks: list[np.ndarray] = []

    def add_observation(self, observations: Any, row: int) -> None:
        """Append env ``row``'s observation of the vector env's ``observations``."""
        if self.spec.is_dict_observation:
            for key in self.observations:
                self.observations[key].append(np.array(observations[key][row]))
        else:
            self.observations[PLAIN_KEY].append(np.array(observations[row]))

    def episode_buffer(self, episode_id: int) -> Any:
        """The Minari ``EpisodeBuffer`` of the finished episode (its final observation added)."""
        from minari.data_collector import EpisodeBuffer

        spec = self.spec
        stacked = {key: np.stack(values) for key, values in self.observations.items()}
        infos: dict[str, Any] = {}
        if spec.has_action_masks:
            final_mask = np.ones((1, spec.action_mask_width), dtype=bool)
            infos["action_mask"] = np.concatenate([np.stack(self.masks), final_mask])
        return EpisodeBuffer(
            id=episode_id,
            observations=stacked[PLAIN_KEY] if not spec.is_dict_observation else stacked,
            actions=np.stack(self.actions).astype(spec.action_dtype, copy=False),
            rewards=self.rewards,
            terminations=self.terminated,
            truncations=self.truncated,
            infos=infos or None,
        )


def _play_episodes(
    env: Any, act: RecordingPolicy, episodes: int, source: str
) -> tuple[list[Any], list[float]]:
    """``(Minari episode buffers, raw episodic returns)`` of the first ``episodes`` episodes that
    finish in the vector env ``env`` acting with ``act``.

    Raises:
        ValueError: ``act`` returned malformed actions (:func:`~oakemu_core.actor.routing.checked_actions`).
    """
    spec, n = env.spec, env.num_envs
    running = [_Episode(spec) for _ in range(n)]
    buffers: list[Any] = []
    returns: list[float] = []
    end_episodes = getattr(act, "end_episodes", None)
    observations = env.reset()
    masks = env.action_masks()
    while len(buffers) < episodes:
        actions = checked_actions(spec, act(observations, masks), n, source=source)
        forced = (
            env.forced_actions()
        )  # rows the env plays its own action on (Atari: FIRE after a lost life)
        if forced is not None:
            actions = actions.copy()
            actions[forced[0]] = forced[1]
        step = env.step(actions)
        if end_episodes is not None:
            end_episodes(step.dones)
        for row, episode in enumerate(running):
            episode.add_observation(observations, row)
            episode.actions.append(np.array(actions[row]))
            episode.rewards.append(float(step.training_rewards[row]))  # raw: clip_rewards=False
            episode.terminated.append(bool(step.terminated[row]))
            episode.truncated.append(bool(step.truncated[row]))
            if spec.has_action_masks:
                episode.masks.append(np.array(masks[row], dtype=bool))
        for row, episode_return in zip(step.episode_env_ids, step.episode_returns, strict=True):
            episode, running[row] = running[row], _Episode(spec)
            if len(buffers) >= episodes:
                continue
            episode.add_observation(step.final_observations, row)
            buffers.append(episode.episode_buffer(len(buffers)))
            returns.append(float(episode_return))
        observations, masks = step.observations, step.action_masks
    return buffers, returns


def _write_dataset(
    minari: Any,
    output: Path,
    dataset_id: str,
    buffers: list[Any],
    spec: EnvSpec,
    metadata: dict[str, str],
    *,
    algorithm_name: str,
    description: str,
) -> None:
    """Write ``buffers`` as the Minari dataset ``dataset_id`` in a temporary folder next to
    ``output``, add ``metadata``, then move it to ``output`` (replacing an existing folder)."""
    observation_space, action_space = dataset_spaces(spec)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        kwargs: dict[str, Any] = {}
        if "jpeg_encoding" in inspect.signature(minari.create_dataset_from_buffers).parameters:
            kwargs["jpeg_encoding"] = False  # frames are stored losslessly
        with _MINARI_ENV_LOCK, warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # missing code_permalink / author_email / eval_env notes
            previous = os.environ.get("MINARI_DATASETS_PATH")
            os.environ["MINARI_DATASETS_PATH"] = str(staging)
            try:
                dataset = minari.create_dataset_from_buffers(
                    dataset_id,
                    buffers,
                    env=None,
                    observation_space=observation_space,
                    action_space=action_space,
                    algorithm_name=algorithm_name,
                    author="oakemu record",
                    description=description,
                    data_format="hdf5",
                    **kwargs,
                )
            finally:
                if previous is None:
                    os.environ.pop("MINARI_DATASETS_PATH", None)
                else:
                    os.environ["MINARI_DATASETS_PATH"] = previous
            dataset.storage.update_metadata(metadata)
        if output.exists():  # overwrite
            shutil.rmtree(output)
        os.replace(staging / dataset_id, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
