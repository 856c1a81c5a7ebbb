"""A trained policy out of a run: :func:`load_policy` and :class:`Policy` (the Python API's way to act).

:func:`load_policy` reads a checkpoint of ``oakemu train`` (a ``.pt`` file, or a run folder: its latest
checkpoint) with torch's ``weights_only`` loader, or a policy folder of ``oakemu export`` (safetensors and
JSON, no pickle), and rebuilds the policy from what it holds (the step schema: observation
fields and action distribution; the observation normaliser's setting), without making the env. What
a path can be is decided in :func:`load_policy` alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from oakemu_core.errors import CheckpointError
from oakemu_core.policy.episodic import EpisodicActor
from oakemu_core.policy.export import is_policy_folder, load_policy_folder, read_policy_info
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.policy.schemas import schema_from_dict
from oakemu_core.policy.weights import load_model_state
from oakemu_core.run.checkpoint import CheckpointNotFoundError, load_run_checkpoint

__all__ = ["Policy", "check_policy_path", "load_policy"]


class Policy:
    """A trained policy on the CPU, in eval mode.

    A recurrent policy (an LSTM or GRU core: :attr:`recurrent`) remembers what it saw: each
    :meth:`act` continues from the state the previous call left, for the same number of envs (one
    observation: one env; a batch of ``B``: ``B`` envs, row ``i`` always the same env). Call
    :meth:`reset` before a new episode (all envs), or ``reset(rows)`` for the envs whose episode
    ended (a vector env's ``terminated | truncated``); :attr:`state` is the state the next call starts
    from. A feed-forward policy keeps nothing: :meth:`reset` does nothing and :attr:`state` is None.

    Attributes:
        env_id: the env it was trained on.
        observation_layout: observation key -> (shape, dtype) of one observation (key ``""`` for a plain
            one): the observations as oakemu's env adapter gives them (Gymnasium ``Box`` observations as
            they are, ``Discrete`` ones one-hot, Atari frames 4 x 84 x 84 uint8, dict keys flattened ``a.b``).
        action_mask_width: width of an action mask (0: the policy takes none).
        source: the checkpoint it was loaded from.
        recurrent: the policy carries a state from one :meth:`act` to the next.
    """

    def __init__(self, model: ActorCritic, env_id: str, source: Path) -> None:
        self.model = model
        self.env_id = env_id
        self.source = source
        self.observation_layout = dict(model.observation_layout)
        self.action_mask_width = int(model.distribution.mask_width or 0)
        self.recurrent = bool(model.recurrent)
        self._actor = EpisodicActor(model)

    @property
    def state(self) -> np.ndarray | None:
        """A recurrent policy's state before the next :meth:`act`, ``(B, state_size)`` float32 (a copy;
        ``B`` = 1 for one observation); None for a feed-forward policy, and after :meth:`reset` (the
        next call starts from zeros)."""
        return None if self._actor.state is None else self._actor.state.copy()

    def reset(self, rows: Any = None) -> None:
        """Start a new episode: every env's (``rows`` None), or those of ``rows`` (``(B,)`` bool such
        as a vector env's ``terminated | truncated``, or row indices), whose state is zeroed.

        Raises:
            IndexError: a row outside the batch of the last :meth:`act`.
        """
        self._actor.reset(rows)

    def act(self, observation: Any, action_mask: Any = None, *, greedy: bool = True) -> np.ndarray:
        """The action for one observation, or actions for a batch.

        Args:
            observation: one observation of :attr:`observation_layout` (an array, or a dict key -> array),
                or a batch of them (a leading axis); converted to the layout's dtype.
            action_mask: bool of width :attr:`action_mask_width` (or ``(B, width)``): True where an action
                may be taken; masked actions are never chosen. None: every action allowed.
            greedy: the distribution's most likely action; False samples (torch's global RNG).

        Returns:
            The action (a numpy scalar or array of the action space's shape), or ``(B, ...)`` actions.

        Raises:
            ValueError: an observation or mask of the wrong shape, a mask that allows nothing, or (a
                recurrent policy) a batch of another size than the previous call's without :meth:`reset`.
        """
        batch, batched = self._batch(observation)
        count = len(next(iter(batch.values())))
        mask = None
        if self.action_mask_width:
            mask = (
                np.ones((count, self.action_mask_width), dtype=bool)
                if action_mask is None
                else np.asarray(action_mask, dtype=bool).reshape(count, self.action_mask_width)
            )
        observations = batch[""] if set(batch) == {""} else batch
        actions = self._actor.act(observations, action_mask=mask, greedy=greedy).actions
        return actions if batched else actions[0]

    def _batch(self, observation: Any) -> tuple[dict[str, np.ndarray], bool]:
        """``({key: (B, *shape) array}, batched)`` from one observation or a batch of them."""
        values = observation if isinstance(observation, dict) else {"": observation}
        if set(values) != set(self.observation_layout):
            raise ValueError(
                f"observation: expected the keys {sorted(self.observation_layout)}, received "
                f"{sorted(values)}"
            )
        arrays: dict[str, np.ndarray] = {}
        batched: set[bool] = set()
        for key, (shape, dtype) in self.observation_layout.items():
            array = np.asarray(values[key], dtype=dtype)
            if array.shape == shape:
                batched.add(False)
                array = array[None]
            elif array.ndim == len(shape) + 1 and array.shape[1:] == shape:
                batched.add(True)
            else:
                raise ValueError(
                    f"observation{'[' + repr(key) + ']' if key else ''}: expected shape {shape} or "
                    f"(B, *{shape}), received {array.shape}"
                )
            arrays[key] = np.ascontiguousarray(array)
        if len(batched) != 1:
            raise ValueError("observation: expected every key batched or none")
        return arrays, batched.pop()


def check_policy_path(path: str | Path) -> Path:
    """``path`` as a Path, when something is there that :func:`load_policy` may read (a checkpoint file, a run
    folder or an exported policy folder); a relative path is relative to the working directory.

    Raises:
        oakemu_core.run.checkpoint.CheckpointNotFoundError: nothing at ``path``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"no such checkpoint file or exported/run folder: {path}")
    return path


def load_policy(checkpoint: str | Path) -> Policy:
    """The policy of a checkpoint of ``oakemu train``: a ``.pt`` file, a run folder (its latest
    checkpoint), or a policy folder written by ``oakemu export``. Loaded on the CPU without unpickling
    code (``torch.load(weights_only=True)``; an exported folder with no torch loader at all).

    Raises:
        oakemu_core.errors.CheckpointError: nothing at ``checkpoint`` (:func:`check_policy_path`), no checkpoint
            there, or a file that is not one of ``oakemu train``.
        oakemu_core.policy.export.PolicyFolderError: an exported folder that is damaged or of another format.
    """
    checkpoint = check_policy_path(checkpoint)
    if is_policy_folder(checkpoint):
        info, _ = read_policy_info(Path(checkpoint))
        return Policy(
            load_policy_folder(Path(checkpoint)), str(info.get("env_id", "")), Path(checkpoint)
        )
    path, state = load_run_checkpoint(checkpoint)
    try:
        schema = schema_from_dict(dict(state["env"]["schema"]))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint: {path} holds no usable step schema ({error})") from None
    layout = {
        schema.observation_key(name): (schema[name].shape, schema[name].dtype)
        for name in schema.observation_names
    }
    model = build_model(
        layout,
        schema.distribution,
        normalize_observations=bool(state["config"].get("normalize_observations")),
        network=NetworkSpec.from_config(state["config"]),
    )
    load_model_state(model, state["model"], source=f"checkpoint {path}")
    model.eval()
    return Policy(model, str(state["env"].get("env_id", "")), path)
