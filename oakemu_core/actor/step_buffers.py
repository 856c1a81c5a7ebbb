"""Per-step arrays an actor fills for all its envs before appending them to a rollout buffer.

One vector-env step of an actor goes: write the observations (and action masks),
:meth:`reset_action_selection`, record the policy's :class:`PPOActionBundle` for the envs it acted
on, step the envs, :meth:`reset_step_results` and :meth:`record_step_result` per env, then
:meth:`add_to_rollout_buffer` (or send :meth:`sent_fields` over the wire). The arrays are allocated
once, from the step schema (:mod:`oakemu_core.step_schema`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from oakemu_core.policy.action_bundle import PPOActionBundle
from oakemu_core.step_schema import StepSchema, check_array, resolve_schema

if TYPE_CHECKING:
    from oakemu_core.storage.rollout_buffer import RolloutBuffer

_CORE_FIELDS = frozenset(
    {
        "actions",
        "log_probs",
        "values",
        "rewards",
        "dones",
        "trainable",
        "truncated",
        "bootstrap_values",
        "next_values",
    }
)


@dataclass
class PPOActorStepBuffers:
    """Mutable per-step PPO actor arrays used for action selection and rollout writes.

    ``N`` = envs stepped in lockstep. Build with :meth:`create` (or pass the arrays:
    ``PPOActorStepBuffers(observations, actions, log_probs, values, rewards, dones,
    trainable)``).

    Attributes:
        observations: ``(N, *observation_shape)`` observation dtype, s_t; a dict key -> array
            for dict observations.
        actions: ``(N, *action_shape)`` action dtype, a_t.
        log_probs: ``(N,)`` float32, log pi(a_t | s_t).
        values: ``(N,)`` float32, V(s_t).
        rewards: ``(N,)`` float32, r_t.
        dones: ``(N,)`` bool, the episode ended on this step (terminated OR truncated).
        trainable: ``(N,)`` bool, the step is PPO training data (the policy chose the action).
        truncated: ``(N,)`` bool, the episode was cut by a time limit (not terminated); zeros
            when not given.
        bootstrap_values: ``(N,)`` float32, V(true final observation) where truncated, else 0;
            zeros when not given.
        extras: the schema's other per-step fields by name (``action_mask``, ``action_mean``,
            ``action_std``, ...), ``(N, *shape)`` each.
    """

    observations: Any
    actions: np.ndarray
    log_probs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    trainable: np.ndarray
    truncated: np.ndarray | None = None
    bootstrap_values: np.ndarray | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rows = np.shape(self.rewards)[:1]
        if self.truncated is None:
            self.truncated = np.zeros(rows, np.bool_)
        if self.bootstrap_values is None:
            self.bootstrap_values = np.zeros(rows, np.float32)

    @classmethod
    def create(
        cls,
        *,
        num_envs: int,
        observation_shape: tuple[int, ...] | None = None,
        observation_dtype: Any = None,
        action_shape: tuple[int, ...] = (),
        action_dtype: Any = np.int64,
        schema: StepSchema | None = None,
    ) -> PPOActorStepBuffers:
        """Allocate zeroed step buffers for one actor.

        Args:
            num_envs: envs stepped in lockstep, positive.
            observation_shape: shape of one observation as stored in the rollout buffer.
            observation_dtype: observation dtype as stored in the rollout buffer.
            action_shape: shape of one action (``()`` for discrete actions).
            action_dtype: action dtype (int64 for a categorical policy).
            schema: the step schema; replaces the four arguments above (any space).

        Raises:
            ValueError: if ``num_envs`` is not a positive int, or not exactly one of a schema and an
                observation shape/dtype is given (:func:`~oakemu_core.step_schema.resolve_schema`).
        """
        if (
            isinstance(num_envs, bool)
            or not isinstance(num_envs, (int, np.integer))
            or num_envs <= 0
        ):
            raise ValueError(f"num_envs: expected a positive int, received {num_envs!r}")
        schema = resolve_schema(
            "PPOActorStepBuffers.create",
            schema,
            observation_shape,
            observation_dtype,
            action_shape,
            action_dtype,
        )
        arrays = {f.name: np.zeros((int(num_envs), *f.shape), dtype=f.dtype) for f in schema.sent}
        arrays.pop("next_values")  # known only after the next action is chosen (see stepper)
        observations = schema.join_observations(
            {n: arrays.pop(n) for n in schema.observation_names}
        )
        core = {name: arrays.pop(name) for name in list(arrays) if name in _CORE_FIELDS}
        return cls(observations=observations, extras=arrays, **core)

    @property
    def num_envs(self) -> int:
        """Envs stepped in lockstep (``N``)."""
        return int(self.rewards.shape[0])

    @property
    def stores_rollout_step(self) -> bool:
        """True when at least one env's step this round is PPO training data."""
        return bool(self.trainable.any())

    def _env_id(self, env_id: Any) -> int:
        if (
            isinstance(env_id, bool)
            or not isinstance(env_id, (int, np.integer))
            or not 0 <= env_id < self.num_envs
        ):
            raise ValueError(
                f"env_id: expected an int in [0, {self.num_envs}), received {env_id!r}"
            )
        return int(env_id)

    def record_observations(self, observations: Any) -> None:
        """Copy the current observations of all envs (s_t) into :attr:`observations`.

        Raises:
            ValueError: wrong type, shape or dtype (no silent cast), or a missing dict key.
        """
        if isinstance(self.observations, dict):
            if (
                not isinstance(observations, dict)
                or observations.keys() != self.observations.keys()
            ):
                received = (
                    sorted(observations)
                    if isinstance(observations, dict)
                    else type(observations).__name__
                )
                raise ValueError(
                    f"observations: expected a dict with keys {sorted(self.observations)}, received {received}"
                )
            for key, target in self.observations.items():
                check_array(f"observations[{key!r}]", observations[key], target.shape, target.dtype)
            for key, target in self.observations.items():
                np.copyto(target, observations[key])
            return
        check_array("observations", observations, self.observations.shape, self.observations.dtype)
        np.copyto(self.observations, observations)

    def record_action_masks(self, action_masks: np.ndarray) -> None:
        """Copy the action masks of the current observations, ``(N, mask width)`` bool.

        Raises:
            ValueError: the schema has no ``action_mask`` field, or a wrong shape/dtype.
        """
        target = self.extras.get("action_mask")
        if target is None:
            raise ValueError(
                "action_mask: these step buffers have no action_mask field (the env gives no masks)"
            )
        check_array("action_mask", action_masks, target.shape, target.dtype)
        np.copyto(target, action_masks)

    def reset_action_selection(self) -> None:
        """Before selecting actions: no env is marked trainable until a bundle is recorded for it."""
        self.trainable[:] = False

    def record_action_bundle_for_env_ids(
        self,
        action_bundle: PPOActionBundle,
        *,
        env_ids: Sequence[int] | np.ndarray,
        trainable: Sequence[bool] | np.ndarray,
    ) -> None:
        """Copy one action bundle into the step buffers for a subset of envs.

        Row ``i`` of the bundle belongs to env ``env_ids[i]``.

        Args:
            action_bundle: the policy's output for ``len(env_ids)`` observations.
            env_ids: distinct env indices in ``[0, N)``.
            trainable: per env in ``env_ids``, whether the step is PPO training data.

        Raises:
            ValueError: bad env ids, ``trainable`` of another length, or a bundle array of the
                wrong shape or dtype (nothing is written then).
        """
        ids = np.asarray(env_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"env_ids: expected a 1-D sequence of ints, received {env_ids!r}")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_envs):
            raise ValueError(
                f"env_ids: expected ids in [0, {self.num_envs}), received {ids.tolist()}"
            )
        if np.unique(ids).size != ids.size:
            raise ValueError(f"env_ids: expected distinct ids, received {ids.tolist()}")
        flags = np.asarray(trainable)
        if flags.shape != ids.shape or (flags.size and flags.dtype != np.bool_):
            raise ValueError(
                f"trainable: expected {ids.size} bools (one per env id), received shape {flags.shape} "
                f"dtype {flags.dtype}"
            )
        batch = (ids.size,)
        check_array(
            "action_bundle.actions",
            action_bundle.actions,
            batch + self.actions.shape[1:],
            self.actions.dtype,
        )
        check_array("action_bundle.log_probs", action_bundle.log_probs, batch, self.log_probs.dtype)
        check_array("action_bundle.values", action_bundle.values, batch, self.values.dtype)
        extras = _bundle_extras(action_bundle, self.extras)
        for name, array in extras.items():
            target = self.extras.get(name)
            if target is None:
                raise ValueError(
                    f"action_bundle.{name}: not a field of these step buffers ({sorted(self.extras)})"
                )
            check_array(f"action_bundle.{name}", array, batch + target.shape[1:], target.dtype)
        self.actions[ids] = action_bundle.actions
        self.log_probs[ids] = action_bundle.log_probs
        self.values[ids] = action_bundle.values
        for name, array in extras.items():
            self.extras[name][ids] = array
        self.trainable[ids] = flags.astype(np.bool_, copy=False)

    def record_action_bundle(
        self, action_bundle: PPOActionBundle, *, trainable: np.ndarray
    ) -> None:
        """Copy one action bundle for ALL envs (row ``i`` -> env ``i``): the actor's per-step path,
        without the id checks of :meth:`record_action_bundle_for_env_ids`.

        Args:
            action_bundle: the policy's output for the ``N`` envs.
            trainable: ``(N,)`` bool, whether each env's step is PPO training data.

        Raises:
            ValueError: a bundle array or ``trainable`` of the wrong shape or dtype (nothing is
                written then).
        """
        n = (self.num_envs,)
        check_array(
            "action_bundle.actions",
            action_bundle.actions,
            n + self.actions.shape[1:],
            self.actions.dtype,
        )
        check_array("action_bundle.log_probs", action_bundle.log_probs, n, self.log_probs.dtype)
        check_array("action_bundle.values", action_bundle.values, n, self.values.dtype)
        check_array("trainable", trainable, n, self.trainable.dtype)
        extras = _bundle_extras(action_bundle, self.extras)
        for name, array in extras.items():
            target = self.extras.get(name)
            if target is None:
                raise ValueError(
                    f"action_bundle.{name}: not a field of these step buffers ({sorted(self.extras)})"
                )
            check_array(f"action_bundle.{name}", array, target.shape, target.dtype)
        np.copyto(self.actions, action_bundle.actions)
        np.copyto(self.log_probs, action_bundle.log_probs)
        np.copyto(self.values, action_bundle.values)
        for name, array in extras.items():
            np.copyto(self.extras[name], array)
        np.copyto(self.trainable, trainable)

    def record_step_results(
        self,
        rewards: np.ndarray,
        dones: np.ndarray,
        truncated: np.ndarray,
        bootstrap_values: np.ndarray,
    ) -> None:
        """Copy the step results of ALL envs at once (the vectorised :meth:`record_step_result`).

        Args:
            rewards: ``(N,)`` numbers (cast to float32, as the per-env path does).
            dones: ``(N,)`` bool, terminated OR truncated.
            truncated: ``(N,)`` bool, cut by a time limit and not terminated; implies ``dones``.
            bootstrap_values: ``(N,)`` numbers, V(true final observation) where truncated, else 0.

        Raises:
            ValueError: a wrong shape, a non-bool flag array, ``truncated`` without ``dones``, or a
                non-zero bootstrap value on a step that is not truncated (nothing is written then).
        """
        n = (self.num_envs,)
        for name, array in (("rewards", rewards), ("bootstrap_values", bootstrap_values)):
            if not isinstance(array, np.ndarray) or array.shape != n:
                raise ValueError(
                    f"{name}: expected a numpy array of shape {n}, received "
                    f"{getattr(array, 'shape', type(array).__name__)}"
                )
        check_array("dones", dones, n, np.dtype(np.bool_))
        check_array("truncated", truncated, n, np.dtype(np.bool_))
        if np.any(truncated & ~dones):
            raise ValueError(
                f"truncated: expected done=True for every truncated step, received envs "
                f"{np.flatnonzero(truncated & ~dones).tolist()}"
            )
        if np.any(bootstrap_values[~truncated] != 0):
            raise ValueError(
                f"bootstrap_values: expected 0 on steps that are not truncated, received envs "
                f"{np.flatnonzero((bootstrap_values != 0) & ~truncated).tolist()}"
            )
        np.copyto(self.rewards, rewards, casting="unsafe")
        np.copyto(self.dones, dones)
        np.copyto(self.truncated, truncated)
        np.copyto(self.bootstrap_values, bootstrap_values, casting="unsafe")

    def reset_step_results(self) -> None:
        """Clear rewards, dones, truncation flags and bootstrap values before stepping the envs."""
        self.rewards[:] = 0.0
        self.dones[:] = False
        self.truncated[:] = False
        self.bootstrap_values[:] = 0.0

    def record_step_result(
        self,
        env_id: int,
        reward: float,
        *,
        done: bool,
        truncated: bool = False,
        bootstrap_value: float = 0.0,
    ) -> None:
        """Copy one env's step result into the step buffers.

        With Gymnasium's ``terminated, truncated`` pair pass ``done=terminated or truncated`` and
        ``truncated=truncated and not terminated`` (a terminal state has no future value even if
        the time limit fell on the same step).

        Args:
            env_id: env index in ``[0, N)``.
            reward: reward of this step.
            done: the episode ended on this step (terminated OR truncated).
            truncated: it ended because of a time limit; requires ``done``.
            bootstrap_value: V(true final observation) when ``truncated``; must be 0 otherwise.

        Raises:
            ValueError: bad ``env_id``, ``truncated`` without ``done``, or a non-zero
                ``bootstrap_value`` on a step that is not truncated.
        """
        index = self._env_id(env_id)
        if truncated and not done:
            raise ValueError(
                f"truncated: expected done=True for a truncated step, received done={done!r}"
            )
        if not truncated and bootstrap_value != 0:
            raise ValueError(
                f"bootstrap_value: expected 0 on a step that is not truncated, received {bootstrap_value!r}"
            )
        self.rewards[index] = reward
        self.dones[index] = bool(done)
        self.truncated[index] = bool(truncated)
        self.bootstrap_values[index] = bootstrap_value

    def sent_fields(self, next_values: np.ndarray, schema: StepSchema) -> dict[str, np.ndarray]:
        """Every field a step message carries, by schema name (views, no copies).

        Args:
            next_values: ``(N,)`` float32, V(next observation) (see :mod:`oakemu_core.actor.stepper`).
            schema: the step schema the buffers were created from.
        """
        fields = dict(schema.split_observations(self.observations))
        fields.update(
            actions=self.actions,
            log_probs=self.log_probs,
            values=self.values,
            rewards=self.rewards,
            dones=self.dones,
            truncated=self.truncated,
            bootstrap_values=self.bootstrap_values,
            next_values=next_values,
            trainable=self.trainable,
            **self.extras,
        )
        return fields

    def add_to_rollout_buffer(
        self, rollout_buffer: RolloutBuffer, *, policy_version: int = 0, policy_revision: int = 0
    ) -> None:
        """Append the current step (all envs) to ``rollout_buffer`` with :meth:`RolloutBuffer.add`,
        acted by revision ``policy_revision`` of ``policy_version``.

        Truncation reaches the buffer through ``dones`` and ``bootstrap_values``.

        Raises:
            ValueError / OverflowError: as :meth:`RolloutBuffer.add` (e.g. a spec mismatch, a full buffer).
        """
        rollout_buffer.add(
            self.observations,
            self.actions,
            self.log_probs,
            self.values,
            self.rewards,
            self.dones,
            self.trainable,
            bootstrap_values=self.bootstrap_values,
            policy_version=policy_version,
            policy_revision=policy_revision,
            **self.extras,
        )


def _bundle_extras(
    action_bundle: PPOActionBundle, fields: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The bundle's arrays stored among the step buffers' extra ``fields``: its distribution fields, and
    a recurrent policy's ``policy_state`` (the state before the step).

    Raises:
        ValueError: ``fields`` hold a ``policy_state`` and the bundle no state (a feed-forward model
            acting for a recurrent run), or the other way round.
    """
    extras = dict(action_bundle.distribution_fields)
    stores_state = "policy_state" in fields
    if stores_state != (action_bundle.policy_state is not None):
        raise ValueError(
            "action_bundle.policy_state: these step buffers "
            + (
                "store a recurrent policy's state and the bundle has none"
                if stores_state
                else "have no policy_state field (a feed-forward run) and the bundle has one"
            )
        )
    if action_bundle.policy_state is not None:
        extras["policy_state"] = action_bundle.policy_state
    return extras
