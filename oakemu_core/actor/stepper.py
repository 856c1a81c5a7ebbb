"""One actor vector step, without sockets: act, step the envs, record results, bootstrap truncations.

The actor service wraps :class:`PolicyStepper` with ZeroMQ; tests drive it directly.  Order of one
:meth:`PolicyStepper.step`:

1. the observations, their action masks (masked envs) and the current :class:`PPOActionBundle`
   go into the step buffers;
2. the envs step (same-step autoreset: finished envs already hold their reset observation);
3. on rows truncated by a time limit (and not terminated) the value of the TRUE final observation,
   by the policy that acted, becomes ``bootstrap_values`` (Pardo et al. 2018, "Time Limits in
   Reinforcement Learning"; the SB3 timeout-bootstrap fix);
4. ``before_next_action`` runs (the actor loads newer weights there);
5. the next bundle is chosen on the new observations; its values are this step's ``next_values``
   (V(s_{t+1}) used as ``last_values`` when a rollout segment ends on this row).

With ``segment_end=True`` (the synchronous mode, on the last row of an actor's segment) steps 4-5
are replaced: ``next_values`` are computed with the model that acted (GAE's last value must come
from the policy of the rollout) and the next bundle is NOT chosen; the caller sends the row, loads
the weights trained on the rollout, and the next :meth:`PolicyStepper.step` chooses the bundle with
them first (its ``before_next_action`` hook runs before that choice).

Overlapped env groups (Sample Factory's double-buffered sampling): given an
:class:`oakemu_core.envs.vector.EnvGroups` of G > 1 vector envs, one :meth:`PolicyStepper.step` waits for
group 0's step, chooses its next actions and sends them (group 0 steps in its emulator threads
again), then does the same for group 1, ...: the policy's CPU inference of one group runs while the
other groups' emulators step. The row returned is the same as with one vector env of all the envs
(group g's envs are columns ``offsets[g] ...``), so the message format does not change. The next
step's actions are already sent when :meth:`step` returns: :meth:`reselect` cannot change them (it
returns False), and weights loaded in ``before_next_action`` act from the next call's actions on.
Policy routing is not supported with groups.

Forced actions: where the env plays an action of its own on the next step whatever it is sent
(:meth:`oakemu_core.envs.vector.VectorEnv.forced_actions`: FIRE after a lost life of Atari life-loss
episodes), the chosen bundle's row is replaced by the action the env takes, with its log pi under the
acting policy, and sent with ``trainable=False``, as a routed row (:func:`oakemu_core.actor.routing.replace_actions`);
the stored action is always the action the env executed. This holds with and without groups and routing.

Recurrent policies (a model with a recurrent core, :attr:`ActorCritic.recurrent`): the stepper keeps one
state row per env, ``(n, state_size)`` float32, zeros at the start. A bundle is chosen from the current
state, and its ``policy_state`` (that state) is stored with the step, so row ``t`` of an env holds h_t,
the state before observation ``t``. After the env step the state becomes the bundle's ``next_state``,
with the rows whose ``dones`` are True zeroed (the next row starts an episode). A truncated row's
bootstrap value is V(true final observation) from the ``next_state`` row before that zeroing; a
segment end's ``next_values`` use the state after it, as the next row's choice would. :meth:`reselect`
chooses again from the same state; new weights leave the state as it is (mid-episode). Routed and
forced rows keep the bundle's states; their log pi is the recurrent model's from the same state.
Env groups are refused for a recurrent model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from oakemu_core.actor.routing import PolicyRouter, replace_actions
from oakemu_core.actor.step_buffers import PPOActorStepBuffers
from oakemu_core.envs.vector import EnvGroups, VectorEnv, VectorStep
from oakemu_core.policy.action_bundle import PPOActionBundle
from oakemu_core.policy.models import ActorCritic
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.step_schema import StepSchema


@dataclass
class SteppedRow:
    """What one vector step produced, ready for the wire or a rollout buffer.

    Attributes:
        buffers: the step buffers (observations, actions, log_probs, values, rewards, dones,
            truncated, bootstrap_values, trainable), valid until the next :meth:`PolicyStepper.step`.
        policy_version: version of the weights that chose the actions.
        next_values: ``(n,)`` float32, V(next observation) by the policy of the next action.
        env_step: the env's :class:`VectorStep` (episode returns and lengths, raw).
        policy_revision: revision of those weights within the update running on ``policy_version``
            (0: the version's own weights).
    """

    buffers: PPOActorStepBuffers
    policy_version: int
    next_values: np.ndarray
    env_step: VectorStep
    policy_revision: int = 0


def select_rows(observations: Any, rows: np.ndarray) -> Any:
    """Rows of a batch of observations: an array, or a dict key -> array (each indexed)."""
    if isinstance(observations, dict):
        return {key: array[rows] for key, array in observations.items()}
    return observations[rows]


class PolicyStepper:
    """Steps ``env`` with ``model`` and fills :class:`PPOActorStepBuffers` for all its envs.

    Args:
        env: the vector env (already built; reset here).
        model: the actor-critic used for CPU inference (its distribution fits the env's actions).
        schema: the step schema the buffers follow (the learner's, from the join reply); by
            default the env's own (:func:`oakemu_core.policy.schemas.schema_for_env`).
        policy_version: version of ``model``'s current weights; update :attr:`policy_version`
            whenever new weights are loaded.
        router: policy routing (:class:`oakemu_core.actor.routing.PolicyRouter`): routed envs act with
            a random or scripted action, their rows are sent with ``trainable=False`` (kept for
            GAE, never trained on). None: every env is PPO-controlled and trainable, except the rows
            whose action the env forces (module docstring).
    """

    def __init__(
        self,
        env: VectorEnv | EnvGroups,
        model: ActorCritic,
        *,
        schema: StepSchema | None = None,
        policy_version: int = 0,
        router: PolicyRouter | None = None,
    ) -> None:
        if isinstance(env, EnvGroups) and len(env.groups) == 1:
            env = env.groups[0]
        self.grouped = isinstance(env, EnvGroups)
        if self.grouped and router is not None:
            raise ValueError("PolicyStepper: policy routing is not supported with env groups > 1")
        if self.grouped and model.recurrent:
            raise ValueError(
                "PolicyStepper: a recurrent policy is not supported with env groups > 1 (use env_groups 1)"
            )
        self.env = env
        self.model = model
        self.schema = schema if schema is not None else schema_for_env(env.spec, model.network)
        self.policy_version = policy_version
        self.weights_revision = 0
        """Revision of the weights within ``policy_version`` (weights published after an epoch)."""
        self.buffers = PPOActorStepBuffers.create(num_envs=env.num_envs, schema=self.schema)
        self.masked = "action_mask" in self.schema
        self._env_ids = list(range(env.num_envs))
        self.router = router
        self._all_trainable = np.ones(env.num_envs, dtype=np.bool_)
        self._zero_values = np.zeros(env.num_envs, dtype=np.float32)
        if self.grouped:
            self._init_groups(env)
            return
        self._observations = env.reset()
        self._masks = env.action_masks() if self.masked else None
        self._state = model.initial_state(env.num_envs) if model.recurrent else None
        """A recurrent model's state before the pending (or next) bundle, ``(n, S)`` float32."""
        self._bundle: PPOActionBundle | None = None
        self._bundle, self._trainable = self._choose(self._observations, self._masks)
        self._bundle_version = policy_version
        self._bundle_revision = 0

    def step(
        self, before_next_action: Callable[[], None] | None = None, *, segment_end: bool = False
    ) -> SteppedRow:
        """Run one vector step (see the module docstring for the order).

        Args:
            before_next_action: called before the next bundle is chosen (the actor loads newer
                weights there); when the previous step ended a segment it is called at the start
                of this step, before the deferred choice.
            segment_end: this row ends the actor's rollout segment (synchronous mode):
                ``next_values`` come from the model that acted and the next bundle is chosen at
                the start of the next call, with whatever weights are loaded by then.
        """
        if self.grouped:
            return self._step_groups(before_next_action, segment_end)
        if self._bundle is None:  # the previous step ended a segment: choose with the new weights
            if before_next_action is not None:
                before_next_action()
            self._bundle, self._trainable = self._choose(self._observations, self._masks)
            self._bundle_version, self._bundle_revision = self.policy_version, self.weights_revision
        buffers, model = self.buffers, self.model
        buffers.record_observations(self._observations)
        if self.masked:
            buffers.record_action_masks(self._masks)
        # Whole-vector copies, no per-env Python loop (the per-step overhead of small envs).
        buffers.record_action_bundle(self._bundle, trainable=self._trainable)
        env_step = self.env.step(self._bundle.actions)
        truncated = env_step.truncated & ~env_step.terminated
        next_state = self._bundle.next_state
        bootstrap = self._zero_values
        if truncated.any():
            bootstrap = np.zeros(self.env.num_envs, np.float32)
            bootstrap[truncated] = model.predict_values(
                select_rows(env_step.final_observations, truncated),
                state=None if next_state is None else next_state[truncated],
            )
        dones = env_step.dones
        buffers.record_step_results(env_step.training_rewards, dones, truncated, bootstrap)
        if next_state is not None:  # the state before the next observation; zeros where one starts
            self._state = np.where(dones[:, None], np.float32(0.0), next_state)
        acted_version, acted_revision = self._bundle_version, self._bundle_revision
        if segment_end:  # V(s_T) by the acting model; the next bundle waits for the new weights
            self._observations = env_step.observations
            self._masks = env_step.action_masks if self.masked else None
            if self.router is not None:
                self.router.end_step(_games_ended(env_step))
            self._bundle = None
            next_values = model.predict_values(self._observations, state=self._state).astype(
                np.float32, copy=False
            )
            return SteppedRow(buffers, acted_version, next_values, env_step, acted_revision)
        if before_next_action is not None:
            before_next_action()
        self._observations = env_step.observations
        self._masks = env_step.action_masks if self.masked else None
        if self.router is not None:
            self.router.end_step(_games_ended(env_step))
        self._bundle, self._trainable = self._choose(self._observations, self._masks)
        self._bundle_version, self._bundle_revision = self.policy_version, self.weights_revision
        return SteppedRow(buffers, acted_version, self._bundle.values, env_step, acted_revision)

    def reselect(self) -> bool:
        """Choose the pending action bundle again with the current weights.

        The actor calls this when it loaded newer weights after the bundle for the next step was
        chosen (while it waited to send a message): the next step is then acted by the new policy
        instead of one version behind. No-op (False) when no bundle is pending (synchronous mode
        after a segment end) or the bundle already comes from the current weights (version and
        revision).
        """
        if (
            self.grouped
            or self._bundle is None
            or (
                (self._bundle_version, self._bundle_revision)
                == (self.policy_version, self.weights_revision)
            )
        ):
            return False
        self._bundle, self._trainable = self._choose(self._observations, self._masks)
        self._bundle_version, self._bundle_revision = self.policy_version, self.weights_revision
        return True

    # -- overlapped env groups ----------------------------------------------------------------
    def _init_groups(self, env: EnvGroups) -> None:
        self._g_obs = [group.reset() for group in env.groups]
        self._g_masks = [group.action_masks() if self.masked else None for group in env.groups]
        self._g_bundles: list[PPOActionBundle | None] = [None] * len(env.groups)
        self._g_trainable = [np.ones(group.num_envs, np.bool_) for group in env.groups]
        self._g_versions = [(self.policy_version, self.weights_revision)] * len(env.groups)
        self._in_flight = False
        self._bundle = None

    def _send_group(self, g: int) -> PPOActionBundle:
        group, observations, masks = self.env.groups[g], self._g_obs[g], self._g_masks[g]
        bundle = checked_outputs(self.model.act(observations, action_mask=masks))
        bundle, self._g_trainable[g] = self._forced(
            group, bundle, np.ones(group.num_envs, np.bool_), observations, masks
        )
        self._g_bundles[g], self._g_versions[g] = (
            bundle,
            (self.policy_version, self.weights_revision),
        )
        group.step_async(bundle.actions)
        return bundle

    def _step_groups(
        self, before_next_action: Callable[[], None] | None, segment_end: bool
    ) -> SteppedRow:
        env, buffers, model = self.env, self.buffers, self.model
        if not self._in_flight:  # first step, or the previous one ended a segment
            if before_next_action is not None and self._g_bundles[0] is None and self._started:
                before_next_action()
            for g in range(len(env.groups)):  # group g+1 is chosen while group g steps
                self._send_group(g)
            self._in_flight = True
        self._started = True
        buffers.record_observations(_concat([self._g_obs[g] for g in range(len(env.groups))]))
        if self.masked:
            buffers.record_action_masks(np.concatenate(self._g_masks))
        buffers.record_action_bundle(
            _concat_bundles(self._g_bundles), trainable=np.concatenate(self._g_trainable)
        )
        acted_version, acted_revision = min(self._g_versions)  # the oldest weights that acted
        steps, next_values, bootstraps = [], [], []
        for g, group in enumerate(env.groups):
            step = group.step_wait()
            truncated = step.truncated & ~step.terminated
            bootstrap = np.zeros(group.num_envs, np.float32)
            if truncated.any():
                bootstrap[truncated] = model.predict_values(
                    select_rows(step.final_observations, truncated)
                )
            self._g_obs[g] = step.observations
            self._g_masks[g] = step.action_masks if self.masked else None
            if segment_end:  # V(s_T) by the acting model; nothing is sent until the new weights
                self._g_bundles[g] = None
                next_values.append(
                    model.predict_values(step.observations).astype(np.float32, copy=False)
                )
            else:
                if g == 0 and before_next_action is not None:
                    before_next_action()
                next_values.append(self._send_group(g).values)
            steps.append(step)
            bootstraps.append(bootstrap)
        self._in_flight = not segment_end
        offsets = env.offsets
        env_step = VectorStep(
            observations=_concat([st.observations for st in steps]),
            training_rewards=np.concatenate([st.training_rewards for st in steps]),
            terminated=np.concatenate([st.terminated for st in steps]),
            truncated=np.concatenate([st.truncated for st in steps]),
            final_observations=_concat([st.final_observations for st in steps]),
            episode_returns=[r for st in steps for r in st.episode_returns],
            episode_lengths=[n for st in steps for n in st.episode_lengths],
            episode_env_ids=[
                int(offsets[g]) + i for g, st in enumerate(steps) for i in st.episode_env_ids
            ],
            action_masks=np.concatenate([st.action_masks for st in steps]) if self.masked else None,
        )
        truncated = env_step.truncated & ~env_step.terminated
        buffers.record_step_results(
            env_step.training_rewards, env_step.dones, truncated, np.concatenate(bootstraps)
        )
        return SteppedRow(
            buffers, acted_version, np.concatenate(next_values), env_step, acted_revision
        )

    _started = False

    def _choose(self, observations: Any, masks: np.ndarray | None) -> tuple[PPOActionBundle, Any]:
        """The next action bundle and its per-env trainable flags (``(n,)`` bool; routing applied
        when configured, then the env's forced actions)."""
        bundle = checked_outputs(self.model.act(observations, action_mask=masks, state=self._state))
        trainable = self._all_trainable
        if self.router is not None:
            bundle, trainable = self.router.apply(self.model, bundle, observations, masks)
            trainable = np.asarray(trainable, dtype=np.bool_)
        return self._forced(self.env, bundle, trainable, observations, masks)

    def _forced(
        self,
        env: VectorEnv,
        bundle: PPOActionBundle,
        trainable: np.ndarray,
        observations: Any,
        masks: np.ndarray | None,
    ) -> tuple[PPOActionBundle, np.ndarray]:
        """``bundle`` and ``trainable`` with the rows whose next action ``env`` forces replaced by that
        action (log pi under the model) and marked non-trainable; unchanged (not copied) when none is."""
        forced = env.forced_actions()
        if forced is None:
            return bundle, trainable
        rows, actions = forced
        trainable = trainable.copy()
        trainable[rows] = False
        return replace_actions(self.model, bundle, rows, actions, observations, masks), trainable


def checked_outputs(bundle: PPOActionBundle) -> PPOActionBundle:
    """``bundle`` when its log-probs and values are finite.

    Raises:
        ActorSetupError: a NaN or infinite log-prob or value (a user's encoder, or weights, that give
            NaN on these observations): the learner would reject every step, so the actor stops with
            this one line instead of sending steps that never train.
    """
    if not (np.isfinite(bundle.log_probs).all() and np.isfinite(bundle.values).all()):
        from oakemu_core.actor.client import ActorSetupError

        raise ActorSetupError(
            "the policy gave a NaN or infinite log-prob or value on this actor's observations (a "
            "policy_module or weights that compute NaN); the learner would reject every step"
        )
    return bundle


def _games_ended(env_step: VectorStep) -> np.ndarray:
    """``(n,)`` bool: the rows whose game ended on ``env_step`` (its episode statistics' rows)."""
    ended = np.zeros(env_step.terminated.shape[0], dtype=np.bool_)
    ended[env_step.episode_env_ids] = True
    return ended


def _concat(parts: list[Any]) -> Any:
    """Concatenate batches of observations along the env axis (arrays, or dicts of arrays)."""
    if isinstance(parts[0], dict):
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    return np.concatenate(parts)


def _concat_bundles(bundles: list[PPOActionBundle | None]) -> PPOActionBundle:
    """One bundle for all groups' envs, in group order."""
    assert all(b is not None for b in bundles)
    return PPOActionBundle(
        actions=np.concatenate([b.actions for b in bundles]),  # type: ignore[union-attr]
        log_probs=np.concatenate([b.log_probs for b in bundles]),  # type: ignore[union-attr]
        values=np.concatenate([b.values for b in bundles]),  # type: ignore[union-attr]
        distribution_fields={
            key: np.concatenate([b.distribution_fields[key] for b in bundles])  # type: ignore[union-attr]
            for key in bundles[0].distribution_fields
        },  # type: ignore[union-attr]
    )
