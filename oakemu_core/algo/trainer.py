"""The training side of the learner process: model, optimizer, learning-rate schedule, the
library's :class:`~oakemu_core.algo.learner.PPOLearner` (driven by the trainer thread,
:func:`~oakemu_core.algo.trainer_thread.run_trainer`),
checkpoints and the resume path.

The service (``oakemu_services.learner``) builds one :class:`Trainer` (or is handed one), publishes
full rollouts to its :attr:`Trainer.handshake` and collects the results; everything here runs
without sockets.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oakemu_core.algo.flat_parameters import FlatAdam
from oakemu_core.algo.handshake import (
    RolloutHandshake,
    RunProgress,
    TrainerCounters,
    WeightsRevision,
)
from oakemu_core.algo.health import CheckpointPolicy, HealthMonitor
from oakemu_core.algo.learner import PPOLearner, RuntimeContext, ThreadSafeModel
from oakemu_core.algo.ppo import cpu_has_native_bfloat16
from oakemu_core.algo.schedules import LinearSchedule
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.algo.trainer_thread import run_trainer
from oakemu_core.policy.models import build_model
from oakemu_core.run.checkpoint import (
    CheckpointWriter,
    capture_rng_state,
    checkpoint_trained_steps,
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
)
from oakemu_core.run.run_folder import check_resume_compatible, resume_step, truncate_run_logs
from oakemu_core.run.tester import tester_from_config

if TYPE_CHECKING:
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.envs import EnvSpec
    from oakemu_core.step_schema import StepSchema

__all__ = ["Trainer"]

log = logging.getLogger("oakemu.learner")


def build_optimizer(
    config: OakEmuConfig, model: torch.nn.Module, device: str
) -> torch.optim.Optimizer:
    """The learner's Adam (CleanRL's: eps 1e-5), fused where torch has the kernel (one op for all
    parameters instead of a Python loop over them): over one flat tensor holding the trained
    parameters (:class:`~oakemu_core.algo.flat_parameters.FlatAdam`: its per-step work done once),
    or torch's own over the parameters when behaviour-cloning pre-training (``bc_dataset`` and
    ``bc_pretrain_updates``) will train the policy alone: torch's Adam skips the untouched critic,
    FlatAdam would step it."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    kwargs: dict[str, Any] = {
        "lr": config.learning_rate,
        "eps": 1e-5,
        "fused": torch.device(device).type in ("cpu", "cuda"),
    }
    if config.bc_dataset and config.bc_pretrain_updates:
        return torch.optim.Adam(trained, **kwargs)
    return FlatAdam(trained, **kwargs)


class Trainer:
    """Model, optimizer, schedule, :class:`PPOLearner`, checkpoint policy and resume of one run.

    Args:
        config: the run's :class:`~oakemu_core.config.OakEmuConfig`.
        spec: the env's spec (observation layout, env id). schema: its step schema.
        run_dir: the run folder (``checkpoints/`` inside).
        device: the resolved torch device of the updates (``oakemu_core.config.resolved_device``).
        learner_type: the :class:`PPOLearner` class to build (a subclass, e.g. one whose ``step``
            does nothing, measures the ingest path alone).
    """

    def __init__(
        self,
        config: OakEmuConfig,
        spec: EnvSpec,
        schema: StepSchema,
        run_dir: Path,
        *,
        device: str,
        learner_type: type[PPOLearner] = PPOLearner,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.spec = spec
        self.schema = schema
        self.device = device
        torch.manual_seed(config.seed)
        if config.mode == "sync":  # a seed's run reproduces exactly: no nondeterministic kernels
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.learner_model = ThreadSafeModel(self._build_model())
        model = self.learner_model.model
        self.optimizer = build_optimizer(config, model, device)
        self.schedule = LinearSchedule(config.learning_rate, 0.0, 1)
        self._follow_budget()
        # Periodic evaluation in a process of its own (None when eval_every_updates is 0).
        self.tester = tester_from_config(config, schema.to_dict(), run_dir=run_dir)
        self.handshake = RolloutHandshake()
        context = RuntimeContext(
            PPOSettings.from_config(config),
            device=device,
            tester=self.tester,
            eval_every_updates=config.eval_every_updates,
        )
        self.ppo = learner_type(
            context,
            self.learner_model,
            None,  # each update is given its rollout (the trainer thread's PreparedRollout)
            self.optimizer,
            self.schedule,
            bc_sampler=self._bc_sampler(),
            **self._revisions(),
        )
        # A failed write (full disk) is logged with the file and the bytes needed/free, counted and
        # retried at the next checkpoint; max_checkpoint_failures in a row raise CheckpointWriteFailed.
        self.checkpoint_writer = CheckpointWriter(
            run_dir,
            keep_last=config.keep_checkpoints,
            max_consecutive_failures=config.max_checkpoint_failures,
        )
        self.checkpoints = CheckpointPolicy(
            run_dir,
            state_fn=self.checkpoint_state,
            save_fn=self._save,
            health=self._health_monitor(),
            every_updates=config.checkpoint_every_updates,
            every_seconds=config.checkpoint_every_seconds,
            lr_factor=config.rollback_lr_factor,
            max_rollbacks=config.max_rollbacks,
            write_failures=lambda: self.checkpoint_writer.failures,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _build_model(self) -> torch.nn.Module:
        """The actor-critic on :attr:`device` (channels-last convolutions on a CPU: oneDNN's faster
        layout); warns when ``learner_precision`` bfloat16 would be emulated."""
        config, device = self.config, torch.device(self.device)
        assert self.schema.distribution is not None
        model = build_model(
            self.spec.observation_layout,
            self.schema.distribution,
            normalize_observations=config.normalize_observations,
            network=config.network,
        ).to(device)
        if device.type == "cpu" and model.has_convolutions:
            model.use_channels_last()
        if config.learner_precision == "bfloat16":
            if device.type == "cpu" and cpu_has_native_bfloat16() is False:
                log.warning(
                    "learner_precision bfloat16: this CPU has neither AVX512-BF16 nor AMX, so bfloat16 is "
                    "emulated and the update is likely slower than with float32"
                )
            elif device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
                log.warning(
                    "learner_precision bfloat16: GPUs before compute capability 8 (Ampere) emulate "
                    "bfloat16; the update is likely slower than with float32"
                )
        return model

    def _revisions(self) -> dict[str, Any]:
        """The learner's revision keywords: in the asynchronous mode with ``publish_every_epoch``,
        the weights after each epoch go back through the handshake, for the actors."""
        config = self.config
        if config.mode != "async" or not config.publish_every_epoch:
            return {}

        def sink(version: int, revision: int, weights: dict[str, np.ndarray]) -> None:
            self.handshake.complete(WeightsRevision(version, revision, weights))

        return {
            "revision_sink": sink,
            "revision_min_sgd_steps": config.publish_min_sgd_steps,
            "revision_max_approx_kl": config.rollback_max_approx_kl if config.rollback else None,
        }

    def _health_monitor(self) -> HealthMonitor | None:
        """The collapse detector of ``rollback`` (None when rollback is off)."""
        config = self.config
        if not config.rollback:
            return None
        if not config.checkpoint_every_updates and not config.checkpoint_every_seconds:
            log.warning(
                "rollback is on but no checkpoint is written before exit (checkpoint_every_updates "
                "and checkpoint_every_seconds are 0): a collapse before the first evaluation's "
                "best.pt stops the run instead of rolling back"
            )
        log.info(
            "rollback on: a collapsing run returns to its last good checkpoint with the learning rate x %s "
            "(at most %d times; rollback=false turns it off)",
            config.rollback_lr_factor,
            config.max_rollbacks,
        )
        return HealthMonitor(
            max_approx_kl=config.rollback_max_approx_kl,
            eval_fraction=config.rollback_eval_fraction,
            eval_patience=config.rollback_eval_patience,
        )

    def _follow_budget(self) -> None:
        # The schedule keeps its progress but follows this run's budget and learning rate: a resume
        # with a larger --total-env-steps must not continue at the old run's final learning rate 0.
        config = self.config
        self.schedule.start = config.learning_rate
        self.schedule.end = 0.0 if config.anneal_lr else config.learning_rate
        self.schedule.total_updates = max(1, math.ceil(config.total_env_steps / config.batch_size))

    def _bc_sampler(self) -> Any:
        if self.config.bc_dataset is None:
            return None
        from oakemu_core.algo.demonstrations import DemonstrationSampler

        return DemonstrationSampler(self.config.bc_dataset, self.spec)

    # -- state ------------------------------------------------------------------------------
    @property
    def progress(self) -> RunProgress:
        """The run's counters (env steps, episodes) the checkpoints record: those restored, then
        those the ingest thread reports through :attr:`handshake`."""
        return self.handshake.progress

    @property
    def policy_version(self) -> int:
        """Version of the model's current weights."""
        return self.ppo.policy_version

    def weights(self) -> dict[str, np.ndarray]:
        """The current weights as float32 numpy arrays (a consistent snapshot under the model lock)."""
        return self.learner_model.snapshot()[1]

    def restore(self, path: Path) -> dict[str, Any]:
        """Load model, optimizer, schedule, counters and RNG state from a checkpoint file.

        Raises:
            ResumeMismatchError: another env, other spaces or another model; raised before anything
                is loaded or anything in the run folder is written.
        """
        state = load_checkpoint(path, map_location=self.device)
        check_resume_compatible(
            state,
            env_id=self.spec.env_id,
            schema=self.schema,
            model=self.ppo.model,
            checkpoint_path=path,
        )
        self.ppo.load_checkpoint_state(state)
        self.ppo.trained_env_steps = checkpoint_trained_steps(state)
        self._follow_budget()
        restore_rng_state(state["rng"])
        self.handshake.report(RunProgress(int(state["global_step"]), int(state["episodes"])))
        return state

    def resume(self) -> Path | None:
        """Restore from the run folder's latest checkpoint, if any (:meth:`restore`), and cut the
        records of ``metrics.jsonl`` / ``episodes.jsonl`` past it: global_step never goes back in
        them, whatever the number of crashes. Returns the checkpoint, or None for a new run."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return None
        self.restore(path)
        # The checkpointed update's own metrics record stays: charts/update continues without a gap.
        step = resume_step(self.run_dir, self.progress.global_step, self.ppo.iterations)
        self.handshake.report(RunProgress(step, self.progress.episodes))
        log.info("resumed from %s at %d env steps, update %d", path, step, self.ppo.iterations)
        cut = truncate_run_logs(self.run_dir, step, update=self.ppo.iterations)
        if any(cut.values()):
            log.info(
                "removed records past the checkpoint's %d env steps: %s",
                step,
                ", ".join(f"{name} {count}" for name, count in cut.items() if count),
            )
        return path

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a resume needs, as plain values (see :mod:`oakemu_core.run.checkpoint`)."""
        progress = self.progress
        return {
            **self.ppo.checkpoint_state(),
            "rng": capture_rng_state(),
            "global_step": int(progress.global_step),
            "episodes": int(progress.episodes),
            "config": self.config.model_dump(mode="json"),
            "env": {"env_id": self.spec.env_id, "schema": self.schema.to_dict()},
        }

    def _save(self, run_dir: Path, update: int, state: dict[str, Any], final: bool) -> Path | None:
        """None when the write failed (logged, counted); CheckpointWriteFailed after too many in a row
        (never for the final checkpoint, ``final``)."""
        return self.checkpoint_writer.save(update, state, final=final)

    def checkpoint(self) -> Path | None:
        """Write the final checkpoint now (None: not written, logged)."""
        return self.checkpoints.final(self.ppo)

    # -- thread -----------------------------------------------------------------------------
    def start(self, current_step: Callable[[], int]) -> None:
        """Start :func:`~oakemu_core.algo.trainer_thread.run_trainer` in the trainer thread, after
        handing the trainer's counters over to :attr:`handshake` (later results carry them)."""
        self.handshake.report_trainer(
            TrainerCounters(
                self.ppo.iterations, self.ppo.learning_rate, self.checkpoint_writer.failures
            )
        )
        self._thread = threading.Thread(
            target=run_trainer,
            args=(self.ppo, self._stop, current_step, self.handshake, self.checkpoints),
            name="oakemu-trainer",
            daemon=True,
        )
        self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop training: the trainer thread evaluates the final weights, writes the final checkpoint
        (with the counters last reported to :attr:`handshake`) and ends; this waits for it at most
        ``timeout_s`` seconds. Without a thread (never started) the final checkpoint is written here."""
        self._stop.set()
        if self._thread is None:
            self.checkpoint()
        else:
            self._thread.join(timeout_s)

    def close(self) -> None:
        """Stop the tester and release the hand-back pipe, unless the trainer thread still runs (it
        may still write to the pipe: call again once it ended). Idempotent."""
        if self.tester is not None:
            self.tester.close()
        if not self.running:
            self.handshake.close()

    @property
    def running(self) -> bool:
        """The trainer thread is alive (still, after a :meth:`stop` that timed out)."""
        return self._thread is not None and self._thread.is_alive()
