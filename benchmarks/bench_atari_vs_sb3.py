"""Atari at a real budget side by side: SB3 PPO at rl-baselines3-zoo's Atari settings, ``oakemu train --preset atari``.

For each seed the two systems train from scratch one after another (their order rotates with the
seed, so that a change of machine load does not always hit the same system):

* ``sb3``: Stable-Baselines3 ``PPO("CnnPolicy")`` with rl-baselines3-zoo's ``hyperparams/ppo.yml``
  ``atari`` entry: ``AtariWrapper`` (up to 30 no-ops, frame skip 4 with max-pooling, a lost life ends
  the learner's episode while the game goes on, FIRE on reset, 84 x 84 grayscale, training rewards
  clipped to their sign), ``VecFrameStack(4)``, 8 envs x 128 steps over ``DummyVecEnv``, 4 epochs of
  batch 256, learning rate ``lin_2.5e-4`` and clip range ``lin_0.1`` (both falling linearly to 0),
  ``vf_coef`` 0.5, ``ent_coef`` 0.01, the Nature CNN shared by linear policy and value heads. The env
  is ``gym.make(id, frameskip=1)`` of the ALE v5 id (sticky actions 0.25, as OakEmu's). It runs in a
  child process under ``--sb3-python`` (a venv with stable-baselines3 and opencv; the project's venv
  needs neither). Its ``Monitor`` sits under ``AtariWrapper``: the logged return is the whole game's
  raw score.
* ``oakemu``: ``oakemu train --preset atari --total-env-steps N --seed S --eval-every-updates 0`` and
  nothing else but ``--oakemu-args`` (e.g. ``--mode async``, ``--cnn impala``): what a user of the
  preset gets, actors fitted to the CPUs, the preset's mode. Recorded under ``--label`` (default
  ``oakemu``). Its ``episodes.jsonl`` holds whole-game raw scores too.

Torch intra-op threads are each side's default (SB3: torch's, one per core; OakEmu: its fitted
learner and actor threads), as a user would run them.

What the numbers mean (``bench_vs_sb3.py``'s definitions): ``window k``: the mean raw game score of the
games that ended in the k-th tenth of the budget; ``last100``: of the last 100 finished games;
``wall``: seconds from launching the training process to its exit; ``SPS``: env steps trained /
``wall``; ``load``: the 1-minute load average before / after the run (on a shared machine SPS and wall
figures compare only between runs under similar load).

Each run writes ``<out>/<game>/<label>-seed<k>-<steps>.json`` when it ends (an existing file is kept and
its run skipped, so later sessions continue the series; ``--force`` runs it again). An SB3 run saves a
checkpoint every 10 minutes in ``<record>.partial/``: when the series runs again after the run was
killed, it resumes from there (its games restart; the record's ``segments`` counts the processes and
``wall_s`` sums their training time). ``--report`` prints
the Markdown table for ``docs/benchmarks.md`` from those files: per game, label and budget the
per-window means over seeds, last100, wall, SPS and the ratios to ``sb3`` at the same seeds.

How to run (inside ``. .venv/bin/activate``; the SB3 side needs its own venv, e.g.
``python -m venv /work/venv-sb3 && /work/venv-sb3/bin/pip install stable-baselines3 opencv-python-headless
ale-py && /work/venv-sb3/bin/pip install -e .``)::

    python benchmarks/bench_atari_vs_sb3.py --sb3-python /work/venv-sb3/bin/python --seeds 1 2 3
    python benchmarks/bench_atari_vs_sb3.py --systems oakemu --label oakemu-impala --oakemu-args="--cnn impala"
    python benchmarks/bench_atari_vs_sb3.py --env ALE/Pong-v5 --seeds 1
    python benchmarks/bench_atari_vs_sb3.py --report

On 2 cores shared by both systems (load 4-5), one Breakout run of 1M env steps took 65 minutes (OakEmu)
and about 3 hours (SB3, 93 env steps/s).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spaces_vs_sb3 import REPO  # sibling helpers
from sb3_series import (
    comparison_table,
    kept,
    learn_logged,
    linear_schedule,
    load_records,
    preset_command,
    run_sb3_worker,
    runs_folder,
    sb3_worker_command,
    series,
    train_oakemu_run,
    training_record,
    write_record,
)

SYSTEMS = ("sb3", "oakemu")
REFERENCE = "sb3"
RESULTS = REPO / "benchmarks" / "results" / "atari"
DEFAULT_ENV = "ALE/Breakout-v5"
DEFAULT_STEPS = 1_000_000
TIMEOUT_S = 4 * 3600

ZOO_ATARI = {  # rl-baselines3-zoo hyperparams/ppo.yml, `atari`
    "n_envs": 8,
    "frame_stack": 4,
    "n_steps": 128,
    "n_epochs": 4,
    "batch_size": 256,
    "learning_rate": "lin_2.5e-4",
    "clip_range": "lin_0.1",
    "vf_coef": 0.5,
    "ent_coef": 0.01,
}


def game_name(env_id: str) -> str:
    """``ALE/Breakout-v5`` -> ``breakout``: the results sub-folder."""
    return env_id.split("/")[-1].split("-")[0].lower()


def result_path(out: Path, env_id: str, label: str, seed: int, steps: int) -> Path:
    return out / game_name(env_id) / f"{label}-seed{seed}-{steps}.json"


# ------------------------------------------------------------------------------------------------- SB3


def sb3_worker(spec: dict) -> dict:
    """Train one SB3 run (in a child process, the SB3 venv); returns every finished game as
    ``(num_timesteps when it ended, raw score)``: the ``Monitor`` sits under ``AtariWrapper``."""
    import ale_py
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.atari_wrappers import AtariWrapper
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack

    gym.register_envs(ale_py)
    zoo = spec["zoo"]
    venv = make_vec_env(
        spec["env_id"],
        n_envs=zoo["n_envs"],
        seed=spec["seed"],
        wrapper_class=AtariWrapper,
        env_kwargs={"frameskip": 1},
        vec_env_cls=DummyVecEnv,
    )
    venv = VecFrameStack(venv, n_stack=zoo["frame_stack"])
    model = PPO(
        "CnnPolicy",
        venv,
        n_steps=zoo["n_steps"],
        n_epochs=zoo["n_epochs"],
        batch_size=zoo["batch_size"],
        learning_rate=linear_schedule(2.5e-4),
        clip_range=linear_schedule(0.1),
        vf_coef=zoo["vf_coef"],
        ent_coef=zoo["ent_coef"],
        seed=spec["seed"],
        device="cpu",
        verbose=0,
    )
    return learn_logged(model, spec["steps"], checkpoint=Path(spec["checkpoint"]))


def checkpoint_folder(record: Path) -> Path:
    """Where an SB3 run whose record goes to ``record`` keeps its checkpoint until the record is written
    (``<record>.partial/``): a run killed part way resumes from there when the series runs again."""
    return record.with_suffix(".partial")


def run_sb3(
    *, sb3_python: str, env_id: str, seed: int, steps: int, runs_dir: Path, checkpoint: Path
) -> dict:
    spec = {"env_id": env_id, "seed": seed, "steps": steps, "zoo": ZOO_ATARI}
    result = run_sb3_worker(
        sb3_worker_command(sb3_python, __file__, {**spec, "checkpoint": str(checkpoint)}),
        log_path=runs_dir / f"sb3-{game_name(env_id)}-s{seed}.log",
        timeout_s=TIMEOUT_S,
    )
    return {**result, "settings": {"sb3": spec}}


# ---------------------------------------------------------------------------------------------- OakEmu


def oakemu_command(
    *, env_id: str, seed: int, steps: int, runs_dir: Path, run_name: str, extra: list[str]
) -> list[str]:
    """``oakemu train --preset atari`` with the budget, seed, env and run folder; no periodic evaluation."""
    return preset_command(
        "atari",
        steps=steps,
        seed=seed,
        runs_dir=runs_dir,
        run_name=run_name,
        leading=["--env", env_id],
        trailing=["--eval-every-updates", "0"],
        extra=extra,
    )


def run_oakemu(
    *, label: str, env_id: str, seed: int, steps: int, runs_dir: Path, extra: list[str]
) -> dict:
    run_name = f"{label}-{game_name(env_id)}-s{seed}"
    command = oakemu_command(
        env_id=env_id, seed=seed, steps=steps, runs_dir=runs_dir, run_name=run_name, extra=extra
    )
    result = train_oakemu_run(command, runs_dir=runs_dir, run_name=run_name, timeout_s=TIMEOUT_S)
    return {**result, "settings": {"oakemu_train": command[3:]}}


# ------------------------------------------------------------------------------------------- records


def run_series(args: argparse.Namespace) -> None:
    extra = shlex.split(args.oakemu_args)
    runs_dir = runs_folder(args.runs_dir, "bench-atari-")
    for seed, system in series(args.seeds, args.systems):
        label = REFERENCE if system == REFERENCE else args.label
        path = result_path(args.out, args.env, label, seed, args.steps)
        if kept(path, args.force, f"{label} seed {seed}"):
            continue
        print(f"-- {label} {args.env} seed {seed}, {args.steps} env steps ...", flush=True)
        load_before = os.getloadavg()[0]
        common = {"env_id": args.env, "seed": seed, "steps": args.steps, "runs_dir": runs_dir}
        if system == REFERENCE:
            result = run_sb3(
                sb3_python=args.sb3_python, checkpoint=checkpoint_folder(path), **common
            )
        else:
            result = run_oakemu(label=label, extra=extra, **common)
        record = training_record(
            result,
            identity={"system": label, "env": args.env, "seed": seed},
            steps=args.steps,
            load=[round(load_before, 2), round(os.getloadavg()[0], 2)],
        )
        write_record(path, record)
        shutil.rmtree(checkpoint_folder(path), ignore_errors=True)
        print(
            f"   last100 {record['last100']:.1f}, wall {record['wall_s']:.0f} s, SPS "
            f"{record['sps']:.0f}, load {record['load_1min']} -> {path}",
            flush=True,
        )


# -------------------------------------------------------------------------------------------- report


def report(records: list[dict]) -> str:
    """Markdown: one row per (game, label, steps) with the per-window means over its seeds, last100,
    wall and SPS, and the ratios to ``sb3``'s runs of the same game, steps and seeds."""
    return "\n".join(comparison_table(records, place="env", reference=REFERENCE, name=game_name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default=DEFAULT_ENV, help="an ALE v5 id (default %(default)s)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="env steps per run")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument(
        "--label", default="oakemu", help="the name OakEmu's runs are recorded under"
    )
    parser.add_argument(
        "--oakemu-args", default="", help="more `oakemu train` flags, one string (--mode async ...)"
    )
    parser.add_argument("--sb3-python", default=sys.executable, help="the SB3 venv's python")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (%(default)s)")
    parser.add_argument("--runs-dir", type=Path, default=None, help="run folders (a temp dir)")
    parser.add_argument("--force", action="store_true", help="run again where a record exists")
    parser.add_argument("--report", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--sb3-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sb3_worker:
        print(json.dumps(sb3_worker(json.loads(args.sb3_worker))))
        return 0
    if args.report:
        records = load_records(args.out)
        if not records:
            raise SystemExit(f"--report: no records under {args.out}")
        print(report(records))
        return 0
    if args.label == REFERENCE:
        raise SystemExit(f"--label: {REFERENCE!r} names the SB3 runs; choose another")
    run_series(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
