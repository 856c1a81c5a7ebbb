"""What a join reply builds on an actor: its envs, its CPU model (with an inference backend) and the
stepper that acts with them.

The reply's ``env_config`` names the env and its settings, its ``spec`` the step fields the learner
expects and its ``weights`` the policy to act with first (:class:`~oakemu_core.transport.control.JoinReply`).
:func:`set_up_policy` builds everything once, at an actor's first join; :meth:`ActorPolicy.load` loads
later weights (rejoins, weights messages) into the model and its backend. The parts
(:func:`make_envs`, :func:`make_model`, :func:`make_inference_backend`, :func:`make_stepper`) are
used on their own by tests and tools.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oakemu_core.actor.central_inference import CentralForward, InferenceClient
from oakemu_core.actor.client import ActorSetupError
from oakemu_core.actor.routing import PolicyRouter, RoutingConfig
from oakemu_core.actor.stepper import PolicyStepper
from oakemu_core.envs.factory import make_env_groups, make_vector_env
from oakemu_core.envs.options import EnvOptions
from oakemu_core.envs.vector import EnvGroups, VectorEnv
from oakemu_core.policy.models import ActorCritic, build_model, load_weight_arrays
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.transport.control import JoinReply

if TYPE_CHECKING:
    from oakemu_core.config import OakEmuConfig

__all__ = [
    "ActorPolicy",
    "set_up_policy",
    "make_envs",
    "make_model",
    "make_inference_backend",
    "make_stepper",
]

log = logging.getLogger("oakemu.actor")


@dataclass
class ActorPolicy:
    """An actor's envs and the policy acting on them, as its first join built them.

    Attributes:
        env: the actor's envs (``envs_per_actor``, in ``env_groups``).
        model: the CPU actor-critic, in eval mode.
        inference_backend: the forward passes of ``actor_inference`` other than torch's (has
            ``load(model)``), or None.
        stepper: steps ``env`` with ``model``; its ``(policy_version, weights_revision)`` name the
            weights loaded (the actor's one record of them).
    """

    env: VectorEnv | EnvGroups
    model: ActorCritic
    inference_backend: Any
    stepper: PolicyStepper

    def load(self, weights: dict[str, np.ndarray]) -> None:
        """Load weight arrays (name -> array, as published) into the model, then hand the model to
        the inference backend: a backend left with the old weights would act an old policy."""
        load_weight_arrays(self.model, weights)
        if self.inference_backend is not None:
            self.inference_backend.load(self.model)


def set_up_policy(
    config: OakEmuConfig,
    reply: JoinReply,
    actor_id: str,
    inference: InferenceClient | None = None,
) -> ActorPolicy:
    """Everything an actor's first join builds: torch seeded with the run's seed, the envs, the model
    with the join's weights and ``config.actor_inference``'s backend (``"central"``: through
    ``inference``, the connection to the inference server), the stepper (whose first actions come
    from those weights). The envs are closed again when a later part fails.

    Raises:
        ActorSetupError: as :func:`make_envs`, :func:`make_inference_backend`, :func:`make_stepper`;
            ``"central"`` without ``inference``.
        CentralInferenceError: the inference server does not answer, or not as the model does.
    """
    torch.manual_seed(int(reply.env_config["seed"]))
    env = make_envs(config, reply)
    try:
        model = make_model(env, reply)
        backend = None
        if config.actor_inference == "central":
            if inference is None:
                raise ActorSetupError(
                    "actor_inference='central': no inference server to connect to"
                )
            backend = CentralForward(model, inference, policy_version=reply.policy_version)
            log.info(
                "actor %s: forward passes by the inference server at %s",
                actor_id,
                inference.address,
            )
            model.use_inference_backend(backend)
        elif config.actor_inference != "torch":
            backend = make_inference_backend(
                config.actor_inference, model, threads=config.torch_threads, actor_id=actor_id
            )
            model.use_inference_backend(backend)  # None ("auto" for a CNN): torch's
        stepper = make_stepper(env, model, reply)
        if isinstance(backend, CentralForward):  # from now on the stepper names the weights
            backend.follow(stepper)
        return ActorPolicy(env, model, backend, stepper)
    except BaseException:
        env.close()
        raise


def make_envs(config: OakEmuConfig, reply: JoinReply) -> VectorEnv | EnvGroups:
    """The actor's ``envs_per_actor`` envs of the join's ``env_config`` (in ``env_groups`` stepped
    side by side when more than one), after checking they give the step fields the learner expects.

    Raises:
        ActorSetupError: the local env gives other step fields (another version of the env or of
            OakEmu-RL here).
    """
    assert reply.spec is not None
    env_config = reply.env_config
    env_id, seed = str(env_config["env_id"]), int(env_config["seed"])
    kwargs = dict(
        clip_rewards=bool(env_config["clip_rewards"]),
        max_episode_steps=env_config.get("max_episode_steps"),
        settings_file=env_config.get("emulator_settings"),
        num_threads=config.resolved_emulator_threads(),
        options=EnvOptions.from_settings(env_config),
    )
    groups = min(config.env_groups, config.envs_per_actor)
    env = (
        make_env_groups(env_id, config.envs_per_actor, groups, seed=seed, **kwargs)
        if groups > 1
        else make_vector_env(env_id, config.envs_per_actor, seed=seed, **kwargs)
    )
    local = schema_for_env(env.spec, network_of(reply))
    schema = reply.spec.schema
    if local != schema:
        env.close()
        raise ActorSetupError(
            f"this actor's {env_id} gives step fields [{local.describe()}], the learner expects "
            f"[{schema.describe()}]: install the same env and OakEmu-RL versions as the learner"
        )
    return env


def network_of(reply: JoinReply) -> NetworkSpec:
    """The learner's policy architecture from a join reply (the default when the reply has none)."""
    try:
        return NetworkSpec.from_config(reply.env_config)
    except ValueError as error:
        raise ActorSetupError(
            f"the learner's network is not one this actor can build: {error}"
        ) from None


def make_model(env: VectorEnv | EnvGroups, reply: JoinReply) -> ActorCritic:
    """The actor's CPU model for ``env``, in eval mode, with the join's weights loaded."""
    assert reply.spec is not None
    model = build_model(
        env.spec.observation_layout,
        reply.spec.schema.distribution,
        normalize_observations=bool(reply.env_config.get("normalize_observations")),
        network=network_of(reply),
    )
    model.eval()
    load_weight_arrays(model, reply.weights)
    return model


def make_inference_backend(
    kind: str, model: ActorCritic, *, threads: int, actor_id: str = ""
) -> Any:
    """The forward passes of ``actor_inference`` ``kind`` for ``model``: ``"numpy"``
    (:class:`~oakemu_core.policy.numpy_inference.NumpyForward`), ``"auto"`` (numpy where it serves the
    model, else None: torch's own), ``"bfloat16"``
    (:class:`~oakemu_core.policy.bfloat16_inference.BFloat16Forward`) or ``"onnxruntime"``
    (:class:`~oakemu_core.policy.onnx_inference.OnnxForward`, ``threads`` intra-op threads); give it to
    :meth:`~oakemu_core.policy.models.ActorCritic.use_inference_backend`, and ``load`` it after each
    weights update.

    Raises:
        ActorSetupError: the backend cannot serve this model (or cannot be set up here).
    """
    if model.recurrent and kind not in ("auto", "numpy", "torch"):
        raise ActorSetupError(
            f"actor_inference={kind!r} serves feed-forward policies only; a recurrent policy acts "
            f"in numpy or torch: use --actor-inference auto, numpy or torch"
        )
    try:
        if kind in ("auto", "numpy"):
            from oakemu_core.policy.numpy_inference import NumpyForward

            if kind == "auto" and NumpyForward.unsupported_reason(model):
                return None
            backend = NumpyForward(model)
            log.info("actor %s: forward passes in numpy", actor_id)
            return backend
        if kind == "bfloat16":
            from oakemu_core.policy.bfloat16_inference import BFloat16Forward

            backend: Any = BFloat16Forward(model)
            log.info("actor %s: forward passes in bfloat16", actor_id)
            return backend
        from oakemu_core.policy.onnx_inference import OnnxForward

        backend = OnnxForward(model, threads=threads)
        log.info("actor %s: forward passes by ONNX Runtime", actor_id)
        return backend
    except ValueError as error:
        raise ActorSetupError(str(error)) from None
    except Exception as error:  # noqa: BLE001 - the exporter's or ONNX Runtime's own: one readable line
        raise ActorSetupError(
            f"actor_inference={kind!r} could not be set up "
            f"({type(error).__name__}: {error}); use --actor-inference torch"
        ) from None


def make_stepper(env: VectorEnv | EnvGroups, model: ActorCritic, reply: JoinReply) -> PolicyStepper:
    """The stepper of ``env`` with ``model`` (its first actions are chosen here: give the model its
    inference backend first), routing as the join's ``route_*`` settings say.

    Raises:
        ActorSetupError: the routing settings cannot be served here (a scripted policy that does not
            import on this machine, or routing with ``env_groups`` > 1), or ``env_groups`` > 1 with a
            recurrent policy.
    """
    assert reply.spec is not None
    if isinstance(env, EnvGroups) and model.recurrent:
        raise ActorSetupError(
            f"env_groups={len(env.groups)}: the learner's policy is recurrent "
            f"({model.network.recurrent}); start this actor with --env-groups 1"
        )
    try:
        routing = RoutingConfig.from_mapping(reply.env_config)
        router = (
            PolicyRouter(env.spec, env.num_envs, routing, seed=int(reply.env_config["seed"]))
            if routing.active
            else None
        )
        if router is not None and isinstance(env, EnvGroups):
            raise ValueError("not supported with env_groups > 1")
    except ValueError as error:
        raise ActorSetupError(f"policy routing: {error}") from None
    return PolicyStepper(
        env, model, schema=reply.spec.schema, policy_version=reply.policy_version, router=router
    )
