"""``oakemu evaluate CHECKPOINT``: play episodes with a trained policy and report the episodic return.

CHECKPOINT is a checkpoint of ``oakemu train`` (a ``.pt`` file, or a run folder: its latest) or a policy
folder written by ``oakemu export`` (safetensors and JSON): both play the same episodes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from oakemu_core.envs.options import EnvOptions
from oakemu_core.policy.export import is_policy_folder, load_policy_folder, read_policy_info
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.policy.weights import load_model_state
from oakemu_core.run.checkpoint import load_run_checkpoint
from oakemu_core.run.evaluation import build_evaluation, play_episodes
from oakemu_core.run.loading import check_policy_path
from oakemu_core.run.video import EpisodeVideos

DEFAULT_MAX_EPISODE_STEPS = 27_000
"""Time limit when the run had none: 108k frames at frame skip 4, the usual Atari evaluation cap."""


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate_checkpoint` played: the env id, raw returns and lengths (agent steps)
    in the order the episodes finished, the episodes' videos (``video_dir/episode_<n>.mp4``, n from
    1) and why videos are missing (None when none were asked for or all were written)."""

    env_id: str
    returns: list[float]
    lengths: list[int]
    videos: list[Path] = field(default_factory=list)
    video_error: str | None = None


def evaluate_checkpoint(
    checkpoint: Path,
    *,
    episodes: int,
    greedy: bool,
    seed: int,
    video_dir: Path | None = None,
    videos: int | None = None,
) -> Evaluation:
    """Play ``episodes`` episodes with the checkpoint's policy (CPU); with ``video_dir``, record each
    (or the first ``videos``) as an MP4 of the game's full-colour screen (the returns are the same
    with or without).

    Raises:
        oakemu_core.errors.CheckpointError: no checkpoint at ``checkpoint`` (a run folder is searched for its
            latest), or a file that is not a checkpoint of ``oakemu train``.
        oakemu_core.policy.export.PolicyFolderError: an exported policy folder that is damaged.
        oakemu_core.run.video.VideoUnavailableError: ``video_dir`` without the ``video`` extra.
    """
    env_id, schema, config, weights = _read_policy(checkpoint)
    recorder = None
    if video_dir is not None:
        recorder = EpisodeVideos(
            lambda index: Path(video_dir) / f"episode_{index + 1}.mp4",
            episodes=episodes if videos is None else videos,
        )
    # The same builder as the learner's tester (oakemu_core.run.tester): one evaluation code path.
    model, env = build_evaluation(
        env_id,
        schema,
        seed=seed,
        max_episode_steps=config.get("max_episode_steps"),
        settings_file=config.get("emulator_settings"),
        normalize_observations=bool(config.get("normalize_observations")),
        network=NetworkSpec.from_config(config).to_dict(),
        env_options=EnvOptions.from_settings(config),
        frame_sink=recorder,
    )
    try:
        load_model_state(model, weights, source=str(checkpoint))
        model.eval()
        result = play_episodes(model, env, episodes=episodes, greedy=greedy)
    finally:
        env.close()
        if recorder is not None:
            recorder.close()
    return Evaluation(
        env_id,
        result.returns,
        result.lengths,
        videos=[] if recorder is None else list(recorder.paths),
        video_error=None if recorder is None else recorder.error,
    )


def _read_policy(source: Path) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(env id, step schema dict, the run's config, state_dict)`` of a checkpoint, a run folder (its latest
    checkpoint) or a policy folder of ``oakemu export``.

    Raises:
        oakemu_core.errors.CheckpointError: nothing at ``source`` (:func:`oakemu_core.run.loading.check_policy_path`),
            or no checkpoint there.
    """
    source = check_policy_path(source)
    if is_policy_folder(source):
        info, spaces = read_policy_info(Path(source))
        return (
            str(info.get("env_id", "")),
            spaces.get("schema") or {},
            dict(info.get("config") or {}),
            load_policy_folder(Path(source)).state_dict(),
        )
    _, state = load_run_checkpoint(source)
    return state["env"]["env_id"], state["env"]["schema"], state["config"], state["model"]


def evaluate(checkpoint: Path, *, episodes: int, greedy: bool, seed: int) -> list[float]:
    """Play ``episodes`` episodes with the checkpoint's policy (CPU); returns their raw returns.

    Raises:
        oakemu_core.errors.CheckpointError: as :func:`evaluate_checkpoint`.
    """
    return evaluate_checkpoint(checkpoint, episodes=episodes, greedy=greedy, seed=seed).returns


def result_json(checkpoint: Path, evaluation: Evaluation, *, greedy: bool, seed: int) -> str:
    """The ``--json`` line: one object with ``checkpoint``, ``env_id``, ``policy`` (greedy or
    sampled), ``seed``, ``episodes``, ``mean``, ``std`` (population), ``min``, ``max``, ``returns``,
    ``lengths``, ``videos`` (paths) and ``video_error`` (or null)."""
    returns = evaluation.returns
    return json.dumps(
        {
            "checkpoint": str(checkpoint),
            "env_id": evaluation.env_id,
            "policy": "greedy" if greedy else "sampled",
            "seed": seed,
            "episodes": len(returns),
            "mean": float(np.mean(returns)),
            "std": float(np.std(returns)),
            "min": float(np.min(returns)),
            "max": float(np.max(returns)),
            "returns": [float(r) for r in returns],
            "lengths": [int(n) for n in evaluation.lengths],
            "videos": [str(p) for p in evaluation.videos],
            "video_error": evaluation.video_error,
        }
    )


def main(
    checkpoint: Path,
    *,
    episodes: int,
    greedy: bool,
    seed: int,
    video_dir: Path | None = None,
    json_output: bool = False,
) -> int:
    """Entry point: prints one line ``episodes N  mean M  std S`` (population std), or with
    ``json_output`` one JSON object (:func:`result_json`); 0 on success, 1 when videos were asked
    for and the env could not be recorded (the result is printed all the same). A user mistake (no checkpoint,
    no video writer) raises a :class:`~oakemu_core.errors.UserError` for the CLI to report."""
    evaluation = evaluate_checkpoint(
        checkpoint, episodes=episodes, greedy=greedy, seed=seed, video_dir=video_dir
    )
    returns = evaluation.returns
    if json_output:
        print(result_json(checkpoint, evaluation, greedy=greedy, seed=seed))
    else:
        mode = "greedy" if greedy else "sampled"
        # Plain print: one unwrapped line that scripts can parse.
        print(
            f"{checkpoint}: {mode} policy, episodes {len(returns)}  mean {np.mean(returns):.2f}  "
            f"std {np.std(returns):.2f}  (min {np.min(returns):.1f}, max {np.max(returns):.1f})"
        )
    if evaluation.video_error is not None:
        Console(stderr=True).print(f"[red]oakemu evaluate: no videos: {evaluation.video_error}[/]")
        return 1
    return 0
