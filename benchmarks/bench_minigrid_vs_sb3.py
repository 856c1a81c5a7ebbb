"""Small image-like observations that are not pictures: MiniGrid through ``ImgObsWrapper``, OakEmu vs SB3.

What it measures.  For each seed, SB3 ``PPO("MlpPolicy")`` and ``oakemu train`` (in each ``--modes``)
train from scratch on ``MiniGrid-Empty-5x5-v0`` (or ``--env``) as MiniGrid users bring it:
``ImgObsWrapper`` (:mod:`benchmarks.minigrid_envs`), a ``Box(0, 255, (7, 7, 3), uint8)`` grid of symbolic
indices (object type 0..10, colour 0..5, state 0..2), 7 actions; reward ``1 - 0.9 * steps / 100`` on
reaching the goal, 0 on the 100-step time limit (about 0.2 for a random policy, about 0.95 at best).
Both get ``oakemu train``'s default PPO settings, the same numbers on both sides
(:data:`CASE`: 2 actors x 8 envs x 128 steps, 4 epochs x 4 minibatches, lr 2.5e-4 held constant,
clip 0.1, entropy 0.01, gamma 0.99, lambda 0.95, vf_coef 0.5 (SB3's value loss is ``MSE``, OakEmu's
``0.5 * MSE``: SB3's critic gets twice the weight; each side's critic is a separate MLP, so this only
shifts the shared gradient-norm clip)), 40k env steps, one run at a time.

Networks: SB3's ``MlpPolicy`` flattens the grid (and, taking ``(7, 7, 3)`` uint8 in ``[0, 255]`` for an
image, divides it by 255) into separate 64-64 tanh actor and critic MLPs.  OakEmu builds what
:mod:`oakemu_core.policy.models` chooses for a ``(7, 7, 3)`` uint8 key: the same MLPs, on the grid
normalised by running statistics.

What the numbers mean.  ``last50`` / ``last100``: mean return of the last 50 / 100 finished training
episodes (OakEmu: ``episodes.jsonl`` by ``global_step``; SB3: each env's ``Monitor``, an episode ending
at its env's step ``t`` counted at global step ``t * num_envs``).  ``curve``: mean return of the
episodes that ended in each tenth of the budget.  ``wall``: seconds from launch to exit.

How to run (with ``stable-baselines3`` and the ``minigrid`` extra: ``pip install -e .[minigrid] stable-baselines3``)::

    python benchmarks/bench_minigrid_vs_sb3.py                     # seeds 1 2, sync, 40k steps: ~4 min on 2 cores
    python benchmarks/bench_minigrid_vs_sb3.py --modes sync async --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_spaces_vs_sb3 as spaces  # the sibling benchmark: Case, flag builders, run helpers

ENV_MODULE = "benchmarks.minigrid_envs"

CASE = spaces.Case(
    env_id="MiniGrid-Empty-5x5-Img-v0",
    total_env_steps=40_000,
    num_envs=spaces.NUM_ACTORS * 8,
    rollout_length=128,
    ppo_epochs=4,
    num_minibatches=4,
    learning_rate=2.5e-4,
    gamma=0.99,
    gae_lambda=0.95,
    clip_coef=0.1,
    ent_coef=0.01,
    vf_coef=0.5,
    max_grad_norm=0.5,
    normalize_observations=False,
    normalize_rewards=False,
    action_masks=False,
    max_policy_lag=2,
    net_arch="grid flattened into separate actor and critic MLPs 64-64 tanh, orthogonal init, categorical head",
)
"""``oakemu train``'s defaults for a non-Atari id (the learning rate held constant on both sides)."""


def oakemu_minigrid_args(
    env_id: str, *, mode: str, seed: int, steps: int, runs_dir: Path, run_name: str, ports: list
) -> list[str]:
    """``oakemu train`` flags: every hyperparameter of :data:`CASE` explicit, the env in ``module:EnvId``
    form, the mode, and no periodic evaluation or checkpoints."""
    args = spaces.oakemu_args(
        CASE, seed=seed, steps=steps, runs_dir=runs_dir, run_name=run_name, ports=ports
    )
    args[args.index("--env") + 1] = f"{ENV_MODULE}:{env_id}"
    return [*args, "--mode", mode, "--eval-every-updates", "0"]


def run_oakemu(env_id: str, *, mode: str, seed: int, steps: int, runs_dir: Path) -> dict:
    run_name = f"oakemu-{mode}-{env_id}-s{seed}"
    run_dir = spaces.fresh_run_dir(runs_dir, run_name)
    args = oakemu_minigrid_args(
        env_id,
        mode=mode,
        seed=seed,
        steps=steps,
        runs_dir=runs_dir,
        run_name=run_name,
        ports=spaces._free_ports(5),
    )
    wall = spaces.train_oakemu(args, log_path=runs_dir / f"{run_name}.log", torch_threads=1)
    episodes = sorted(
        spaces._read_jsonl(run_dir / "episodes.jsonl"), key=lambda e: e["global_step"]
    )
    return {
        "wall_s": wall,
        "episodes": [(int(e["global_step"]), float(e["episodic_return"])) for e in episodes],
    }


def sb3_worker(spec: dict) -> dict:
    """One SB3 run (in a child process): every finished episode as ``(global step, return)``."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv

    venv = make_vec_env(
        f"{ENV_MODULE}:{spec['env_id']}",
        n_envs=CASE.num_envs,
        seed=spec["seed"],
        vec_env_cls=DummyVecEnv,
    )
    PPO("MlpPolicy", venv, **spaces.sb3_kwargs(CASE, seed=spec["seed"])).learn(
        total_timesteps=spec["steps"]
    )
    episodes = []
    for monitor in venv.envs:  # make_vec_env puts the Monitor outermost
        ends = np.cumsum(monitor.get_episode_lengths()) * CASE.num_envs
        episodes += zip(ends.tolist(), monitor.get_episode_rewards(), strict=True)
    return {"episodes": sorted(episodes)}


def run_sb3(env_id: str, *, seed: int, steps: int, runs_dir: Path) -> dict:
    spec = {"env_id": env_id, "seed": seed, "steps": steps}
    env = dict(
        os.environ, PYTHONPATH=str(spaces.REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    start = time.perf_counter()
    with open(runs_dir / f"sb3-{env_id}-s{seed}.log", "w") as log:
        process = subprocess.run(
            [sys.executable, __file__, "--sb3-worker", json.dumps(spec)],
            cwd=spaces.REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=3600,
            check=False,
        )
    if process.returncode != 0:
        raise RuntimeError(f"SB3 worker exited {process.returncode}; see {log.name}")
    return {
        **json.loads(process.stdout.strip().splitlines()[-1]),
        "wall_s": time.perf_counter() - start,
    }


def summarize(result: dict, steps: int) -> dict:
    """``last50``, ``last100``, ``curve`` (mean return per tenth of ``steps``), ``episodes``, ``wall_s``."""
    episodes = result["episodes"]
    returns = [r for _, r in episodes]
    bins: list[list[float]] = [[] for _ in range(10)]
    for step, value in episodes:
        bins[min(9, max(0, (step - 1) * 10 // steps))].append(value)
    return {
        "last50": spaces._mean(returns[-50:]),
        "last100": spaces._mean(returns[-100:]),
        "episodes": len(returns),
        "curve": [round(spaces._mean(b), 2) for b in bins],
        "wall_s": result["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--env", default=CASE.env_id, help=f"an id {ENV_MODULE} registers (default {CASE.env_id})"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=CASE.total_env_steps)
    parser.add_argument(
        "--modes", nargs="+", choices=["sync", "async"], default=["sync"], help="OakEmu modes"
    )
    parser.add_argument(
        "--systems", nargs="+", choices=["sb3", "oakemu"], default=["sb3", "oakemu"]
    )
    parser.add_argument(
        "--runs-dir", type=Path, default=None, help="keep run folders here (default: a temp dir)"
    )
    parser.add_argument("--sb3-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sb3_worker:
        print(json.dumps(sb3_worker(json.loads(args.sb3_worker))))
        return 0

    print("shared hyperparameters:", asdict(CASE), f"batch_size={CASE.batch_size}")
    print(
        "oakemu train",
        " ".join(
            oakemu_minigrid_args(
                args.env,
                mode="MODE",
                seed=0,
                steps=args.steps,
                runs_dir=Path("DIR"),
                run_name="NAME",
                ports=["P"] * 5,
            )
        ),
    )
    print(
        "SB3: PPO('MlpPolicy', make_vec_env(id, DummyVecEnv), **",
        spaces.sb3_kwargs(CASE, seed=0),
        ")",
    )
    systems = [f"oakemu-{mode}" for mode in args.modes] if "oakemu" in args.systems else []
    systems = ["sb3", *systems] if "sb3" in args.systems else systems
    temp = None if args.runs_dir else tempfile.TemporaryDirectory(prefix="bench_minigrid_")
    runs_dir = Path(temp.name) if temp else args.runs_dir.resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for seed in args.seeds:
            for system in systems:
                common = {"seed": seed, "steps": args.steps, "runs_dir": runs_dir}
                result = (
                    run_sb3(args.env, **common)
                    if system == "sb3"
                    else run_oakemu(args.env, mode=system.removeprefix("oakemu-"), **common)
                )
                rows.append({"system": system, "seed": seed, **summarize(result, args.steps)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if temp is not None:
            temp.cleanup()
    print(
        f"\n{args.env}, {args.steps:,} env steps\n\n| system | seed | last-50 | last-100 | episodes | wall s |"
        " mean return per tenth of the steps |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for row in rows:
        print(
            f"| {row['system']} | {row['seed']} | {row['last50']:.2f} | {row['last100']:.2f} | {row['episodes']} "
            f"| {row['wall_s']:.0f} | {' '.join(f'{v:.2f}' for v in row['curve'])} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
