"""The learner's tester: evaluates the newest weights in a process of its own, paced, with videos.

:class:`Tester` plays whole episodes with submitted weights on dedicated envs that never feed the
rollout buffer (one env without reward clipping, so returns are the raw game score), through the
same code path as ``oakemu evaluate``: :func:`oakemu_core.run.evaluation.build_evaluation` (model and
env, seeded anew for every evaluation) + :func:`oakemu_core.policy.models.load_weight_arrays` +
:func:`oakemu_core.run.evaluation.play_episodes`.

Process model. The evaluation runs in a child process started with the ``spawn`` context (torch in
a forked child of a threaded parent is unsafe), niced and limited to one torch thread, so training
never waits for it. In the parent one small feeder thread hands weights to the child when it is
idle and collects its reports; :meth:`Tester.submit` and :meth:`Tester.poll` only take a lock.
A submit while an evaluation runs replaces the newest waiting set (the newest weights win, the
replaced set is counted in :attr:`Tester.superseded`) unless that set was submitted with
``keep=True`` (a run's first and final weights). The child (:mod:`oakemu_core.run.tester_process`)
exits when the parent closes it, when the parent dies (it watches its parent pid), and ignores SIGINT
(Ctrl-C reaches the learner, which closes the tester). As with any ``spawn`` child, the parent's
main module is imported again in the child (as ``__mp_main__``): a script that starts a tester
keeps its work under ``if __name__ == "__main__":`` (``oakemu`` and ``python -m oakemu_services.cli`` do).

Pacing. Periodic evaluations take CPU from training (measured in docs/benchmarks.md, "Paced evaluation,
best and final videos"), so a plain (not kept) submission waits until the tester has been idle long
enough: an evaluation that took ``s`` seconds (hand-off to report) lets the next one start
``s / max_share`` seconds after it started, so the tester is busy at most ``max_share`` of the wall
time. Weights submitted meanwhile replace the waiting set, as above. Kept weights and everything
waiting when :meth:`Tester.drain` is called (the final evaluation) start at once.

Videos (``video_dir``): ``update_<policy version>.mp4`` of every ``video_every``-th evaluation handed
to the child (the first included), ``best.mp4`` of the best one so far and ``final.mp4`` of the last
one, which :meth:`Tester.drain` asks for (:mod:`oakemu_core.run.tester_process`).

The learner's loop, in short::

    tester = tester_from_config(cfg, schema.to_dict(), run_dir=run_dir)   # None: eval_every_updates == 0
    tester.start()
    best = BestCheckpointTracker(run_dir)   # oakemu_core.run.best_checkpoint
    ...  # after update u:
    if cfg.eval_every_updates and u % cfg.eval_every_updates == 0:
        tester.submit(policy_version, weights_to_arrays(model), global_step)
    for report in tester.poll():
        metrics.log(global_step, evaluation_scalars(report))   # oakemu_core.run.metrics
        history.record_evaluation(report)                      # oakemu_core.run.telemetry.TelemetryHistory
        best.consider(report, checkpoint_state)
    ...  # at the end
    tester.submit(..., keep=True); reports = tester.drain(timeout_s=...); tester.close()
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from oakemu_core.run.best_checkpoint import BEST_NAME, BestCheckpointTracker
from oakemu_core.run.evaluation_queue import EvaluationJob, EvaluationQueue
from oakemu_core.run.tester_process import child_main

__all__ = [
    "BEST_NAME",
    "BestCheckpointTracker",
    "EvaluationReport",
    "Tester",
    "TesterError",
    "EVAL_SEED_OFFSET",
    "tester_from_config",
]

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 10_000
"""The tester's seed is ``config.seed + EVAL_SEED_OFFSET``: envs the actors' seeds never reach, and
``oakemu evaluate CKPT --seed <that>`` replays an evaluation exactly (greedy)."""

_START_METHOD = "spawn"
_STOP_TIMEOUT_S = 5.0


class TesterError(RuntimeError):
    """The tester cannot be used (not started, closed, or its process failed)."""


@dataclass(frozen=True)
class EvaluationReport:
    """The result of evaluating one set of weights.

    Attributes:
        policy_version: the version of the evaluated weights (as submitted).
        global_step: env steps of the run when the weights were submitted (as submitted).
        episodes: episodes played (= the tester's ``episodes``).
        return_mean: mean raw (unclipped) episodic return over those episodes.
        return_std: population std (ddof 0) of the returns.
        length_mean: mean episode length in agent steps (after frame skip).
        returns: the raw episodic returns, in the order the episodes finished.
        lengths: their lengths (agent steps).
        greedy: whether actions were the distribution's mode (else sampled).
        wall_seconds: wall-clock seconds the evaluation took in the tester process (build + play).
        finished_at: unix time (s) at which the tester process finished it.
        video_path, video_error, video_preview: the MP4 of the first episode that this evaluation
            recorded (``update_<N>.mp4``, ``final.mp4`` or ``best.mp4``), why a video is missing, its
            preview for TensorBoard; None when no video was due or videos are off.
        videos: every video file this evaluation wrote (e.g. ``update_<N>.mp4`` and ``best.mp4``).
        weights: the evaluated weights (parent side only, never compared or printed), so
            :class:`BestCheckpointTracker` saves exactly what was evaluated.
    """

    policy_version: int
    global_step: int
    episodes: int
    return_mean: float
    return_std: float
    length_mean: float
    returns: tuple[float, ...]
    lengths: tuple[int, ...]
    greedy: bool
    wall_seconds: float
    finished_at: float
    video_path: str | None = None
    video_error: str | None = None
    video_preview: Any = field(default=None, compare=False, repr=False)
    videos: tuple[str, ...] = ()
    weights: Mapping[str, np.ndarray] | None = field(default=None, compare=False, repr=False)

    @property
    def mean_return(self) -> float:
        """Alias of :attr:`return_mean`."""
        return self.return_mean

    @property
    def std_return(self) -> float:
        """Alias of :attr:`return_std`."""
        return self.return_std


# ------------------------------------------------------------------------------------ parent side
class Tester:
    """Evaluates the newest submitted weights in a process of its own; never blocks the caller.

    Args:
        env_id: the run's env id (a dedicated env is built for every evaluation).
        episodes: episodes per evaluation (>= 1).
        greedy: act with the distribution's mode (True) or sample (False).
        seed: env and torch seed of every evaluation (the same seed plays the same episodes: two
            evaluations of the same weights give identical greedy returns). Use a seed the actors'
            envs do not use (e.g. ``config.seed + 10_000``).
        settings_file: emulator settings file (``config.emulator_settings``), or None.
        max_episode_steps: time limit in agent steps (``config.max_episode_steps``); None keeps
            the env's own.
        normalize_observations: the run's ``normalize_observations`` (the model layout must match
            the submitted weights).
        schema_dict: the run's step schema, ``StepSchema.to_dict()``.
        video_dir: folder of the evaluation videos (``best.mp4``, ``final.mp4``, ``update_<policy
            version>.mp4``; :mod:`oakemu_core.run.video`, needs the ``video`` extra); None: no videos.
        video_every: also record every this-many-th evaluation as ``update_<policy version>.mp4``,
            the first one included (0: only ``best.mp4`` and ``final.mp4``).
        max_share: pace plain submissions so the tester is busy at most this share of the wall time,
            in (0, 1] (1: the next evaluation starts as soon as the last one ends); see the module docstring.
        best_return: the best mean evaluation return so far (a resumed run's ``best.pt``): ``best.mp4``
            is replaced only by a better one. None: no evaluation yet.
        nice: niceness added to the tester process (0..19) so it yields the CPU to training.

    Raises:
        ValueError: ``episodes`` < 1, ``video_every`` < 0, ``max_share`` outside (0, 1] or ``nice``
            outside 0..19.
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self,
        env_id: str,
        *,
        episodes: int,
        greedy: bool,
        seed: int,
        settings_file: str | None = None,
        max_episode_steps: int | None = None,
        normalize_observations: bool = False,
        schema_dict: Mapping[str, Any],
        video_dir: Path | str | None = None,
        video_every: int = 1,
        max_share: float = 1.0,
        best_return: float | None = None,
        nice: int = 10,
        env_options: Any = None,  # an oakemu_core.envs.options.EnvOptions: gymnasium.make kwargs, Atari settings
        network: Mapping[str, Any] | None = None,  # the run's NetworkSpec.to_dict()
    ) -> None:
        if int(episodes) < 1:
            raise ValueError(f"episodes: expected >= 1, received {episodes}")
        if int(video_every) < 0:
            raise ValueError(f"video_every: expected >= 0, received {video_every}")
        if not 0.0 < float(max_share) <= 1.0:
            raise ValueError(f"max_share: expected a share in (0, 1], received {max_share}")
        if not 0 <= int(nice) <= 19:
            raise ValueError(f"nice: expected 0..19, received {nice}")
        self.env_id = env_id
        self.episodes = int(episodes)
        self.greedy = bool(greedy)
        self.seed = int(seed)
        self._options: dict[str, Any] = {
            "env_id": env_id,
            "schema_dict": dict(schema_dict),
            "episodes": self.episodes,
            "greedy": self.greedy,
            "seed": self.seed,
            "settings_file": settings_file,
            "max_episode_steps": max_episode_steps,
            "normalize_observations": bool(normalize_observations),
            "env_options": env_options,
            "network": dict(network or {}),
            "best_return": None if best_return is None else float(best_return),
            "video_dir": None if video_dir is None else str(video_dir),
        }
        self._nice = int(nice)
        self._lock = threading.Lock()
        self._queue = EvaluationQueue(  # under self._lock
            videos=video_dir is not None, video_every=int(video_every), max_share=float(max_share)
        )
        self._reports: list[EvaluationReport] = []
        self._idle = threading.Condition(self._lock)
        self._ready = False
        self._start_failed = False
        self._process: Any = None
        self._pid: int | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._started = False
        self._closing = False
        self._closed = False
        self.last_error: str | None = None
        """Why the last evaluation (or the process start) failed; None when none failed."""
        self.submitted = 0
        """Weights accepted by :meth:`submit`."""
        self.superseded = 0
        """Accepted weights replaced by newer ones before the process was free (never evaluated)."""
        self.completed = 0
        """Evaluations finished (reports produced)."""
        self.failed = 0
        """Evaluations that raised in the tester process (see :attr:`last_error`)."""
        self.video_failed = 0
        """Evaluations without their video although videos are on (the first reason is logged)."""
        self.final_video: str | None = None
        """``final.mp4`` once :meth:`drain` made it (None before, without videos, or when it failed)."""

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the tester process and its feeder thread; returns at once (the process imports
        torch and builds a first env in the background; a failure there shows in
        :attr:`last_error` and :attr:`alive`).

        Raises:
            TesterError: already started, or closed.
        """
        if self._started or self._closed:
            raise TesterError(
                "Tester.start(): already started" if self._started else "Tester.start(): closed"
            )
        self._started = True
        context = multiprocessing.get_context(_START_METHOD)
        parent_conn, child_conn = context.Pipe(duplex=True)
        niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + self._nice)
        try:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._process = context.Process(
                target=child_main,
                args=(child_conn, os.getpid(), dict(self._options)),
                name=f"oakemu-tester-{self.env_id}",
                daemon=True,
            )
            self._process.start()
            self._pid = self._process.pid
            try:  # at once, so the child's torch import (seconds of CPU) already yields to training
                os.setpriority(os.PRIO_PROCESS, self._pid, niceness)
            except OSError:
                pass
        except BaseException:
            parent_conn.close()
            child_conn.close()
            self._closed = True
            self._close_wake_pipe()
            raise
        child_conn.close()
        self._conn = parent_conn
        self._thread = threading.Thread(target=self._feed, name="oakemu-tester-feeder", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the tester process runs and has not failed to start."""
        return bool(
            self._started
            and not self._closed
            and self._process is not None
            and self._process.is_alive()
            and self._thread is not None
            and self._thread.is_alive()
        )

    @property
    def pid(self) -> int | None:
        """The tester process's pid (None before :meth:`start`)."""
        return self._pid

    @property
    def evaluating(self) -> int | None:
        """Policy version being evaluated now (handed to the process), or None."""
        with self._lock:
            job = self._queue.in_flight
            return None if job is None else job.policy_version

    @property
    def pending(self) -> int | None:
        """Newest policy version waiting for the process, or None."""
        with self._lock:
            pending = self._queue.pending
            return pending[-1].policy_version if pending else None

    @property
    def ready(self) -> bool:
        """True once the process has started and built its first env (evaluations can run)."""
        with self._lock:
            return self._ready

    @property
    def busy(self) -> bool:
        """True while an evaluation runs or weights wait for one."""
        with self._lock:
            return self._queue.busy

    def close(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        """Stop the feeder thread and the tester process (asked, then terminated, then killed),
        dropping a running evaluation. Idempotent; safe after errors and before :meth:`start`."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._closing = True
            self._idle.notify_all()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._process is not None:
            _stop_process(self._process, self._conn, timeout_s)
        if self._conn is not None:
            self._conn.close()
        self._close_wake_pipe()

    def __enter__(self) -> Tester:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; close() is the contract
        try:
            self.close(timeout_s=1.0)
        except Exception:
            pass

    # -- learner-facing calls ------------------------------------------------------------------
    def submit(
        self,
        policy_version: int,
        weights: dict[str, np.ndarray],
        global_step: int,
        *,
        keep: bool = False,
    ) -> bool:
        """Ask for an evaluation of ``weights``; returns at once (a lock and a one-byte write).

        The weights are kept by reference until evaluated: pass a snapshot that is not changed
        later (``weights_to_arrays`` returns copies). When an evaluation is running, these weights
        replace the newest set already waiting unless that set was submitted with ``keep``.

        Args:
            policy_version: the version the learner published these weights as.
            weights: ``{name: float32 array}`` as from :func:`oakemu_core.policy.models.weights_to_arrays`.
            global_step: env steps of the run now (carried into the report).
            keep: never replace this set by a newer one (the first weights of a run, e.g. the
                behaviour-cloned ones, and the final weights are evaluated whatever comes after).

        Returns:
            True when accepted; False when the tester is not running (not started, closed, or its
            process failed: see :attr:`last_error`), in which case nothing is evaluated.
        """
        if not self.alive:
            return False
        with self._lock:
            job = EvaluationJob(int(policy_version), int(global_step), weights, bool(keep))
            self.superseded += self._queue.submit(job)
            self.submitted += 1
        self._wake()
        return True

    def poll(self) -> list[EvaluationReport]:
        """Finished reports since the last call, oldest first (never blocks)."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports

    def drain(self, timeout_s: float) -> list[EvaluationReport]:
        """The final evaluation: start what waits at once (no pacing), then, with videos, make the last
        evaluation's ``final.mp4`` (:attr:`final_video`); wait until all that is done (or ``timeout_s``
        seconds passed, or the process died) and return :meth:`poll`'s reports. Submissions after it
        are paced again."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            self._queue.start_drain()
        self._wake()
        with self._lock:
            while self._queue.unfinished and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.alive:
                    break
                self._idle.wait(min(remaining, 0.2))
            self._queue.end_drain()
        return self.poll()

    # -- feeder thread -------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # pipe full (already woken) or closed
            pass

    def _close_wake_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1

    def _fail(self, message: str) -> None:
        self.last_error = message
        logger.error("tester: %s", message)

    def _feed(self) -> None:
        """Send waiting weights to the idle child; collect its messages; stop on close or death."""
        assert self._conn is not None and self._process is not None
        conn, sentinel = self._conn, self._process.sentinel
        try:
            while True:
                with self._lock:
                    if self._closing:
                        return
                    message, wait_s = self._next_message()
                if message is not None:
                    conn.send(message)
                ready = multiprocessing.connection.wait([conn, sentinel, self._wake_r], wait_s)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if conn in ready:
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        message = None
                    if message is None:
                        if not self._start_failed:  # keep the start error: it says why
                            self._fail(
                                f"tester process {self._process.pid} closed its pipe (exit code "
                                f"{self._process.exitcode})"
                            )
                        return
                    self._handle(message)
                elif sentinel in ready:
                    self._process.join(1.0)  # the exit code is set once it is reaped
                    if not self._start_failed:
                        self._fail(
                            f"tester process {self._process.pid} exited with code {self._process.exitcode}"
                        )
                    return
        except (OSError, ValueError, BrokenPipeError) as exc:
            if not self._closing:
                self._fail(f"tester feeder stopped: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._idle.notify_all()

    def _next_message(self) -> tuple[tuple[Any, ...] | None, float | None]:
        """What to send the child now (under the lock), and how long to wait at most before asking again
        (None: until woken): a waiting job when the child is idle and pacing allows it, else ``final.mp4``
        when :meth:`drain` wants it and nothing waits (:meth:`EvaluationQueue.next_message`)."""
        if not self._ready:
            return None, None
        return self._queue.next_message(time.monotonic())

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        with self._lock:
            if kind == "ready":
                self._ready = True
                return
            if kind == "final_video":
                self._queue.final_video_made()
                self.final_video = message[1]
                if message[2]:
                    logger.warning("tester: no final video: %s", message[2])
                self._idle.notify_all()
                return
            in_flight = self._queue.finished(time.monotonic())  # paces the next evaluation
            if kind == "report":
                values = dict(message[1])
                if values.get("video_error") and not self.video_failed:
                    logger.warning("tester: no evaluation video: %s", values["video_error"])
                self.video_failed += bool(values.get("video_error"))
                weights = (
                    in_flight.weights
                    if in_flight is not None
                    and in_flight.policy_version == values["policy_version"]
                    else None
                )
                self._reports.append(EvaluationReport(**values, weights=weights))
                self.completed += 1
            elif kind == "error":
                version, text = message[1], message[2]
                if version is None:
                    self._start_failed = True
                    self._fail(f"tester cannot start for env {self.env_id!r}: {text}")
                else:
                    self.failed += 1
                    self._fail(f"evaluation of policy version {version} failed: {text}")
            self._idle.notify_all()


def _stop_process(process: Any, conn: Any, timeout_s: float) -> None:
    """Stop the tester's child: asked over ``conn`` (None: not asked), then terminated, then killed,
    each given ``timeout_s`` (the ask at most 1 s); then release its resources."""
    if conn is not None:
        try:
            conn.send(("stop",))
        except (OSError, ValueError, BrokenPipeError):
            pass
    process.join(min(1.0, timeout_s))
    if process.is_alive():
        process.terminate()
        process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join(timeout_s)
    try:
        process.close()
    except ValueError:  # still running after kill: nothing more to do from here
        logger.warning("tester process %s did not exit after SIGKILL", process.pid)


def tester_from_config(
    config: Any, schema_dict: Mapping[str, Any], *, run_dir: Path | None = None
) -> Tester | None:
    """The run's tester (not started) from an :class:`oakemu_core.config.OakEmuConfig`, or None
    when evaluation is off (``eval_every_updates == 0``).

    Settings used: ``env_id``, ``eval_episodes``, ``eval_greedy`` (resolved), ``seed`` (+ :data:`EVAL_SEED_OFFSET`),
    ``emulator_settings``, ``max_episode_steps``, ``normalize_observations``, ``eval_max_share``, ``eval_video``
    (videos go to ``run_dir/videos/``; none without ``run_dir``, or, with a warning, without the ``video``
    extra) and ``eval_video_every``. A resumed run's ``best.pt`` gives the best return so far.
    """
    from oakemu_core.run.video import run_video_dir

    if not config.eval_every_updates:
        return None
    video_dir = (
        run_video_dir(run_dir)
        if getattr(config, "eval_video", False) and run_dir is not None
        else None
    )
    best = (
        BestCheckpointTracker(run_dir).state_dict()["best_return"]
        if video_dir is not None
        else None
    )
    return Tester(
        config.env_id,
        episodes=config.eval_episodes,
        greedy=config.resolved_eval_greedy,
        seed=config.seed + EVAL_SEED_OFFSET,
        settings_file=config.emulator_settings,
        max_episode_steps=config.max_episode_steps,
        normalize_observations=config.normalize_observations,
        schema_dict=schema_dict,
        video_dir=video_dir,
        video_every=config.eval_video_every,
        max_share=config.eval_max_share,
        best_return=best,
        env_options=config.env_options,
        network=config.network.to_dict(),
    )
