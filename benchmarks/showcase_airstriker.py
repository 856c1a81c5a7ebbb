"""Showcase: train ``retro:Airstriker-Genesis-v0`` (the game stable-retro ships with its ROM) and compare
the trained policy with a random one.

Steps, all with the project's own env factory (``oakemu_core.envs.make_eval_env``: the training
preprocessing, 84x84 grey frames x 4, raw unclipped game score as the return):

1. a uniformly random policy (every button an independent coin flip per agent step, what an untrained
   policy samples) plays ``--episodes`` episodes: the baseline;
2. ``oakemu train`` (``python -m oakemu_services.cli train``, the flags of :func:`train_args`) trains
   ``--total-env-steps`` env steps, evaluation on;
3. the trained policy (``oakemu_core.load_policy`` of the run's latest checkpoint, sampled actions as
   in training) plays the same number of episodes on the same seeds;
4. ``return_curve.png``: the training return (last-100-episode mean) and the tester's evaluations
   against env steps, with the random mean +- std as a band; ``airstriker.gif``: ``--gif-seconds``
   of one episode (from ``--gif-skip`` on) of the trained policy, downscaled (the game's colour screen through
   ``oakemu_core.envs.render``); ``summary.json`` and a printed summary.

"Clearly beats random" (:func:`beats_random`): at least ``MIN_EPISODES`` episodes each and the
trained mean above the random mean + 2 random standard deviations.

Needs the extras ``emulators`` (stable-retro) and ``showcase`` (matplotlib, imageio):
``pip install -e '.[emulators,showcase]'``.

Usage: ``python benchmarks/showcase_airstriker.py [--total-env-steps 200000] [--episodes 20] [--out docs/showcase]``;
``--run-dir RUN`` skips training and reports an existing run of the same settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENV_ID = "retro:Airstriker-Genesis-v0"
MIN_EPISODES = 10
"""Episodes per policy at least before :func:`beats_random` can say yes."""
TRAIN_FLAGS = ("--preset", "airstriker", "--device", "cpu")
"""``oakemu train`` flags besides the budget, seed and run folder: the ``airstriker`` preset
(``oakemu_core/presets/airstriker.toml``: async, 4 actors x 1 emulator, training rewards clipped to
[-1, 1], sampled evaluations every 25 updates without video, CleanRL's Atari PPO settings)."""
GIF_WIDTH = 160
"""Width (pixels) of the GIF's frames (the Genesis screen is 320 x 224)."""
GIF_FRAME_STRIDE = 2
"""Every how many agent steps the GIF keeps a frame (agent steps run at 15 per game second)."""


@dataclass(frozen=True)
class Curve:
    """A run's return curve, x in env steps: ``train_*`` the last-100-episode mean after each PPO update
    (``charts/episodic_return``), ``eval_*`` the tester's evaluations (mean and population std of the
    raw return) at the env steps of the weights evaluated."""

    train_steps: list[int]
    train_returns: list[float]
    eval_steps: list[int]
    eval_means: list[float]
    eval_stds: list[float]


def read_curve(lines: Iterable[str]) -> Curve:
    """The :class:`Curve` of a run's ``metrics.jsonl`` lines (one JSON object per line; blank lines and
    records without a return skipped; a NaN return, logged before the first episode ends, skipped)."""
    curve = Curve([], [], [], [], [])
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        value = record.get("charts/episodic_return")
        if isinstance(value, (int, float)) and math.isfinite(value):
            curve.train_steps.append(int(record["global_step"]))
            curve.train_returns.append(float(value))
        mean = record.get("eval/episodic_return")
        if isinstance(mean, (int, float)) and math.isfinite(mean):
            curve.eval_steps.append(
                int(record.get("eval/weights_global_step", record["global_step"]))
            )
            curve.eval_means.append(float(mean))
            curve.eval_stds.append(float(record.get("eval/episodic_return_std") or 0.0))
    return curve


def beats_random(
    trained: list[float], random: list[float], *, min_episodes: int = MIN_EPISODES
) -> bool:
    """True when both lists hold at least ``min_episodes`` returns and the trained mean exceeds the
    random mean + 2 x the random population std."""
    if len(trained) < min_episodes or len(random) < min_episodes:
        return False
    return float(np.mean(trained)) > float(np.mean(random)) + 2.0 * float(np.std(random))


def train_args(*, steps: int, seed: int, runs_dir: Path, run_name: str) -> list[str]:
    """The arguments after ``oakemu train`` that the showcase trains with."""
    return [
        *TRAIN_FLAGS,
        "--total-env-steps",
        str(steps),
        "--seed",
        str(seed),
        "--runs-dir",
        str(runs_dir),
        "--run-name",
        run_name,
    ]


class ClipFrames:
    """A :class:`oakemu_core.envs.render.FrameSink` that keeps ``seconds`` of the first episode from
    ``skip`` seconds on (past the "Get ready" screen): every :data:`GIF_FRAME_STRIDE`-th frame,
    scaled to :data:`GIF_WIDTH` pixels wide."""

    def __init__(self, seconds: float, skip: float = 0.0) -> None:
        self.seconds, self.skip, self.fps = float(seconds), float(skip), 0.0
        self.frames: list[np.ndarray] = []
        self._count, self._first, self._limit, self._done = 0, 0, 0, False

    def begin(self, fps: float) -> bool:
        if self._done:
            return False
        self.fps, self._first = float(fps), round(self.skip * fps)
        self._limit = self._first + max(1, round(self.seconds * fps))
        return True

    def add(self, frame: np.ndarray) -> None:
        import cv2

        if (
            self._first <= self._count < self._limit
            and (self._count - self._first) % GIF_FRAME_STRIDE == 0
        ):
            height = max(2, round(frame.shape[0] * GIF_WIDTH / frame.shape[1]))
            self.frames.append(cv2.resize(frame, (GIF_WIDTH, height), interpolation=cv2.INTER_AREA))
        self._count += 1

    def end(self) -> None:
        self._done = True

    def fail(self, reason: str) -> None:
        raise RuntimeError(reason)


def random_returns(episodes: int, seed: int) -> list[float]:
    """Raw returns of ``episodes`` episodes of uniformly random actions (the action space's ``sample``)."""
    from oakemu_core.envs import make_eval_env

    env = make_eval_env(ENV_ID, seed=seed)
    space = env.spec.action_space
    space.seed(seed)
    returns: list[float] = []
    try:
        env.reset()
        while len(returns) < episodes:
            returns.extend(env.step(np.stack([space.sample()])).episode_returns)
    finally:
        env.close()
    return returns[:episodes]


def trained_returns(
    run_dir: Path, episodes: int, seed: int, clip: ClipFrames | None = None
) -> list[float]:
    """Raw returns of ``episodes`` episodes of the run's latest policy (sampled actions); with ``clip``,
    the first episode's colour frames go there."""
    import torch

    from oakemu_core import load_policy
    from oakemu_core.envs import make_eval_env
    from oakemu_core.run.evaluation import play_episodes

    torch.manual_seed(seed)
    torch.set_num_threads(
        1
    )  # batch-1 inference: more threads only spin against the emulator on a busy machine
    policy = load_policy(run_dir)
    env = make_eval_env(ENV_ID, seed=seed, frame_sink=clip)
    try:
        return play_episodes(policy.model, env, episodes=episodes, greedy=False).returns
    finally:
        env.close()


def plot(curve: Curve, random: list[float], trained: list[float], path: Path) -> None:
    """Draw the return curve against the random baseline into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    mean, std = float(np.mean(random)), float(np.std(random))
    axes.axhspan(mean - std, mean + std, color="grey", alpha=0.25, lw=0)
    axes.axhline(
        mean, color="grey", ls="--", label=f"random policy ({len(random)} episodes, mean +- std)"
    )
    axes.plot(
        curve.train_steps,
        curve.train_returns,
        color="tab:blue",
        label="training (last-100-episode mean)",
    )
    if curve.eval_steps:
        axes.errorbar(
            curve.eval_steps,
            curve.eval_means,
            yerr=curve.eval_stds,
            fmt="o",
            color="tab:orange",
            ms=4,
            capsize=2,
            label="periodic evaluation (mean +- std)",
        )
    end = curve.train_steps[-1] if curve.train_steps else 0
    axes.errorbar(
        [end],
        [float(np.mean(trained))],
        yerr=[float(np.std(trained))],
        fmt="D",
        color="tab:red",
        capsize=3,
        label=f"trained policy ({len(trained)} episodes)",
    )
    axes.set(
        xlabel="env steps (agent steps, 4 frames each)",
        ylabel="episodic return (game score)",
        title=ENV_ID,
    )
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_gif(clip: ClipFrames, path: Path) -> None:
    """Write the clip's frames as a looping GIF at the game's speed."""
    import imageio.v3 as iio

    if not clip.frames:
        raise RuntimeError("the trained policy's episode gave no frames")
    iio.imwrite(
        path,
        np.stack(clip.frames),
        extension=".gif",
        duration=1000.0 * GIF_FRAME_STRIDE / clip.fps,
        loop=0,
    )


TRAIN_RECORD = "showcase_train.json"
"""The run folder's record of the training's wall seconds and command (read back by ``--run-dir``)."""


def train(args: argparse.Namespace) -> tuple[Path, float]:
    """Run ``oakemu train`` (output to ``RUNS_DIR/<run name>.log``); return the run folder and the wall
    seconds it took (also written to the run folder's :data:`TRAIN_RECORD`)."""
    run_name = f"showcase_airstriker_{args.seed}_{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.runs_dir) / run_name
    command = [
        sys.executable,
        "-m",
        "oakemu_services.cli",
        "train",
        *train_args(
            steps=args.total_env_steps,
            seed=args.seed,
            runs_dir=Path(args.runs_dir),
            run_name=run_name,
        ),
    ]
    print("training:", "oakemu train", " ".join(command[4:]), flush=True)
    Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
    log_path = Path(args.runs_dir) / f"{run_name}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log:
        status = subprocess.run(
            command,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
            env={**os.environ, "COLUMNS": "120"},
        ).returncode
    seconds = time.perf_counter() - start
    if status != 0:
        sys.exit(f"oakemu train exited with status {status}; see {log_path}")
    (run_dir / TRAIN_RECORD).write_text(
        json.dumps({"train_wall_seconds": seconds, "command": command[4:]}) + "\n"
    )
    return run_dir, seconds


def recorded_seconds(run_dir: Path) -> float:
    """The training wall seconds of a run this script trained (NaN when it has no record)."""
    record = run_dir / TRAIN_RECORD
    return (
        float(json.loads(record.read_text())["train_wall_seconds"])
        if record.is_file()
        else float("nan")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--total-env-steps", type=int, default=200_000, help="the training budget in env steps"
    )
    parser.add_argument(
        "--episodes", type=int, default=20, help="episodes of the random and of the trained policy"
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="training seed; evaluations use seed + 1000"
    )
    parser.add_argument("--runs-dir", default="runs", help="where the run folder goes")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="report this existing run instead of training"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "docs" / "showcase", help="folder of the PNG, GIF, JSON"
    )
    parser.add_argument(
        "--gif-seconds", type=float, default=12.0, help="game seconds the GIF shows"
    )
    parser.add_argument(
        "--gif-skip", type=float, default=2.0, help="game seconds before the GIF starts"
    )
    args = parser.parse_args()
    if args.episodes < 1 or args.total_env_steps < 1:
        sys.exit("--episodes and --total-env-steps: expected >= 1")
    eval_seed = args.seed + 1000
    start = time.perf_counter()
    random = random_returns(args.episodes, eval_seed)
    print(
        f"random policy: {np.mean(random):.1f} +- {np.std(random):.1f} over {len(random)} episodes "
        f"({time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    if args.run_dir is None:
        run_dir, train_seconds = train(args)
    else:
        run_dir, train_seconds = args.run_dir, recorded_seconds(args.run_dir)
    curve = read_curve((run_dir / "metrics.jsonl").read_text().splitlines())
    clip = ClipFrames(args.gif_seconds, skip=args.gif_skip)
    trained = trained_returns(run_dir, args.episodes, eval_seed, clip)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(curve, random, trained, args.out / "return_curve.png")
    write_gif(clip, args.out / "airstriker.gif")
    steps = curve.train_steps[-1] if curve.train_steps else 0
    summary: dict[str, Any] = {
        "env_id": ENV_ID,
        "run_dir": str(run_dir),
        "env_steps": steps,
        "train_wall_seconds": round(train_seconds, 1),
        "sps": round(steps / train_seconds, 1) if math.isfinite(train_seconds) else None,
        "random_mean": float(np.mean(random)),
        "random_std": float(np.std(random)),
        "trained_mean": float(np.mean(trained)),
        "trained_std": float(np.std(trained)),
        "episodes": args.episodes,
        "beats_random": beats_random(trained, random),
        "train_command": "oakemu train "
        + " ".join(
            train_args(
                steps=args.total_env_steps,
                seed=args.seed,
                runs_dir=Path(args.runs_dir),
                run_name="NAME",
            )
        ),
        "curve": asdict(curve),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"random  {summary['random_mean']:8.1f} +- {summary['random_std']:.1f} ({args.episodes} episodes)"
    )
    print(
        f"trained {summary['trained_mean']:8.1f} +- {summary['trained_std']:.1f} ({args.episodes} episodes, "
        f"sampled actions); beats random + 2 std: {summary['beats_random']}"
    )
    print(
        f"training: {steps} env steps in {train_seconds / 60:.1f} min wall, {summary['sps']} SPS; "
        f"outputs in {args.out}"
    )


if __name__ == "__main__":
    main()
