"""Demonstrations for behaviour cloning, stored as Farama Minari datasets: their format and loading.

A dataset written by :func:`~oakemu_core.algo.recording.record_dataset` (``oakemu record``) holds
whole episodes **as the policy sees them**: preprocessed Atari frames ``(4, 84, 84)`` uint8, one-hot
discrete observations (Taxi: ``(500,)`` float32), dict observations flattened to ``"a.b"`` keys,
float64 boxes as float32, and actions in the normalised action space of
:class:`~oakemu_core.envs.EnvSpec` (start 0), with explicit spaces made from
``EnvSpec.observation_layout`` / ``EnvSpec.action_space`` (:func:`dataset_spaces`). Action masks,
where the env has them, are in ``infos["action_mask"]``.

A dataset folder (``--output PATH``) is a Minari dataset directory: ``PATH/data/`` holds
``metadata.json`` and ``main_data.hdf5``. Load it with ``minari.MinariDataset("PATH/data")``, or
with ``minari.load_dataset(ID)`` after moving it to ``$MINARI_DATASETS_PATH/ID``.

Training side: :class:`DemonstrationSampler` (alias ``BCSampler``, the seed's name) loads a local
dataset into memory, refuses one whose spaces differ from the run's (:class:`DemonstrationMismatchError`),
and serves :class:`DemonstrationBatch` es; :mod:`oakemu_core.algo.behaviour_cloning` trains on them.

Needs the optional ``minari`` package (``pip install 'oakemu-rl[bc]'``); importing this module
works without it, the functions that touch datasets raise :class:`MinariNotInstalledError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oakemu_core.envs.spec import PLAIN_KEY, EnvSpec
from oakemu_core.errors import UserError

__all__ = [
    "BCSampler",
    "DemonstrationBatch",
    "DemonstrationDataError",
    "DemonstrationMismatchError",
    "DemonstrationSampler",
    "MinariNotInstalledError",
    "batch_to_device",
    "dataset_spaces",
    "import_minari",
]


class MinariNotInstalledError(UserError, ImportError):
    """The optional ``minari`` package (with h5py) is missing: ``pip install 'oakemu-rl[bc]'``."""


class DemonstrationDataError(UserError, ValueError):
    """A demonstration dataset cannot be used: missing folder, not a Minari dataset, no steps,
    or an output folder that already exists (the message names the path)."""


class DemonstrationMismatchError(UserError, ValueError):
    """The dataset's observation or action space differs from the run's; the message names both."""


def import_minari() -> Any:
    """The ``minari`` module (with h5py, its hdf5 storage).

    Raises:
        MinariNotInstalledError: either is missing (the message says what to install).
    """
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
        observation_space = gymnasium.spaces.Dict(
            {key: _box_for(shape, dtype) for key, (shape, dtype) in layout.items()}
        )
    return observation_space, spec.action_space


def _layout_of_space(
    space: Any, prefix: str = ""
) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
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
        return {
            prefix[:-1] if prefix else PLAIN_KEY: (
                tuple(int(d) for d in space.shape),
                np.dtype(space.dtype),
            )
        }
    return None


def _describe_layout(
    layout: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None, space: Any = None
) -> str:
    if layout is None:
        return repr(space)
    return (
        "{"
        + ", ".join(
            f"{key!r}: {shape} {np.dtype(dtype).name}"
            for key, (shape, dtype) in sorted(layout.items())
        )
        + "}"
    )


def _same_action_space(expected: Any, received: Any) -> bool:
    import gymnasium

    if type(expected) is not type(received):
        return False
    if isinstance(expected, gymnasium.spaces.Box):
        return (
            expected.shape == received.shape
            and np.dtype(expected.dtype) == np.dtype(received.dtype)
            and np.array_equal(expected.low, received.low)
            and np.array_equal(expected.high, received.high)
        )
    return bool(expected == received)


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
    observations = (
        {key: tensor(value) for key, value in observations.items()}
        if isinstance(observations, dict)
        else tensor(observations)
    )
    mask = None if batch.action_mask is None else tensor(batch.action_mask)
    return DemonstrationBatch(observations, tensor(batch.actions), mask)


def _resolve_data_path(path: Path) -> Path:
    """The Minari data directory of a dataset folder (``PATH/data``) or of ``PATH`` itself."""
    if (path / "data" / "metadata.json").is_file():
        return path / "data"
    if (path / "metadata.json").is_file():
        return path
    if not path.exists():
        raise DemonstrationDataError(
            f"{path}: no such demonstration dataset (record one with `oakemu record`)"
        )
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

    def __init__(
        self, path: str | os.PathLike[str], spec: EnvSpec, *, seed: int | None = 0
    ) -> None:
        minari = import_minari()
        self.path = Path(path)
        self.spec = spec
        data_path = _resolve_data_path(self.path)
        try:
            dataset = minari.MinariDataset(data_path)
        except Exception as error:  # a corrupt folder: one clear message
            raise DemonstrationDataError(
                f"{self.path}: cannot read the Minari dataset ({type(error).__name__}: {error})"
            ) from error
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
            episode_obs = (
                episode.observations
                if isinstance(episode.observations, dict)
                else {PLAIN_KEY: episode.observations}
            )
            flat = _flatten(episode_obs)
            for key, (_shape, dtype) in layout.items():
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
            raise DemonstrationMismatchError(
                f"{self.path}: actions of dtype {action_array.dtype}, the run's "
                f"{spec.env_id} expects {spec.action_dtype}"
            )
        self._actions = action_array.astype(spec.action_dtype, copy=False).reshape(
            -1, *spec.action_shape
        )
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
        same_observations = (
            received_layout is not None
            and {key: (shape, np.dtype(dtype)) for key, (shape, dtype) in received_layout.items()}
            == expected_layout
        )
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

    def replay_rollout(
        self, rows: int, rng: np.random.Generator | None = None
    ) -> DemonstrationBatch:
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
            take = self._order[self._cursor : self._cursor + needed]
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
