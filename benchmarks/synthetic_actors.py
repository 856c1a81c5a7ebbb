"""Synthetic actors and a learner without PPO, shared by the ingest benchmarks.

* :class:`SyntheticActor`: joins like a real actor (same join, spec, sockets, back-pressure, weights
  polling and heartbeats: :class:`oakemu_services.actor.Actor`), takes ONE real vector step for
  valid field values, then re-sends those fields with increasing ``seq``: no env, no inference; or
  (:meth:`SyntheticActor.start_replay`) re-sends 64 messages encoded once, with fresh headers.
* :class:`NoUpdateLearner` (and :class:`NewVersionNoUpdateLearner`) and :func:`no_update_learner`:
  a :class:`oakemu_services.learner.Learner` whose PPO update does nothing, so full buffers are released at once and what is measured is the
  learner's receive, decode/validate and write into shared memory; :func:`learner_with`: the same
  learner with any :class:`~oakemu_core.algo.learner.PPOLearner` (one that trains, for end-to-end runs).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from oakemu_core.algo.learner import PPOLearner

__all__ = [
    "NewVersionNoUpdateLearner",
    "NoUpdateLearner",
    "SyntheticActor",
    "learner_with",
    "no_update_learner",
    "stack_shifter",
]


class NoUpdateLearner(PPOLearner):
    """A :class:`~oakemu_core.algo.learner.PPOLearner` whose update does nothing: each rollout is
    prepared (stale rows, GAE) and handed back at once, with the same weights."""

    def update(self, rollout: object) -> None:
        return None


class NewVersionNoUpdateLearner(NoUpdateLearner):
    """A :class:`NoUpdateLearner` that hands back the same weights as a new policy version, as each
    real update does: actors then pace themselves, and lag, as in training."""

    def update(self, rollout: object) -> None:
        with self.learner_model.locked():
            self.learner_model.version += 1
        return None


def no_update_learner(config, run_dir: Path, *, new_versions: bool = False):
    """A :class:`oakemu_services.learner.Learner` for ``config`` (run folder ``run_dir``) whose trainer
    updates nothing (:class:`NoUpdateLearner`): full buffers are released at once; with
    ``new_versions`` each as a new policy version (:class:`NewVersionNoUpdateLearner`)."""
    return learner_with(
        config, run_dir, NewVersionNoUpdateLearner if new_versions else NoUpdateLearner
    )


def learner_with(config, run_dir: Path, learner_type: type[PPOLearner]):
    """A :class:`oakemu_services.learner.Learner` for ``config`` (run folder ``run_dir``) whose trainer
    builds a ``learner_type`` (:class:`PPOLearner` itself: a learner that trains)."""
    from oakemu_services.learner import Learner

    from oakemu_core.algo.trainer import Trainer
    from oakemu_core.config import resolved_device
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env

    spec = env_spec(config.env_id)
    trainer = Trainer(
        config,
        spec,
        schema_for_env(spec),
        run_dir,
        device=resolved_device(config),
        learner_type=learner_type,
    )
    return Learner(config, run_dir, trainer=trainer)


def stack_shifter(fields: dict[str, np.ndarray], schema, k: int, pool_size: int = 64):
    """``shift()``: moves every stacked observation of ``fields`` (in place) one frame on, the newest
    frame drawn from a pool of random frames, as an env's frame stack moves between steps (K > 1: the
    block's steps follow each other), so stacked-frame deduplication sees real steps."""
    from oakemu_core.transport.frame_stacks import stacked_fields

    names = sorted(stacked_fields(schema))
    rng = np.random.default_rng(0)
    pools = {
        name: rng.integers(0, 256, (pool_size, *schema[name].shape[1:]), np.uint8) for name in names
    }
    state = {"next": 0}

    def shift() -> None:
        for name in names:
            blocks = fields[name] if k > 1 else fields[name][None]
            for step in range(blocks.shape[0]):
                previous = blocks[step - 1] if step else blocks[-1]
                blocks[step, :, :-1] = previous[:, 1:]
                blocks[step, :, -1] = pools[name][state["next"] % pool_size]
                state["next"] += 1

    return shift


class SyntheticActor:
    """One synthetic actor of ``num_envs`` envs of ``env_id``, talking to the learner on ``ports``
    (data, control, weights, telemetry, metrics) with ``actor_id``; ``transport`` is its
    ``step_transport`` ("auto": a step ring on the learner's machine; "sockets": arrays inline).
    ``stop`` (a ``threading.Event`` or a ``multiprocessing`` event) ends waits; the learner's stop
    notice sets it. Nothing touches the network before :meth:`join`."""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        ports: list[int],
        actor_id: str,
        stop: threading.Event,
        transport: str = "auto",
    ) -> None:
        from oakemu_services.actor import Actor

        from oakemu_core.config import OakEmuConfig

        config = OakEmuConfig(
            env_id=env_id,
            envs_per_actor=num_envs,
            actor_id=actor_id,
            log_level="WARNING",
            data_port=ports[0],
            control_port=ports[1],
            weights_port=ports[2],
            telemetry_port=ports[3],
            metrics_port=ports[4],
            step_transport=transport,
        )
        self.actor = Actor(config, stop)
        self.fields: dict[str, np.ndarray] = {}
        self.shift = lambda: None
        self.rejoins = 0
        self.replayed: list[
            tuple[dict, list]
        ] = []  # (header, frames) per message of a replay cycle

    @property
    def env_steps_per_message(self) -> int:
        """Env steps one message carries: envs x the join's K (vector steps per message)."""
        return self.actor.config.envs_per_actor * self.actor.steps_per_message

    def join(self) -> None:
        """Join (retrying while the learner is not up); the first join takes the one real vector step
        whose fields every message re-sends. Raises what :meth:`Actor.join` raises."""
        actor = self.actor
        actor.join()
        if self.fields:
            return
        assert actor.stepper is not None
        row = actor.stepper.step(before_next_action=None, segment_end=False)
        fields = row.buffers.sent_fields(row.next_values, actor.stepper.schema)
        k = actor.steps_per_message
        if k > 1:  # a block of K identical steps, (K, n, *shape) per field
            fields = {name: np.repeat(array[None], k, axis=0) for name, array in fields.items()}
        self.fields = fields
        self.shift = stack_shifter(fields, actor.stepper.schema, k)

    def start_replay(self) -> None:
        """From now on :meth:`send_next` re-sends messages encoded once: ``KEYFRAME_MESSAGES`` (64)
        consecutive messages are encoded here (stacks moved on, deduplicated, key frames where the
        actor's encoder puts them), then message ``seq`` goes as number ``seq % 64`` of them with a
        fresh header (``seq``, ``policy_version``). The learner receives, checks, rebuilds and writes
        each as a real one; this process spends only the sends, as if it encoded on a machine of its
        own (a remote actor). After :meth:`join`; through the sockets only (no step ring)."""
        import msgpack

        from oakemu_core.transport.frame_stacks import KEYFRAME_MESSAGES
        from oakemu_core.transport.steps import StepMessage

        actor = self.actor
        if actor.channel is None or actor.channel.ring is not None:
            raise ValueError(
                "start_replay: expected an actor that joined and sends through the sockets"
            )
        self.replayed = []
        for seq in range(KEYFRAME_MESSAGES):
            self.shift()
            frames = actor.channel.encoder.encode(
                StepMessage(
                    actor.actor_id,
                    actor.incarnation,
                    seq,
                    actor.weights.policy_version,
                    self.fields,
                )
            )
            kept = [
                frame if isinstance(frame, (bytes, bytearray)) else bytes(frame) for frame in frames
            ]
            self.replayed.append((msgpack.unpackb(kept[0]), kept[1:]))

    def send_next(self, *, hold_ahead: bool = False) -> bool:
        """Pick up newer weights, heartbeat if due, and send the next message (waiting while the
        channel cannot take it); with ``hold_ahead`` first wait as a real asynchronous actor does
        once it acted two segments with one policy version (:meth:`Actor.wait_if_too_far_ahead`).
        After :meth:`start_replay` the message is the next replayed one. Returns False when the learner had forgotten this actor (it restarted, or timed the actor
        out): the actor joined again and the message was not sent. Raises ``LearnerUnreachable``
        when the learner stays silent past the actor's patience."""
        from oakemu_services.actor import (
            _Rejoined,
        )  # the actor loop's own signal: a rejoin happened

        from oakemu_core.transport.codec import pack
        from oakemu_core.transport.steps import StepMessage

        actor = self.actor
        try:
            actor._poll_weights()  # the learner publishes a version per released buffer
            actor.heartbeat_if_due()
            if hold_ahead:
                actor.wait_if_too_far_ahead()
            if self.replayed:
                head, frames = self.replayed[actor.seq % len(self.replayed)]
                actor.channel.send_frames(
                    [
                        pack(
                            {
                                **head,
                                "seq": actor.seq,
                                "policy_version": actor.weights.policy_version,
                            }
                        ),
                        *frames,
                    ],
                    actor._pause,
                )
            else:
                self.shift()
                actor.send_step(
                    StepMessage(
                        actor.actor_id,
                        actor.incarnation,
                        actor.seq,
                        actor.weights.policy_version,
                        self.fields,
                    )
                )
        except _Rejoined:
            self.rejoins += 1
            if self.replayed:  # a new incarnation: its messages start over, whole stacks first
                self.start_replay()
            return False
        actor.seq += 1
        actor.pacing.acted(actor.weights.policy_version, actor.steps_per_message)
        actor.env_steps += self.env_steps_per_message  # the rate its heartbeats report
        return True

    def close(self) -> None:
        """Leave (best effort) and release the sockets."""
        self.actor.close()
