"""Demonstrations for behaviour cloning, stored as Farama Minari datasets.

Recording (:func:`record_dataset`, ``oakemu record``) plays whole episodes through the same
:class:`~oakemu_core.envs.VectorEnv` the actors use and stores them **as the policy sees them**:
preprocessed Atari frames ``(4, 84, 84)`` uint8, one-hot discrete observations (Taxi: ``(500,)``
float32), dict observations flattened to ``"a.b"`` keys, float64 boxes as float32, and actions in
the normalised action space of :class:`~oakemu_core.envs.EnvSpec` (start 0). The approach: each
finished episode becomes a Minari ``EpisodeBuffer`` built from the vector-env steps, and
``minari.create_dataset_from_buffers`` writes the dataset with explicit spaces made from
``EnvSpec.observation_layout`` / ``EnvSpec.action_space`` (:func:`dataset_spaces`). Minari's own
``DataCollector`` would wrap a raw Gymnasium env and store the raw observations, which the
networks never see (and Atari's preprocessing lives in ale-py's vector env, not in wrappers).
Consequences: the dataset has no Minari ``env_spec`` (``recover_environment()`` cannot rebuild the
preprocessing); the env id and the full spec are in the metadata (``oakemu_env_id``,
``oakemu_spec``). Rewards are the raw (unclipped) game rewards. Frames are stored losslessly
(no JPEG encoding). Action masks, where the env has them, are in ``infos["action_mask"]``
(``(T + 1, width)`` bool; the last row, the final observation's mask, is all True).

A dataset folder (``--output PATH``) is a Minari dataset directory: ``PATH/data/`` holds
``metadata.json`` and ``main_data.hdf5``. Load it with ``minari.MinariDataset("PATH/data")``, or
with ``minari.load_dataset(ID)`` after moving it to ``$MINARI_DATASETS_PATH/ID``.

Training side: :class:`DemonstrationSampler` (alias ``BCSampler``, the seed's name) loads a local
dataset into memory, refuses one whose spaces differ from the run's (:class:`DemonstrationMismatchError`),
and serves :class:`DemonstrationBatch` es; :func:`bc_loss` is the negative log-likelihood of the
demonstrated actions under a :class:`~oakemu_core.policy.distributions.Policy`;
:func:`behaviour_cloning_update` is one replay-only rollout of pre-training (one epoch, as the seed
says: "replay-only BC rollouts use a single epoch so the replay bootstrap phase is not multiplied
by the PPO epoch count").

Needs the optional ``minari`` package (``pip install 'oakemu-rl[bc]'``); importing this module
works without it, the functions that touch datasets raise :class:`MinariNotInstalledError`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from oakemu_core.actor.routing import checked_actions, load_callable, random_actions
from oakemu_core.envs.factory import make_vector_env
from oakemu_core.envs.spec import PLAIN_KEY, EnvSpec
from oakemu_core.errors import UserError

__all__ = [
    "BCSampler",
    "DemonstrationBatch",
    "DemonstrationDataError",
    "DemonstrationMismatchError",
    "DemonstrationSampler",
    "MinariNotInstalledError",
    "RecordingSummary",
    "batch_to_device",
    "bc_loss",
    "behaviour_cloning_update",
    "dataset_spaces",
    "make_recording_policy",
    "record_dataset",
]

RecordingPolicy = Callable[[Any, np.ndarray | None], Any]
"""``(observations of all n envs, action masks (n, width) or None) -> actions (n, *action_shape)``."""

_MINARI_ENV_LOCK = threading.Lock()  # MINARI_DATASETS_PATH is process-global while a dataset is written


class MinariNotInstalledError(UserError, ImportError):
    """The optional ``minari`` package (with h5py) is missing: ``pip install 'oakemu-rl[bc]'``."""


class DemonstrationDataError(UserError, ValueError):
    """A demonstration dataset cannot be used: missing folder, not a Minari dataset, no steps,
    or an output folder that already exists (the message names the path)."""


class DemonstrationMismatchError(UserError, ValueError):
    """The dataset's observation or action space differs from the run's; the message names both."""


def _minari() -> Any:
    try:
        import h5py  # noqa: F401 - minari's hdf5 storage
        import minari
    except ImportError as error:
        raise MinariNotInstalledError(
            f"behaviour cloning needs the optional Minari package with h5py ({error}): "
            "pip install 'oakemu-rl[bc]' (or: pip install 'minari[hdf5]>=0.5.4,<0.6')"
        ) from None
    return minari


# ---------------------------------------------------------------------------------------------
# Spaces
# ---------------------------------------------------------------------------------------------
def _box_for(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    import gymnasium

    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return gymnasium.spaces.Box(int(info.min), int(info.max), shape, dtype)
    if dtype == np.bool_:
        return gymnasium.spaces.Box(0, 1, shape, dtype)
    return gymnasium.spaces.Box(-np.inf, np.inf, shape, dtype)


def dataset_spaces(spec: EnvSpec) -> tuple[Any, Any]:
    """The Minari ``(observation_space, action_space)`` of demonstrations for ``spec``.

    Observations: ``Box(shape, dtype)`` of the plain layout entry (uint8 frames ``Box(0, 255)``,
    floats unbounded), or a flat ``Dict`` of such boxes keyed by the layout's keys (``"a.b"``).
    Actions: ``spec.action_space`` (normalised, start 0).
    """
    import gymnasium

    layout = spec.observation_layout
    if PLAIN_KEY in layout:
        shape, dtype = layout[PLAIN_KEY]
        observation_space: Any = _box_for(shape, dtype)
    else:
        observation_space = gymnasium.spaces.Dict({key: _box_for(shape, dtype) for key, (shape, dtype) in layout.items()})
    return observation_space, spec.action_space


def _layout_of_space(space: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
    """``{key: (shape, dtype)}`` of a dataset's observation space (nested dicts flattened with
    ``"."``), or None for spaces that are not Box / Dict-of-Box (e.g. Discrete: not one-hot)."""
    import gymnasium

    if isinstance(space, gymnasium.spaces.Dict):
        layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for key, sub in space.spaces.items():
            child = _layout_of_space(sub, f"{prefix}{key}.")
            if child is None:
                return None
            layout.update(child)
        return layout
    if isinstance(space, gymnasium.spaces.Box):
        return {prefix[:-1] if prefix else PLAIN_KEY: (tuple(int(d) for d in space.shape), np.dtype(space.dtype))}
    return None


def _describe_layout(layout: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None, space: Any = None) -> str:
    if layout is None:
        return repr(space)
    return "{" + ", ".join(f"{key!r}: {shape} {np.dtype(dtype).name}" for key, (shape, dtype) in sorted(layout.items())) + "}"


def _same_action_space(expected: Any, received: Any) -> bool:
    import gymnasium

    if type(expected) is not type(received):
        return False
    if isinstance(expected, gymnasium.spaces.Box):
        return (expected.shape == received.shape and np.dtype(expected.dtype) == np.dtype(received.dtype)
                and np.array_equal(expected.low, received.low) and np.array_equal(expected.high, received.high))
    return bool(expected == received)


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------
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


def make_recording_policy(policy: Any, spec: EnvSpec, *, seed: int | None = None, greedy: bool = True) -> RecordingPolicy:
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
        model = policy

        def model_policy(observations: Any, action_mask: np.ndarray | None) -> np.ndarray:
            return model.act(observations, action_mask=action_mask, greedy=greedy).actions

        return model_policy
    if isinstance(policy, str):
        if policy == "random":
            rng = np.random.default_rng(seed)

            def random_policy(observations: Any, action_mask: np.ndarray | None) -> np.ndarray:
                count = len(next(iter(observations.values()))) if isinstance(observations, dict) else len(observations)
                return random_actions(spec, count, rng, action_mask)

            return random_policy
        if ":" not in policy:
            raise ValueError(f"policy: expected 'random' or 'module:callable', received {policy!r}")
        return load_callable(policy, what="policy")
    if callable(policy):
        return policy
    raise ValueError(f"policy: expected 'random', 'module:callable', a callable or a model, received {policy!r}")


def _dataset_id_for(path: Path) -> str:
    name = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in path.name) or "demonstrations"
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
        greedy: a model policy acts greedily (default) or samples.
        algorithm_name: Minari ``algorithm_name`` metadata (default: describes ``policy``).
        overwrite: replace an existing ``output`` folder.

    Returns:
        :class:`RecordingSummary`.

    Raises:
        MinariNotInstalledError: minari / h5py missing.
        DemonstrationDataError: ``output`` exists (without ``overwrite``).
        ValueError: ``episodes`` or ``num_envs`` < 1, a policy returning malformed actions.
        oakemu_core.envs.UnsupportedEnvironmentError: unknown env id or unsupported spaces.
    """
    minari = _minari()
    if int(episodes) < 1:
        raise ValueError(f"episodes: expected >= 1, received {episodes!r}")
    if int(num_envs) < 1:
        raise ValueError(f"num_envs: expected >= 1, received {num_envs!r}")
    output = Path(output).absolute()  # minari's storage mis-joins relative paths
    if output.exists() and not overwrite:
        raise DemonstrationDataError(f"{output}: already exists; choose another --output or remove it")
    from minari.data_collector import EpisodeBuffer

    env = make_vector_env(env_id, int(num_envs), seed=seed, clip_rewards=False,
                          max_episode_steps=max_episode_steps, settings_file=settings_file)
    try:
        spec = env.spec
        act = make_recording_policy(policy, spec, seed=seed, greedy=greedy)
        source = f"policy {policy if isinstance(policy, str) else type(policy).__name__}"
        n = env.num_envs
        keys = spec.observation_keys
        masked = spec.has_action_masks

        def fresh() -> dict[str, Any]:
            return {"obs": {key: [] for key in keys}, "actions": [], "rewards": [], "terminated": [],
                    "truncated": [], "masks": []}

        def rows_of(observations: Any, row: int) -> dict[str, np.ndarray]:
            if spec.is_dict_observation:
                return {key: np.array(observations[key][row]) for key in keys}
            return {PLAIN_KEY: np.array(observations[row])}

        running = [fresh() for _ in range(n)]
        buffers: list[Any] = []
        returns: list[float] = []
        observations = env.reset()
        masks = env.action_masks()
        while len(buffers) < episodes:
            actions = checked_actions(spec, act(observations, masks), n, source=source)
            step = env.step(actions)
            for row in range(n):
                episode = running[row]
                for key, value in rows_of(observations, row).items():
                    episode["obs"][key].append(value)
                episode["actions"].append(np.array(actions[row]))
                episode["rewards"].append(float(step.training_rewards[row]))  # raw: clip_rewards=False
                episode["terminated"].append(bool(step.terminated[row]))
                episode["truncated"].append(bool(step.truncated[row]))
                if masked:
                    episode["masks"].append(np.array(masks[row], dtype=bool))
            for row, episode_return in zip(step.episode_env_ids, step.episode_returns, strict=True):
                episode = running[row]
                running[row] = fresh()
                if len(buffers) >= episodes:
                    continue
                for key, value in rows_of(step.final_observations, row).items():
                    episode["obs"][key].append(value)
                stacked = {key: np.stack(values) for key, values in episode["obs"].items()}
                infos: dict[str, Any] = {}
                if masked:
                    final_mask = np.ones((1, spec.action_mask_width), dtype=bool)
                    infos["action_mask"] = np.concatenate([np.stack(episode["masks"]), final_mask])
                buffers.append(EpisodeBuffer(
                    id=len(buffers),
                    observations=stacked[PLAIN_KEY] if not spec.is_dict_observation else stacked,
                    actions=np.stack(episode["actions"]).astype(spec.action_dtype, copy=False),
                    rewards=episode["rewards"],
                    terminations=episode["terminated"],
                    truncations=episode["truncated"],
                    infos=infos or None,
                ))
                returns.append(float(episode_return))
            observations, masks = step.observations, step.action_masks
    finally:
        env.close()

    lengths = [len(buffer.rewards) for buffer in buffers]
    dataset_id = _dataset_id_for(output)
    observation_space, action_space = dataset_spaces(spec)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        kwargs: dict[str, Any] = {}
        import inspect

        if "jpeg_encoding" in inspect.signature(minari.create_dataset_from_buffers).parameters:
            kwargs["jpeg_encoding"] = False  # frames are stored losslessly
        with _MINARI_ENV_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # missing code_permalink / author_email / eval_env notes
            previous = os.environ.get("MINARI_DATASETS_PATH")
            os.environ["MINARI_DATASETS_PATH"] = str(staging)
            try:
                dataset = minari.create_dataset_from_buffers(
                    dataset_id,
                    buffers,
                    env=None,
                    observation_space=observation_space,
                    action_space=action_space,
                    algorithm_name=algorithm_name or f"oakemu record ({source})",
                    author="oakemu record",
                    description=f"{len(buffers)} episodes of {env_id} recorded by `oakemu record` with {source}; "
                    "observations as OakEmu-RL's networks see them (see oakemu_core/algo/demonstrations.py)",
                    data_format="hdf5",
                    **kwargs,
                )
            finally:
                if previous is None:
                    os.environ.pop("MINARI_DATASETS_PATH", None)
                else:
                    os.environ["MINARI_DATASETS_PATH"] = previous
            dataset.storage.update_metadata({
                "oakemu_env_id": env_id,
                "oakemu_spec": json.dumps(spec.to_dict()),
                "oakemu_returns": json.dumps(returns),
            })
        if output.exists():  # overwrite
            shutil.rmtree(output)
        os.replace(staging / dataset_id, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return RecordingSummary(output, dataset_id, len(buffers), int(sum(lengths)), returns, lengths)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------
@dataclass
class DemonstrationBatch:
    """``B`` demonstration rows.

    Attributes:
        observations: ``(B, *shape)`` array, or a dict key -> array, with exactly the dtypes of the
            run's ``observation_layout`` (uint8 frames stay uint8); torch tensors after
            :func:`batch_to_device`.
        actions: ``(B, *action_shape)`` of the distribution's action dtype (int64 Discrete /
            MultiDiscrete, int8 MultiBinary, float32 Box).
        action_mask: ``(B, mask width)`` bool, or None when the run or the dataset has no masks.
    """

    observations: Any
    actions: Any
    action_mask: Any = None

    def __len__(self) -> int:
        return int(self.actions.shape[0])


def batch_to_device(batch: DemonstrationBatch, device: torch.device | str) -> DemonstrationBatch:
    """The same batch as torch tensors on ``device`` (dtypes kept: uint8 frames stay uint8)."""

    def tensor(array: Any) -> torch.Tensor:
        if isinstance(array, torch.Tensor):
            return array.to(device)
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    observations = batch.observations
    observations = {key: tensor(value) for key, value in observations.items()} if isinstance(observations, dict) \
        else tensor(observations)
    mask = None if batch.action_mask is None else tensor(batch.action_mask)
    return DemonstrationBatch(observations, tensor(batch.actions), mask)


def _resolve_data_path(path: Path) -> Path:
    """The Minari data directory of a dataset folder (``PATH/data``) or of ``PATH`` itself."""
    if (path / "data" / "metadata.json").is_file():
        return path / "data"
    if (path / "metadata.json").is_file():
        return path
    if not path.exists():
        raise DemonstrationDataError(f"{path}: no such demonstration dataset (record one with `oakemu record`)")
    raise DemonstrationDataError(
        f"{path}: not a Minari dataset folder (expected {path / 'data' / 'metadata.json'})"
    )


class DemonstrationSampler:
    """Demonstrations of a local Minari dataset, checked against the run's spaces, in memory.

    The seed's ``BCSampler`` (exported under that name too). All ``T`` acting steps of every
    episode become rows (the final observation of an episode has no action and is left out).

    Args:
        path: the dataset folder written by :func:`record_dataset` (or its ``data`` directory, or
            any local Minari dataset directory).
        spec: the run's env spec; the dataset's observation layout (keys, shapes, dtypes) and
            action space must equal ``spec.observation_layout`` and ``spec.action_space``.
        seed: seed of the generator used by :meth:`replay_rollout` when none is given.

    Attributes:
        num_steps: demonstration rows. num_episodes: episodes in the dataset.
        env_id: the env id the dataset was recorded on (metadata), or None.

    Raises:
        MinariNotInstalledError: minari / h5py missing.
        DemonstrationDataError: missing folder, not a Minari dataset, or no steps.
        DemonstrationMismatchError: observation or action spaces differ (names both).
    """

    def __init__(self, path: str | os.PathLike[str], spec: EnvSpec, *, seed: int | None = 0) -> None:
        minari = _minari()
        self.path = Path(path)
        self.spec = spec
        data_path = _resolve_data_path(self.path)
        try:
            dataset = minari.MinariDataset(data_path)
        except Exception as error:  # a corrupt folder: one clear message
            raise DemonstrationDataError(f"{self.path}: cannot read the Minari dataset ({type(error).__name__}: {error})") from error
        metadata = dataset.storage.metadata
        self.env_id: str | None = metadata.get("oakemu_env_id")
        self._check_spaces(dataset)
        layout = spec.observation_layout
        observations: dict[str, list[np.ndarray]] = {key: [] for key in layout}
        actions: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        use_masks = spec.has_action_masks
        for episode in dataset.iterate_episodes():
            steps = len(episode.rewards)
            if steps == 0:
                continue
            episode_obs = episode.observations if isinstance(episode.observations, dict) \
                else {PLAIN_KEY: episode.observations}
            flat = _flatten(episode_obs)
            for key, (shape, dtype) in layout.items():
                observations[key].append(np.asarray(flat[key][:steps]).astype(dtype, copy=False))
            actions.append(np.asarray(episode.actions)[:steps])
            mask = (episode.infos or {}).get("action_mask")
            if use_masks and mask is not None:
                masks.append(np.asarray(mask, dtype=bool)[:steps])
            else:
                use_masks = False
        if not actions:
            raise DemonstrationDataError(f"{self.path}: the dataset holds no steps")
        self._observations = {key: np.concatenate(values) for key, values in observations.items()}
        action_array = np.concatenate(actions)
        if spec.action_dtype.kind in "iu" and action_array.dtype.kind not in "iub":
            raise DemonstrationMismatchError(f"{self.path}: actions of dtype {action_array.dtype}, the run's "
                                             f"{spec.env_id} expects {spec.action_dtype}")
        self._actions = action_array.astype(spec.action_dtype, copy=False).reshape(-1, *spec.action_shape)
        self._masks = np.concatenate(masks) if use_masks and masks else None
        self.num_steps = int(self._actions.shape[0])
        self.num_episodes = int(dataset.total_episodes)
        self._rng = np.random.default_rng(seed)
        self._order = np.empty(0, np.int64)
        self._cursor = 0

    def _check_spaces(self, dataset: Any) -> None:
        spec = self.spec
        received_layout = _layout_of_space(dataset.observation_space)
        expected_layout = spec.observation_layout
        same_observations = received_layout is not None and {
            key: (shape, np.dtype(dtype)) for key, (shape, dtype) in received_layout.items()
        } == expected_layout
        same_actions = _same_action_space(spec.action_space, dataset.action_space)
        if same_observations and same_actions:
            return
        recorded_on = f" (recorded on {self.env_id})" if self.env_id else ""
        raise DemonstrationMismatchError(
            f"demonstrations {self.path}{recorded_on} do not fit this run's {spec.env_id}: the dataset has "
            f"observations {_describe_layout(received_layout, dataset.observation_space)} and actions "
            f"{dataset.action_space}; the run expects observations {_describe_layout(expected_layout)} and actions "
            f"{spec.action_space}. Record demonstrations for this env: oakemu record --env {spec.env_id} ..."
        )

    def __len__(self) -> int:
        return self.num_steps

    def _rows(self, indices: np.ndarray) -> DemonstrationBatch:
        if self.spec.is_dict_observation:
            observations: Any = {key: values[indices] for key, values in self._observations.items()}
        else:
            observations = self._observations[PLAIN_KEY][indices]
        mask = None if self._masks is None else self._masks[indices]
        return DemonstrationBatch(observations, self._actions[indices], mask)

    def sample(self, batch_size: int, rng: np.random.Generator | None = None) -> DemonstrationBatch:
        """``batch_size`` rows drawn uniformly with replacement (numpy arrays, see
        :class:`DemonstrationBatch`). ``rng`` defaults to the sampler's own generator.

        Raises:
            ValueError: ``batch_size`` < 1.
        """
        if int(batch_size) < 1:
            raise ValueError(f"batch_size: expected >= 1, received {batch_size!r}")
        rng = self._rng if rng is None else rng
        return self._rows(rng.integers(0, self.num_steps, int(batch_size)))

    def replay_rollout(self, rows: int, rng: np.random.Generator | None = None) -> DemonstrationBatch:
        """A replay-only rollout of ``rows`` rows: the next rows of a shuffled pass over the whole
        dataset (reshuffled when a pass ends), so every demonstration is seen once per pass.

        Raises:
            ValueError: ``rows`` < 1.
        """
        if int(rows) < 1:
            raise ValueError(f"rows: expected >= 1, received {rows!r}")
        rng = self._rng if rng is None else rng
        picked: list[np.ndarray] = []
        needed = int(rows)
        while needed:
            if self._cursor >= self._order.size:
                self._order = rng.permutation(self.num_steps)
                self._cursor = 0
            take = self._order[self._cursor:self._cursor + needed]
            self._cursor += take.size
            needed -= take.size
            picked.append(take)
        return self._rows(np.concatenate(picked))


BCSampler = DemonstrationSampler
"""The seed-002 name of the learner-side behaviour-cloning data source."""


def _flatten(observations: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in observations.items():
        name = f"{prefix}{key}" if prefix or key != PLAIN_KEY else PLAIN_KEY
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


# ---------------------------------------------------------------------------------------------
# Loss and update
# ---------------------------------------------------------------------------------------------
def bc_loss(policy: Any, actions: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the demonstrated ``actions`` under ``policy``.

    Args:
        policy: an :class:`oakemu_core.policy.distributions.Policy` for ``B`` observations (with gradients).
        actions: ``(B, *action_shape)`` tensor of the distribution's dtype, on the policy's device.

    Returns:
        A scalar float32 tensor, ``-mean(policy.log_prob(actions))``.
    """
    return -policy.log_prob(actions).mean()


def behaviour_cloning_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: DemonstrationSampler,
    *,
    batch_size: int,
    rows: int | None = None,
    epochs: int = 1,
    steps: int | None = None,
    device: torch.device | str = "cpu",
    max_grad_norm: float = 0.5,
    rng: np.random.Generator | None = None,
    update_observation_statistics: bool = True,
) -> dict[str, float]:
    """One behaviour-cloning pre-training update: a replay-only rollout trained for one epoch.

    The rollout is ``sampler.replay_rollout(rows)`` (default: as many rows as the dataset holds,
    i.e. one shuffled pass); it is cut into minibatches of ``batch_size`` rows and each minibatch
    takes one gradient step on :func:`bc_loss` (gradient norm clipped to ``max_grad_norm``; a
    non-finite gradient skips its step). Replay-only rollouts use a single epoch (the seed), so
    ``epochs`` defaults to 1; ``steps`` caps the gradient steps.

    Args:
        model: an :class:`~oakemu_core.policy.models.ActorCritic` on ``device``
            (``policy_and_values(observations, action_mask) -> (Policy, values)``).
        optimizer: optimizer over ``model``'s parameters (the learner's).
        sampler: the demonstrations.
        batch_size: rows per gradient step (>= 1).
        rows: rows of the replay-only rollout (default ``len(sampler)``).
        epochs: passes over the rollout (default 1).
        steps: at most this many gradient steps (None: no cap).
        device: where the update runs.
        max_grad_norm: global gradient-norm clip (> 0).
        rng: generator for the minibatch shuffle and the replay order (default: the sampler's).
        update_observation_statistics: merge the rollout's observations into the model's running
            observation statistics first (no-op without observation normalisation).

    Returns:
        ``{"bc_loss": mean loss, "bc_accuracy": share of rows whose greedy action equals the
        demonstrated one (NaN for continuous actions), "bc_steps": gradient steps, "bc_rows": rows,
        "bc_nonfinite_steps": skipped steps, "bc_seconds": wall time}`` (floats).

    Raises:
        ValueError: ``batch_size``, ``epochs`` or ``rows`` < 1, ``max_grad_norm`` <= 0.
    """
    start = time.perf_counter()
    if int(batch_size) < 1 or int(epochs) < 1 or (rows is not None and int(rows) < 1) or not max_grad_norm > 0:
        raise ValueError(
            f"behaviour_cloning_update: expected batch_size >= 1, epochs >= 1, rows >= 1 or None and "
            f"max_grad_norm > 0, received {batch_size!r}, {epochs!r}, {rows!r}, {max_grad_norm!r}"
        )
    rng = sampler._rng if rng is None else rng
    rollout = sampler.replay_rollout(len(sampler) if rows is None else int(rows), rng)
    if update_observation_statistics and hasattr(model, "update_observation_statistics"):
        model.update_observation_statistics(rollout.observations)
    batch = batch_to_device(rollout, device)
    total_rows = len(rollout)
    discrete = sampler.spec.action_kind != "box"
    model.train()
    loss_sum = 0.0
    correct = 0.0
    counted = 0
    done = 0
    skipped = 0
    for _ in range(int(epochs)):
        order = torch.from_numpy(rng.permutation(total_rows)).to(device)
        for begin in range(0, total_rows, int(batch_size)):
            if steps is not None and done >= int(steps):
                break
            index = order[begin:begin + int(batch_size)]
            observations = {key: value[index] for key, value in batch.observations.items()} \
                if isinstance(batch.observations, dict) else batch.observations[index]
            mask = None if batch.action_mask is None else batch.action_mask[index]
            actions = batch.actions[index]
            policy, _ = model.policy_and_values(observations, mask)
            loss = bc_loss(policy, actions)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                skipped += 1
            with torch.no_grad():
                loss_sum += float(loss.item()) * int(index.numel())
                counted += int(index.numel())
                if discrete:
                    same = policy.mode() == actions
                    if same.dim() > 1:
                        same = same.all(dim=-1)
                    correct += float(same.float().sum().item())
            done += 1
    return {
        "bc_loss": loss_sum / counted if counted else math.nan,
        "bc_accuracy": (correct / counted if counted else math.nan) if discrete else math.nan,
        "bc_steps": float(done),
        "bc_rows": float(total_rows),
        "bc_nonfinite_steps": float(skipped),
        "bc_seconds": time.perf_counter() - start,
    }
