"""The learner's tester: evaluates the newest weights in a process of its own, and keeps ``best.pt``.

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
``keep=True`` (a run's first and final weights). The child exits
when the parent closes it, when the parent dies (it watches its parent pid), and ignores SIGINT
(Ctrl-C reaches the learner, which closes the tester). As with any ``spawn`` child, the parent's
main module is imported again in the child (as ``__mp_main__``): a script that starts a tester
keeps its work under ``if __name__ == "__main__":`` (``oakemu`` and ``python -m oakemu_services.cli`` do).

The learner's loop, in short::

    tester = tester_from_config(cfg, schema.to_dict())   # None when cfg.eval_every_updates == 0
    tester.start()
    best = BestCheckpointTracker(run_dir)
    ...  # after update u:
    if cfg.eval_every_updates and u % cfg.eval_every_updates == 0:
        tester.submit(policy_version, weights_to_arrays(model), global_step)
    for report in tester.poll():
        metrics.log(global_step, evaluation_scalars(report))   # oakemu_core.run.metrics
        history.record_evaluation(report)                      # oakemu_core.run.telemetry.TelemetryHistory
        best.consider(report, checkpoint_state)
    ...  # at the end
    tester.submit(...); reports = tester.drain(timeout_s=...); tester.close()
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

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

BEST_NAME = "best.pt"
"""File name of the best evaluated checkpoint, next to ``latest.pt`` in ``run_dir/checkpoints/``."""

EVAL_SEED_OFFSET = 10_000
"""The tester's seed is ``config.seed + EVAL_SEED_OFFSET``: envs the actors' seeds never reach, and
``oakemu evaluate CKPT --seed <that>`` replays an evaluation exactly (greedy)."""

_START_METHOD = "spawn"
_STOP_TIMEOUT_S = 5.0
_PARENT_WATCH_INTERVAL_S = 0.5


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
        video_path, video_error, video_preview: the first episode's MP4, why it is missing, its
            preview for TensorBoard (:func:`oakemu_core.run.video.video_fields`); None when videos are off.
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
    weights: Mapping[str, np.ndarray] | None = field(default=None, compare=False, repr=False)

    @property
    def mean_return(self) -> float:
        """Alias of :attr:`return_mean`."""
        return self.return_mean

    @property
    def std_return(self) -> float:
        """Alias of :attr:`return_std`."""
        return self.return_std


# ------------------------------------------------------------------------------------ child process
def _watch_parent(parent_pid: int) -> None:
    """Exit the tester process at once when its parent is gone (killed -9 mid-evaluation)."""
    while True:
        time.sleep(_PARENT_WATCH_INTERVAL_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def _child_main(conn: multiprocessing.connection.Connection, parent_pid: int, options: dict[str, Any]) -> None:
    """The tester process: build once to check the settings, then evaluate what arrives on ``conn``.

    Messages in: ``("evaluate", policy_version, global_step, weights)`` or ``("stop",)``.
    Messages out: ``("ready",)``, ``("report", dict)``, ``("error", policy_version | None, text)``.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's business; it closes us
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="tester-parent-watch").start()
    import torch  # the parent has already niced this process (Tester.start)

    from oakemu_core.run.evaluation import build_evaluation

    torch.set_num_threads(1)
    episodes, greedy, seed = options.pop("episodes"), options.pop("greedy"), options.pop("seed")
    env_id, schema_dict = options.pop("env_id"), options.pop("schema_dict")
    video_dir = options.pop("video_dir")

    def build(frame_sink: Any = None) -> tuple[Any, Any]:
        return build_evaluation(env_id, schema_dict, seed=seed, frame_sink=frame_sink, **options)

    try:
        _serve(conn, build, episodes=episodes, greedy=greedy, video_dir=video_dir)
    finally:
        import gc

        gc.freeze()  # skip collecting torch's modules at exit (about 1 s of CPU the learner waits for)


def _serve(conn: multiprocessing.connection.Connection, build: Callable[..., tuple[Any, Any]], *,
           episodes: int, greedy: bool, video_dir: str | None) -> None:
    """The tester process's loop: check the settings once, then evaluate what arrives on ``conn``
    (recording the first episode of each evaluation into ``video_dir`` unless it is None)."""
    from oakemu_core.run.evaluation import play_episodes
    from oakemu_core.run.video import evaluation_videos, video_fields
    from oakemu_core.policy.models import load_weight_arrays

    try:
        _, env = build()  # fail fast on a bad env id, schema or settings file
        env.close()
    except Exception as exc:
        conn.send(("error", None, f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] != "evaluate":
            return
        _, policy_version, global_step, weights = message
        started = time.perf_counter()
        videos = None
        try:
            videos = evaluation_videos(video_dir, policy_version)
            model, env = build(videos)
            try:
                load_weight_arrays(model, weights)
                result = play_episodes(model, env, episodes=episodes, greedy=greedy)
            finally:
                env.close()
        except Exception as exc:
            if videos is not None:
                videos.close()
            conn.send(("error", policy_version, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            continue
        conn.send(("report", {
            "policy_version": policy_version,
            "global_step": global_step,
            "episodes": len(result.returns),
            "return_mean": result.mean,
            "return_std": result.std,
            "length_mean": float(np.mean(result.lengths)),
            "returns": tuple(float(r) for r in result.returns),
            "lengths": tuple(int(n) for n in result.lengths),
            "greedy": bool(greedy),
            "wall_seconds": time.perf_counter() - started,
            "finished_at": time.time(),
            **video_fields(videos),
        }))


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
        video_dir: record the first episode of every evaluation as ``video_dir/update_<policy
            version>.mp4`` (:mod:`oakemu_core.run.video`; needs the ``video`` extra); None: no videos.
        nice: niceness added to the tester process (0..19) so it yields the CPU to training.

    Raises:
        ValueError: ``episodes`` < 1 or ``nice`` outside 0..19.
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
        nice: int = 10,
        env_options: Any = None,  # an oakemu_core.envs.options.EnvOptions: gymnasium.make kwargs, Atari settings
    ) -> None:
        if int(episodes) < 1:
            raise ValueError(f"episodes: expected >= 1, received {episodes}")
        if not 0 <= int(nice) <= 19:
            raise ValueError(f"nice: expected 0..19, received {nice}")
        self.env_id = env_id
        self.episodes = int(episodes)
        self.greedy = bool(greedy)
        self.seed = int(seed)
        self._options: dict[str, Any] = {
            "env_id": env_id, "schema_dict": dict(schema_dict), "episodes": self.episodes,
            "greedy": self.greedy, "seed": self.seed, "settings_file": settings_file,
            "max_episode_steps": max_episode_steps, "normalize_observations": bool(normalize_observations),
            "env_options": env_options,
            "video_dir": None if video_dir is None else str(video_dir),
        }
        self._nice = int(nice)
        self._lock = threading.Lock()
        # Waiting jobs ``(policy_version, global_step, weights, keep)``, oldest first: any number of
        # kept ones and at most one that a newer submission replaces.
        self._pending: list[tuple[int, int, Mapping[str, np.ndarray], bool]] = []
        self._in_flight: tuple[int, int, Mapping[str, np.ndarray], bool] | None = None
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

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the tester process and its feeder thread; returns at once (the process imports
        torch and builds a first env in the background; a failure there shows in
        :attr:`last_error` and :attr:`alive`).

        Raises:
            TesterError: already started, or closed.
        """
        if self._started or self._closed:
            raise TesterError("Tester.start(): already started" if self._started else "Tester.start(): closed")
        self._started = True
        context = multiprocessing.get_context(_START_METHOD)
        parent_conn, child_conn = context.Pipe(duplex=True)
        niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + self._nice)
        try:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._process = context.Process(
                target=_child_main, args=(child_conn, os.getpid(), dict(self._options)),
                name=f"oakemu-tester-{self.env_id}", daemon=True,
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
        return bool(self._started and not self._closed and self._process is not None
                    and self._process.is_alive() and self._thread is not None and self._thread.is_alive())

    @property
    def pid(self) -> int | None:
        """The tester process's pid (None before :meth:`start`)."""
        return self._pid

    @property
    def evaluating(self) -> int | None:
        """Policy version being evaluated now (handed to the process), or None."""
        with self._lock:
            return None if self._in_flight is None else self._in_flight[0]

    @property
    def pending(self) -> int | None:
        """Newest policy version waiting for the process, or None."""
        with self._lock:
            return self._pending[-1][0] if self._pending else None

    @property
    def ready(self) -> bool:
        """True once the process has started and built its first env (evaluations can run)."""
        with self._lock:
            return self._ready

    @property
    def busy(self) -> bool:
        """True while an evaluation runs or weights wait for one."""
        with self._lock:
            return self._in_flight is not None or bool(self._pending)

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
        process = self._process
        if process is not None:
            if self._conn is not None:
                try:
                    self._conn.send(("stop",))
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
    def submit(self, policy_version: int, weights: dict[str, np.ndarray], global_step: int, *,
               keep: bool = False) -> bool:
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
            if self._pending and not self._pending[-1][3]:
                self._pending.pop()
                self.superseded += 1
            self._pending.append((int(policy_version), int(global_step), weights, bool(keep)))
            self.submitted += 1
        self._wake()
        return True

    def poll(self) -> list[EvaluationReport]:
        """Finished reports since the last call, oldest first (never blocks)."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports

    def drain(self, timeout_s: float) -> list[EvaluationReport]:
        """Wait until nothing is running or waiting (or ``timeout_s`` seconds passed, or the process
        died), then return :meth:`poll`'s reports. For the final evaluation and tests."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            while (self._in_flight is not None or self._pending) and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.alive:
                    break
                self._idle.wait(min(remaining, 0.2))
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
                    job = None
                    if self._ready and self._in_flight is None and self._pending:
                        job = self._in_flight = self._pending.pop(0)
                if job is not None:
                    conn.send(("evaluate", job[0], job[1], dict(job[2])))
                ready = multiprocessing.connection.wait([conn, sentinel, self._wake_r])
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if conn in ready:
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        message = None
                    if message is None:
                        if not self._start_failed:  # keep the start error: it says why
                            self._fail(f"tester process {self._process.pid} closed its pipe (exit code "
                                       f"{self._process.exitcode})")
                        return
                    self._handle(message)
                elif sentinel in ready:
                    self._process.join(1.0)  # the exit code is set once it is reaped
                    if not self._start_failed:
                        self._fail(f"tester process {self._process.pid} exited with code {self._process.exitcode}")
                    return
        except (OSError, ValueError, BrokenPipeError) as exc:
            if not self._closing:
                self._fail(f"tester feeder stopped: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._idle.notify_all()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        with self._lock:
            if kind == "ready":
                self._ready = True
                return
            in_flight, self._in_flight = self._in_flight, None
            if kind == "report":
                values = dict(message[1])
                if values.get("video_error") and not self.video_failed:
                    logger.warning("tester: no evaluation video: %s", values["video_error"])
                self.video_failed += bool(values.get("video_error"))
                weights = in_flight[2] if in_flight is not None and in_flight[0] == values["policy_version"] else None
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


# ------------------------------------------------------------------------------------ best.pt
class BestCheckpointTracker:
    """Keeps ``run_dir/checkpoints/best.pt``: the checkpoint of the best evaluation so far.

    :meth:`consider` writes ``best.pt`` (atomically, :func:`oakemu_core.run.checkpoint.save_checkpoint`)
    only when a report's mean return is finite and strictly above the best so far. The file is the
    learner's usual checkpoint dict (``state_fn()``) with two changes: ``state["model"]`` holds the
    *evaluated* weights (the report's, cast to the dtypes of ``state["model"]``), not the newer ones
    the learner trained since, and ``state["best_evaluation"]`` records the evaluation (policy
    version, global step, mean/std return, mean length, episodes, greedy). The optimizer and
    counters in it are those of the moment of writing: best.pt is for ``oakemu evaluate`` and
    deployment, ``latest.pt`` for resuming. ``oakemu evaluate run/checkpoints/best.pt`` works.

    Args:
        run_dir: the run folder.
        best_return: the best mean return so far; None reads it from an existing ``best.pt``
            (its ``best_evaluation``), else starts at minus infinity.
    """

    def __init__(self, run_dir: Path, *, best_return: float | None = None) -> None:
        from oakemu_core.run.checkpoint import CHECKPOINT_DIR_NAME

        self.path = Path(run_dir) / CHECKPOINT_DIR_NAME / BEST_NAME
        """Where best.pt lives."""
        self.best_return = -math.inf if best_return is None else float(best_return)
        """Mean return of the evaluation in best.pt (-inf before the first)."""
        self.best_policy_version: int | None = None
        """Policy version of the weights in best.pt (None before the first, or unknown)."""
        if best_return is None and self.path.is_file():
            self._read_existing()

    def _read_existing(self) -> None:
        from oakemu_core.run.checkpoint import CheckpointError, load_checkpoint

        try:
            info = load_checkpoint(self.path).get("best_evaluation") or {}
        except (CheckpointError, OSError) as exc:
            logger.warning("best checkpoint %s is unreadable (%s); the next evaluation replaces it", self.path, exc)
            return
        value = info.get("return_mean")
        if isinstance(value, (int, float)) and math.isfinite(value):
            self.best_return = float(value)
            self.best_policy_version = info.get("policy_version")

    def consider(self, report: EvaluationReport, state_fn: Callable[[], dict[str, Any]]) -> bool:
        """Write ``best.pt`` when ``report`` beats the best so far.

        Args:
            report: a finished evaluation (its ``weights`` replace ``state["model"]`` when present).
            state_fn: returns the learner's checkpoint dict (``model``, ``optimizer``, ``env``,
                ``config``, ...); called only when the report is better.

        Returns:
            True when best.pt was written.

        Raises:
            ValueError: the report's weights do not fit ``state["model"]`` (names or shapes); nothing
                is written. TypeError/OSError as :func:`oakemu_core.run.checkpoint.save_checkpoint`
                (the previous best.pt stays; the best so far is unchanged).
        """
        from oakemu_core.run.checkpoint import save_checkpoint

        mean = float(report.return_mean)
        if not math.isfinite(mean) or mean <= self.best_return:
            return False
        state = dict(state_fn())
        if report.weights is not None:
            state["model"] = _weights_as_state_dict(report.weights, state.get("model"))
        state["best_evaluation"] = {
            "policy_version": int(report.policy_version),
            "global_step": int(report.global_step),
            "return_mean": mean,
            "return_std": float(report.return_std),
            "length_mean": float(report.length_mean),
            "episodes": int(report.episodes),
            "greedy": bool(report.greedy),
            "finished_at": float(report.finished_at),
        }
        save_checkpoint(self.path, state)
        self.best_return = mean
        self.best_policy_version = int(report.policy_version)
        return True

    def state_dict(self) -> dict[str, Any]:
        """Plain values for the learner's checkpoint (``best_return`` is None before the first)."""
        return {"best_return": None if math.isinf(self.best_return) else self.best_return,
                "best_policy_version": self.best_policy_version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s values (a resumed run only replaces best.pt when it improves)."""
        value = state.get("best_return")
        self.best_return = -math.inf if value is None else float(value)
        self.best_policy_version = state.get("best_policy_version")


def _weights_as_state_dict(weights: Mapping[str, np.ndarray], model_state: Any) -> dict[str, Any]:
    import torch

    if isinstance(model_state, Mapping):
        missing, extra = sorted(set(model_state) - set(weights)), sorted(set(weights) - set(model_state))
        if missing or extra:
            raise ValueError(f"best checkpoint: evaluated weights do not fit the model: missing {missing}, "
                             f"unexpected {extra}")
    result: dict[str, Any] = {}
    for name, array in weights.items():
        tensor = torch.from_numpy(np.array(array, copy=True))
        if isinstance(model_state, Mapping):
            reference = model_state[name]
            if tuple(reference.shape) != tuple(tensor.shape):
                raise ValueError(f"best checkpoint: weights[{name!r}] has shape {tuple(tensor.shape)}, the model "
                                 f"{tuple(reference.shape)}")
            tensor = tensor.to(reference.dtype)
        result[name] = tensor
    return result


def tester_from_config(config: Any, schema_dict: Mapping[str, Any], *, run_dir: Path | None = None) -> Tester | None:
    """The run's tester (not started) from an :class:`oakemu_core.config.OakEmuConfig`, or None
    when evaluation is off (``eval_every_updates == 0``).

    Settings used: ``env_id``, ``eval_episodes``, ``eval_greedy`` (resolved), ``seed`` (+ :data:`EVAL_SEED_OFFSET`),
    ``emulator_settings``, ``max_episode_steps``, ``normalize_observations``, ``eval_video`` (videos
    go to ``run_dir/videos/``; none without ``run_dir``, or, with a warning, without the ``video`` extra).
    """
    from oakemu_core.run.video import run_video_dir

    if not config.eval_every_updates:
        return None
    video_dir = run_video_dir(run_dir) if getattr(config, "eval_video", False) and run_dir is not None else None
    return Tester(config.env_id, episodes=config.eval_episodes, greedy=config.resolved_eval_greedy,
                  seed=config.seed + EVAL_SEED_OFFSET, settings_file=config.emulator_settings,
                  max_episode_steps=config.max_episode_steps,
                  normalize_observations=config.normalize_observations, schema_dict=schema_dict, video_dir=video_dir,
                  env_options=config.env_options)
