"""Policy routing: per env and per step, who chooses the action (the PPO policy, a random policy or
a user's scripted policy), and which rows PPO may train on.

Seeds 000/001: "random-controlled steps are stored for bookkeeping but marked non-trainable so PPO
stays on-policy". A routed step is a normal step for everything but the PPO loss:

* its observation, action, reward and done are stored like any other row, so GAE runs through it
  (its ``values`` are the policy's V(s): the critic's estimate is needed to bootstrap the rows
  before it) and the env's episode counts it;
* its ``log_probs`` are log pi(routed action | s) under the acting policy (stored for completeness;
  never used, since the row is not trained on);
* its ``trainable`` flag is False, so it never enters a PPO minibatch nor the advantage statistics
  (:func:`oakemu_core.algo.losses.normalize_advantages` sees trainable rows only) and the PPO
  ratio stays 1 on the first minibatch.

Steps the env forces are stored the same way: where the env plays an action of its own whatever it is
sent (the FIRE after a lost life of Atari life-loss episodes, :meth:`oakemu_core.envs.vector.VectorEnv.forced_actions`),
:class:`~oakemu_core.actor.stepper.PolicyStepper` stores that action, its log pi under the acting policy and
``trainable`` False (:func:`replace_actions`, the same replacement as a routed row's). The env's choice
comes after the router's.

Which envs are routed at a step (:meth:`PolicyRouter.decide`), in this order:

1. **random** when the env's game is younger than ``random_first_steps`` agent steps (e.g. the
   no-op-like exploration start many Atari setups use), or else with probability
   ``random_probability``;
2. else **scripted** with probability ``scripted_probability`` (requires ``scripted_policy``);
3. else the PPO **policy**.

Random actions are uniform over the *allowed* actions (action masks are honoured per sub-action;
a Box is uniform within finite bounds, standard normal where a bound is infinite). A scripted
policy is ``module:callable``: ``callable(observations, action_mask) -> actions`` called with only
the routed envs' rows (``observations`` an array ``(k, *shape)`` or a dict key -> array, exactly as
the model sees them; ``action_mask`` ``(k, width)`` bool or None) and returning ``(k,
*action_shape)`` actions in the normalised action space of :class:`oakemu_core.envs.EnvSpec`.
The same callable form is accepted by ``oakemu record --policy module:callable``.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from oakemu_core.envs.spec import EnvSpec
from oakemu_core.policy.action_bundle import PPOActionBundle

__all__ = [
    "ROUTE_NAMES",
    "ROUTE_POLICY",
    "ROUTE_RANDOM",
    "ROUTE_SCRIPTED",
    "PolicyRouter",
    "RoutingConfig",
    "ScriptedPolicy",
    "checked_actions",
    "load_callable",
    "random_actions",
    "replace_actions",
]

ROUTE_POLICY = 0
ROUTE_RANDOM = 1
ROUTE_SCRIPTED = 2
ROUTE_NAMES = ("policy", "random", "scripted")
"""Name of each route code (index = code)."""

ScriptedPolicy = Callable[[Any, np.ndarray | None], Any]
"""``(observations (k, *shape) or dict, action_mask (k, width) bool or None) -> actions (k, *action_shape)``."""


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingConfig:
    """Routing settings (the ``route_*`` fields of :class:`oakemu_core.config.OakEmuConfig`).

    Attributes:
        random_first_steps: the first N agent steps of every game are random-controlled (>= 0). A game is
            an episode of the env's statistics (``VectorStep.episode_env_ids``): with Atari life-loss
            episodes it spans all its lives, so a lost life does not start a random phase.
        random_probability: each other step is random-controlled with this probability ([0, 1]).
        scripted_policy: ``module:callable`` of a scripted policy, or None.
        scripted_probability: a step that is not random is scripted with this probability ([0, 1]);
            must be > 0 exactly when ``scripted_policy`` is set.

    Raises:
        ValueError: a value out of range, or a scripted policy without a probability (or the
            reverse); the message names the field.
    """

    random_first_steps: int = 0
    random_probability: float = 0.0
    scripted_policy: str | None = None
    scripted_probability: float = 0.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.random_first_steps, bool)
            or int(self.random_first_steps) != self.random_first_steps
            or self.random_first_steps < 0
        ):
            raise ValueError(
                f"route_random_first_steps: expected an int >= 0, received {self.random_first_steps!r}"
            )
        for name in ("random_probability", "scripted_probability"):
            value = getattr(self, name)
            if not (
                isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0
            ):
                raise ValueError(f"route_{name}: expected a number in [0, 1], received {value!r}")
        if self.scripted_policy is not None and ":" not in self.scripted_policy:
            raise ValueError(
                f"route_scripted_policy: expected 'module:callable', received {self.scripted_policy!r}"
            )
        if (self.scripted_policy is None) != (self.scripted_probability == 0.0):
            raise ValueError(
                "route_scripted_policy / route_scripted_probability: expected both set (a 'module:callable' and a "
                f"probability > 0) or neither, received {self.scripted_policy!r} and {self.scripted_probability!r}"
            )

    @property
    def active(self) -> bool:
        """True when some step may be routed away from the PPO policy."""
        return (
            self.random_first_steps > 0
            or self.random_probability > 0
            or self.scripted_probability > 0
        )

    def to_env_config(self) -> dict[str, Any]:
        """The settings as ``route_*`` scalars (the learner's join reply ``env_config``)."""
        return {
            "route_random_first_steps": int(self.random_first_steps),
            "route_random_probability": float(self.random_probability),
            "route_scripted_policy": self.scripted_policy,
            "route_scripted_probability": float(self.scripted_probability),
        }

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | Any) -> RoutingConfig:
        """From ``route_*`` keys of a mapping (an ``env_config``) or attributes of an object (an
        :class:`~oakemu_core.config.OakEmuConfig`); missing keys keep the defaults (no routing)."""
        get = (
            values.get
            if isinstance(values, Mapping)
            else (lambda key, default: getattr(values, key, default))
        )
        return cls(
            random_first_steps=int(get("route_random_first_steps", 0) or 0),
            random_probability=float(get("route_random_probability", 0.0) or 0.0),
            scripted_policy=get("route_scripted_policy", None) or None,
            scripted_probability=float(get("route_scripted_probability", 0.0) or 0.0),
        )


# ---------------------------------------------------------------------------------------------
# Building blocks shared with oakemu_core.algo.recording
# ---------------------------------------------------------------------------------------------
def load_callable(reference: str, *, what: str = "policy") -> Callable[..., Any]:
    """Import ``module:attribute`` (dots allowed in both parts) and return the callable.

    Like ``python -m``, the working directory is searched too, so ``my_policies:expert`` resolves
    from the directory a command runs in.

    Raises:
        ValueError: not of the form ``module:callable``, the module cannot be imported, the
            attribute is missing or not callable (the message names the reference).
    """
    module_name, sep, attribute = str(reference).partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{what}: expected 'module:callable', received {reference!r}")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            cwd = os.getcwd()
            if (
                error.name not in (module_name.split(".")[0], module_name)
                or cwd in sys.path
                or "" in sys.path
            ):
                raise
            sys.path.append(cwd)
            module = importlib.import_module(module_name)
    except Exception as error:  # any failure of a user's module: one clear message
        raise ValueError(
            f"{what}: importing {module_name!r} for {reference!r} failed with {type(error).__name__}: {error}"
        ) from error
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(
                f"{what}: {module_name!r} has no attribute {attribute!r} (from {reference!r})"
            )
        target = getattr(target, part)
    if not callable(target):
        # ValueError, not TypeError: one error type for every bad reference (the callers catch it)
        raise ValueError(f"{what}: {reference!r} is a {type(target).__name__}, expected a callable")  # noqa: TRY004
    return target


def random_actions(
    spec: EnvSpec, count: int, rng: np.random.Generator, action_mask: np.ndarray | None = None
) -> np.ndarray:
    """``count`` uniformly random actions of ``spec``'s normalised action space, allowed by the mask.

    Args:
        spec: the env spec (its ``action_space``, ``action_dtype``, ``action_mask_segments``).
        count: actions to draw (>= 0).
        rng: numpy generator (the only source of randomness).
        action_mask: ``(count, spec.action_mask_width)`` bool or None. Discrete: uniform over the
            allowed actions; MultiDiscrete: per sub-action; MultiBinary: a bit with one allowed
            value takes it.

    Returns:
        ``(count, *spec.action_shape)`` array of ``spec.action_dtype``.

    Raises:
        ValueError: a mask of the wrong shape, or a row (sub-action) with no allowed action.
    """
    kind = spec.action_kind
    dtype = spec.action_dtype
    if action_mask is not None:
        action_mask = np.asarray(action_mask, dtype=bool)
        if action_mask.shape != (count, spec.action_mask_width):
            raise ValueError(
                f"action_mask: expected shape ({count}, {spec.action_mask_width}), received "
                f"{action_mask.shape}"
            )
    if kind == "box":
        space = spec.action_space
        low = np.broadcast_to(np.asarray(space.low, np.float64), (count, *spec.action_shape))
        high = np.broadcast_to(np.asarray(space.high, np.float64), (count, *spec.action_shape))
        bounded = np.isfinite(low) & np.isfinite(high)
        safe_low, safe_high = np.where(bounded, low, 0.0), np.where(bounded, high, 0.0)
        uniform = safe_low + rng.uniform(0.0, 1.0, low.shape) * (safe_high - safe_low)
        actions = np.clip(np.where(bounded, uniform, rng.standard_normal(low.shape)), low, high)
        return actions.astype(dtype)
    segments = spec.action_mask_segments
    columns = []
    offset = 0
    for index, size in enumerate(segments):
        if action_mask is None:
            column = rng.integers(0, size, count)
        else:
            allowed = action_mask[:, offset : offset + size]
            totals = allowed.sum(axis=1)
            if (totals == 0).any():
                row = int(np.flatnonzero(totals == 0)[0])
                raise ValueError(
                    f"action_mask: row {row} allows no value for sub-action {index} "
                    f"(mask {action_mask[row].astype(np.int8).tolist()})"
                )
            # The k-th allowed value, k uniform in [0, totals): searchsorted over cumulative counts.
            picks = np.floor(rng.uniform(0.0, 1.0, count) * totals).astype(np.int64)
            cumulative = np.cumsum(allowed, axis=1)
            column = (cumulative <= picks[:, None]).sum(axis=1)
        columns.append(column)
        offset += size
    if kind == "discrete":
        return columns[0].astype(dtype)
    return np.stack(columns, axis=1).astype(dtype) if columns else np.zeros((count, 0), dtype)


def checked_actions(spec: EnvSpec, actions: Any, count: int, *, source: str) -> np.ndarray:
    """Actions returned by a user's policy as ``(count, *action_shape)`` of ``spec.action_dtype``.

    Integer actions of another integer dtype (and bools for MultiBinary) are converted; ranges
    and masks are checked by the env when it steps.

    Raises:
        ValueError: wrong shape or a dtype that does not convert safely (names ``source``).
    """
    array = np.asarray(actions)
    expected = (count, *spec.action_shape)
    if array.shape != expected:
        raise ValueError(f"{source}: expected actions of shape {expected}, received {array.shape}")
    target = spec.action_dtype
    if target.kind in "iu" and array.dtype.kind not in "iub":
        raise ValueError(
            f"{source}: expected integer actions ({target}), received dtype {array.dtype}"
        )
    if target.kind == "f" and array.dtype.kind not in "iuf":
        raise ValueError(
            f"{source}: expected real actions ({target}), received dtype {array.dtype}"
        )
    return array.astype(target, copy=False)


def _select_rows(observations: Any, rows: np.ndarray) -> Any:
    if isinstance(observations, dict):
        return {key: array[rows] for key, array in observations.items()}
    return observations[rows]


def replace_actions(
    model: Any,
    bundle: PPOActionBundle,
    rows: np.ndarray,
    actions: np.ndarray,
    observations: Any,
    action_mask: np.ndarray | None,
) -> PPOActionBundle:
    """``bundle`` with the actions of ``rows`` replaced by ``actions`` (a step the policy did not control).

    Args:
        model: the acting :class:`~oakemu_core.policy.models.ActorCritic`.
        bundle: its output for all ``N`` envs (not modified).
        rows: ``(k,)`` int env rows to replace, ``k >= 1``.
        actions: ``(k, *action_shape)`` the actions taken there, of the action dtype.
        observations: the observations the bundle was chosen on (array or dict, ``N`` rows).
        action_mask: their masks ``(N, width)`` bool, or None.

    Returns:
        a new bundle whose ``rows`` hold ``actions`` and their log-probabilities log pi(action | s) under
        ``model`` (a recurrent model's from the bundle's ``policy_state`` rows); values, distribution
        fields, ``policy_state`` and ``next_state`` stay the policy's (GAE needs V(s) of every row; the
        state after a step does not depend on the action taken).
    """
    replaced = bundle.actions.copy()
    replaced[rows] = actions
    log_probs = bundle.log_probs.copy()
    mask_rows = None if action_mask is None else np.asarray(action_mask)[rows]
    state_rows = None if bundle.policy_state is None else bundle.policy_state[rows]
    log_probs[rows] = _log_probs(
        model, _select_rows(observations, rows), actions, mask_rows, state_rows
    )
    return replace(
        bundle,
        actions=replaced,
        log_probs=log_probs,
        distribution_fields=dict(bundle.distribution_fields),
    )


@torch.no_grad()
def _log_probs(
    model: Any,
    observations: Any,
    actions: np.ndarray,
    action_mask: np.ndarray | None,
    state: np.ndarray | None = None,
) -> np.ndarray:
    """log pi(actions | observations) under ``model`` (an ActorCritic), ``(k,)`` float32 numpy; a
    recurrent model's ``state`` before these observations is ``(k, state_size)`` float32."""
    device = model.device

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    obs = (
        {key: tensor(value) for key, value in observations.items()}
        if isinstance(observations, dict)
        else tensor(observations)
    )
    mask = None if action_mask is None else tensor(np.asarray(action_mask, dtype=bool))
    recurrent = {} if state is None else {"state": tensor(np.asarray(state, dtype=np.float32))}
    policy, _ = model.policy_and_values(obs, mask, **recurrent)
    return policy.log_prob(tensor(actions)).to("cpu", torch.float32).numpy()


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------
class PolicyRouter:
    """Decides per env and per step who acts (see the module docstring) and rewrites the policy's
    action bundle for the routed envs.

    Args:
        spec: the env spec (action space, masks).
        num_envs: envs stepped together (``N``).
        config: the routing settings.
        seed: seed of the router's numpy generator (decisions and random actions).
        scripted: the scripted policy callable; by default loaded from ``config.scripted_policy``.

    Attributes:
        episode_steps: ``(N,)`` int64, agent steps taken so far in each env's current game (an
            episode of the env's statistics; one life is not one).
        counts: routing decisions per route name (``"policy"``, ``"random"``, ``"scripted"``)
            since construction, one per env per :meth:`apply` (a :class:`PolicyStepper` decides
            one step ahead, so its counts include the next step's ``N`` decisions).

    Raises:
        ValueError: ``num_envs`` < 1, or the scripted policy cannot be loaded.
    """

    def __init__(
        self,
        spec: EnvSpec,
        num_envs: int,
        config: RoutingConfig,
        *,
        seed: int | None = None,
        scripted: ScriptedPolicy | None = None,
    ) -> None:
        if int(num_envs) < 1:
            raise ValueError(f"num_envs: expected >= 1, received {num_envs!r}")
        self.spec = spec
        self.num_envs = int(num_envs)
        self.config = config
        self.rng = np.random.default_rng(seed)
        if scripted is None and config.scripted_policy is not None:
            scripted = load_callable(config.scripted_policy, what="route_scripted_policy")
        self.scripted = scripted
        self.episode_steps = np.zeros(self.num_envs, np.int64)
        self.counts = dict.fromkeys(ROUTE_NAMES, 0)

    def decide(self) -> np.ndarray:
        """Route codes ``(N,)`` int8 (``ROUTE_POLICY`` / ``ROUTE_RANDOM`` / ``ROUTE_SCRIPTED``) for
        the step about to be taken. Draws two uniforms per env per call (a fixed consumption of
        the generator, so decisions are reproducible from the seed)."""
        config = self.config
        draws = self.rng.random((2, self.num_envs))
        routes = np.full(self.num_envs, ROUTE_POLICY, np.int8)
        if config.scripted_probability > 0:
            routes[draws[1] < config.scripted_probability] = ROUTE_SCRIPTED
        random = (self.episode_steps < config.random_first_steps) | (
            draws[0] < config.random_probability
        )
        routes[random] = ROUTE_RANDOM
        return routes

    def routed_actions(
        self, routes: np.ndarray, observations: Any, action_mask: np.ndarray | None
    ) -> np.ndarray:
        """Actions of the routed rows (``routes != ROUTE_POLICY``), in row order:
        ``(k, *action_shape)`` of the action dtype."""
        rows = np.flatnonzero(routes != ROUTE_POLICY)
        actions = np.zeros((rows.size, *self.spec.action_shape), self.spec.action_dtype)
        for code in (ROUTE_RANDOM, ROUTE_SCRIPTED):
            picked = np.flatnonzero(routes[rows] == code)
            if not picked.size:
                continue
            env_rows = rows[picked]
            mask = None if action_mask is None else np.asarray(action_mask)[env_rows]
            if code == ROUTE_RANDOM:
                actions[picked] = random_actions(self.spec, env_rows.size, self.rng, mask)
            else:
                assert self.scripted is not None
                source = f"route_scripted_policy {self.config.scripted_policy or self.scripted!r}"
                actions[picked] = checked_actions(
                    self.spec,
                    self.scripted(_select_rows(observations, env_rows), mask),
                    env_rows.size,
                    source=source,
                )
        return actions

    def apply(
        self, model: Any, bundle: PPOActionBundle, observations: Any, action_mask: np.ndarray | None
    ) -> tuple[PPOActionBundle, np.ndarray]:
        """Route the step whose policy output is ``bundle``.

        Args:
            model: the acting :class:`~oakemu_core.policy.models.ActorCritic` (for log pi of routed actions).
            bundle: ``model.act(observations, action_mask=...)`` for all ``N`` envs.
            observations: the observations the bundle was chosen on (array or dict, ``N`` rows).
            action_mask: their masks ``(N, width)`` bool, or None.

        Returns:
            ``(bundle, trainable)``: a bundle whose routed rows hold the routed actions and their
            log-probabilities under ``model`` (values and distribution fields stay the policy's),
            and ``trainable`` ``(N,)`` bool, False on routed rows. Without routed rows the bundle
            is returned unchanged.
        """
        routes = self.decide()
        for code, name in enumerate(ROUTE_NAMES):
            self.counts[name] += int(np.count_nonzero(routes == code))
        trainable = routes == ROUTE_POLICY
        if trainable.all():
            return bundle, trainable
        rows = np.flatnonzero(~trainable)
        routed = self.routed_actions(routes, observations, action_mask)
        return replace_actions(model, bundle, rows, routed, observations, action_mask), trainable

    def end_step(self, games_ended: np.ndarray) -> None:
        """After the envs stepped: count the step, restart the counter of the envs whose game ended.

        Args:
            games_ended: ``(N,)`` bool, the rows whose game ended this step (the rows of
                ``VectorStep.episode_env_ids``; ``dones`` where every episode is a game).
        """
        self.episode_steps += 1
        self.episode_steps[np.asarray(games_ended, dtype=bool)] = 0
