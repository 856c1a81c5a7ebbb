"""The tester's own process: evaluates the weights that :class:`oakemu_core.run.tester.Tester` sends, and
records the run's evaluation videos.

Messages in: ``("evaluate", policy_version, global_step, weights, record)`` with ``record`` None (no video
of this evaluation), ``"update"`` (``update_<policy version>.mp4``) or ``"final"`` (``final.mp4``);
``("final_video",)``; ``("stop",)``. Messages out: ``("ready",)``, ``("report", dict)``,
``("error", policy_version | None, text)``, ``("final_video", path | None, error | None)``.

Videos (``video_dir`` not None; :mod:`oakemu_core.run.video`), each the first episode of one evaluation:

* ``update_<policy version>.mp4``: evaluations the parent asks to record (every K-th, ``eval_video_every``);
* ``best.mp4``: the evaluation whose mean return is a new best (the rule of ``best.pt``,
  :func:`oakemu_core.run.best_checkpoint.is_new_best`), replaced by each better one;
* ``final.mp4``: the last evaluation (``record="final"``, or ``("final_video",)`` after it), without a
  TensorBoard preview (the run waits for this video; docs/benchmarks.md gives the encoding time saved).

An evaluation recorded anyway gives its file to ``best.mp4`` / ``final.mp4`` by copy; else its first
episode is played again with a recorder: the evaluation is built anew with the same seed
(:func:`oakemu_core.run.evaluation.build_evaluation` seeds torch and the env), so the replay is that
same episode, greedy or sampled, for one episode's time. A video that cannot be made leaves the
evaluation's result as it is (``video_error`` says why).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["child_main"]

_PARENT_WATCH_INTERVAL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    """Exit the tester process at once when its parent is gone (killed -9 mid-evaluation)."""
    while True:
        time.sleep(_PARENT_WATCH_INTERVAL_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def child_main(
    conn: multiprocessing.connection.Connection, parent_pid: int, options: dict[str, Any]
) -> None:
    """The tester process's entry point: build once to check the settings, then evaluate what
    arrives on ``conn`` (the module docstring's messages) until ``("stop",)`` or the pipe closes.

    ``options``: ``episodes``, ``greedy``, ``seed``, ``env_id``, ``schema_dict``, ``video_dir`` (str or
    None), ``best_return`` (the best mean return so far, None before any) and the other keyword
    arguments of :func:`oakemu_core.run.evaluation.build_evaluation`.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's business; it closes us
    threading.Thread(
        target=_watch_parent, args=(parent_pid,), daemon=True, name="tester-parent-watch"
    ).start()
    import torch  # the parent has already niced this process (Tester.start)

    from oakemu_core.run.evaluation import build_evaluation

    torch.set_num_threads(1)
    episodes, greedy, seed = options.pop("episodes"), options.pop("greedy"), options.pop("seed")
    env_id, schema_dict = options.pop("env_id"), options.pop("schema_dict")
    video_dir, best_return = options.pop("video_dir"), options.pop("best_return")

    def build(frame_sink: Any = None) -> tuple[Any, Any]:
        return build_evaluation(env_id, schema_dict, seed=seed, frame_sink=frame_sink, **options)

    try:
        _serve(
            conn,
            _Evaluator(
                build,
                episodes=episodes,
                greedy=greedy,
                video_dir=video_dir,
                best_return=best_return,
            ),
        )
    finally:
        import gc

        gc.freeze()  # skip collecting torch's modules at exit (about 1 s of CPU the learner waits for)


def _serve(conn: multiprocessing.connection.Connection, evaluator: _Evaluator) -> None:
    """Check the settings once (``("ready",)`` or a start error), then answer messages until told to stop."""
    try:
        _, env = evaluator.build()  # fail fast on a bad env id, schema or settings file
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
        if message[0] == "final_video":
            conn.send(("final_video", *evaluator.final_video()))
            continue
        if message[0] != "evaluate":
            return
        _, policy_version, global_step, weights, record = message
        try:
            values = evaluator.evaluate(policy_version, global_step, weights, record)
        except Exception as exc:
            conn.send(
                ("error", policy_version, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            )
            continue
        conn.send(("report", values))


class _Evaluator:
    """Plays evaluations in this process and keeps the videos (see the module docstring)."""

    def __init__(
        self,
        build: Callable[..., tuple[Any, Any]],
        *,
        episodes: int,
        greedy: bool,
        video_dir: str | None,
        best_return: float | None,
    ) -> None:
        self.build = build
        self._episodes, self._greedy = int(episodes), bool(greedy)
        self._video_dir = None if video_dir is None else Path(video_dir)
        self._best_return = -float("inf") if best_return is None else float(best_return)
        self._last: tuple[Mapping[str, np.ndarray], list[Path]] | None = (
            None  # weights, videos written
        )

    def _play(self, weights: Mapping[str, np.ndarray], episodes: int, videos: Any) -> Any:
        from oakemu_core.policy.models import load_weight_arrays
        from oakemu_core.run.evaluation import play_episodes

        model, env = self.build(videos)
        try:
            load_weight_arrays(model, weights)
            return play_episodes(model, env, episodes=episodes, greedy=self._greedy)
        finally:
            env.close()
            if videos is not None:
                videos.close()

    def evaluate(
        self,
        policy_version: int,
        global_step: int,
        weights: Mapping[str, np.ndarray],
        record: str | None,
    ) -> dict[str, Any]:
        """One evaluation: the report's values (:class:`oakemu_core.run.tester.EvaluationReport`'s fields
        but ``weights``). Raises what building or playing raises (bad weights, a failing env)."""
        from oakemu_core.run.best_checkpoint import is_new_best
        from oakemu_core.run.video import episode_video, evaluation_video_path, final_video_path

        started = time.perf_counter()
        videos = None
        if self._video_dir is not None and record is not None:
            path = (
                final_video_path(self._video_dir)
                if record == "final"
                else evaluation_video_path(self._video_dir, policy_version)
            )
            videos = episode_video(
                path, preview=record != "final"
            )  # the run waits for the final: no GIF
        result = self._play(weights, self._episodes, videos)
        written = list(videos.paths) if videos is not None else []
        error = videos.error if videos is not None else None
        preview = videos.preview if videos is not None else None
        if is_new_best(result.mean, self._best_return):
            self._best_return = result.mean
            if self._video_dir is not None:
                from oakemu_core.run.video import best_video_path

                path, best_error, best_preview = self._keep(
                    best_video_path(self._video_dir), weights, written, preview=preview is None
                )
                written += [path] if path is not None else []
                error, preview = error or best_error, preview or best_preview
        self._last = (weights, written)
        return {
            "policy_version": policy_version,
            "global_step": global_step,
            "episodes": len(result.returns),
            "return_mean": result.mean,
            "return_std": result.std,
            "length_mean": float(np.mean(result.lengths)),
            "returns": tuple(float(r) for r in result.returns),
            "lengths": tuple(int(n) for n in result.lengths),
            "greedy": self._greedy,
            "wall_seconds": time.perf_counter() - started,
            "finished_at": time.time(),
            "video_path": str(written[0]) if written else None,
            "video_error": error,
            "video_preview": preview,
            "videos": tuple(str(path) for path in written),
        }

    def final_video(self) -> tuple[str | None, str | None]:
        """``final.mp4`` of the last evaluation: ``(path, None)``, or ``(None, why not)``."""
        from oakemu_core.run.video import final_video_path

        if self._video_dir is None:
            return None, "videos are off"
        if self._last is None:
            return None, "no evaluation finished"
        weights, written = self._last
        target = final_video_path(self._video_dir)
        if target not in written:
            path, error, _ = self._keep(
                target, weights, written, preview=False
            )  # no report shows it
            if path is None:
                return None, error
            written.append(path)
        return str(target), None

    def _keep(
        self, target: Path, weights: Mapping[str, np.ndarray], written: list[Path], *, preview: bool
    ) -> tuple[Path | None, str | None, Any]:
        """``target`` as a copy of the evaluation's video, else by replaying its first episode (with a
        TensorBoard preview when ``preview``): ``(path or None, error or None, preview or None)``."""
        from oakemu_core.run.video import copy_video, episode_video

        if written:
            try:
                copy_video(written[0], target)
            except OSError as exc:
                return None, f"cannot write {target}: {exc}", None
            return target, None, None
        try:
            videos = episode_video(target, preview=preview)
            self._play(weights, 1, videos)
        except Exception as exc:  # noqa: BLE001 - the evaluation's result stands without its video
            return None, f"cannot record {target}: {type(exc).__name__}: {exc}", None
        return (videos.paths[0] if videos.paths else None), videos.error, videos.preview
