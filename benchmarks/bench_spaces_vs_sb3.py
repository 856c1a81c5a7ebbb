"""Learning comparison: OakEmu-RL against Stable-Baselines3 / sb3-contrib, same hyperparameters and steps.

What it measures.  For each case and seed, both systems train from scratch on the same env with the
same PPO hyperparameters (one table, :data:`CASES`, read from the presets ``oakemu_core/presets/
{pendulum,taxi}.toml``, from which both sides' settings are derived and printed) and the same env-step budget, one run at a time:

* ``pendulum``: ``Pendulum-v1`` (``Box`` actions, diagonal Gaussian), SB3 ``PPO`` over ``DummyVecEnv``
  + ``VecNormalize`` (observations and rewards) against ``oakemu train --normalize-observations
  --normalize-rewards``;
* ``taxi``: ``Taxi-v4`` (``Discrete`` observations one-hot, action masks), sb3-contrib ``MaskablePPO``
  with ``ActionMasker`` (Taxi's own ``action_mask(state)``) against ``oakemu train`` (which reads
  ``info["action_mask"]``).  Gymnasium 1.4 refuses ``Taxi-v3`` as deprecated; v4 is the same task.

OakEmu runs as its users run it: ``python -m oakemu_services.cli train`` (= ``oakemu train``; a learner and 2
actor processes, asynchronous, ``--max-policy-lag 1``), free ports per run so that runs never collide
with others on 5555-5559.  SB3 runs in a child process of this script (``--sb3-worker``), so both
sides pay interpreter start-up and imports.  Both sides get the same torch intra-op thread count
(``--torch-threads``, default 1: the SB3 process and OakEmu's learner; OakEmu's actors use 1 each):
on a busy small machine torch's default of one thread per core would measure contention, not the
algorithms.

What the numbers mean.

* ``last100``: mean raw episodic return of the last 100 training episodes (OakEmu: ``episodes.jsonl``
  by ``global_step``; SB3: ``Monitor`` infos, i.e. ``model.ep_info_buffer`` with
  ``stats_window_size=100``).  Same measure, both sides.
* ``eval``: mean return of ``--eval-episodes`` greedy episodes (OakEmu: ``oakemu evaluate``'s
  function on the final checkpoint, mean action / masked argmax; SB3: ``predict(deterministic=True)``
  with the final ``VecNormalize`` statistics / the action mask), one env seeded with ``--eval-seed``.
* ``wall``: seconds from the start of the training process to the end of training (imports and
  process start-up included, evaluation excluded).  ``ratio`` columns are OakEmu / SB3: for returns
  (negative for both envs here) a ratio above 1 means OakEmu is *worse*, so the table also prints
  the plain difference; for wall time below 1 means OakEmu is faster.
* ``lag`` / ``stale``: OakEmu's mean policy lag (versions; 0 = on-policy like SB3) and rows dropped as
  stale, from ``metrics.jsonl``: the price of its asynchronous mode.  ``acted`` is the env
  steps OakEmu's actors played in finished episodes, trained or not; above ``env steps`` (the trained
  rows, the budget) when the learner threw actor steps away (stale or no buffer capacity).
* Reference points: random policy about -1230 on Pendulum (solved about -200), about -770 on Taxi
  without masks (masked random about -200..-400; solved about +8).

How to run (inside ``. .venv/bin/activate``, with the ``bench`` extra: ``pip install -e .[bench]``)::

    python benchmarks/bench_spaces_vs_sb3.py                         # both cases, seeds 1 2, 100k steps each
    python benchmarks/bench_spaces_vs_sb3.py --cases taxi --seeds 1 --steps 20000   # quick look

Each run takes one to two minutes on a 2-core machine; the full comparison (2 cases x 2 seeds x 2
systems) about 10-20 minutes.  Runs are strictly sequential: the figures are wall times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from oakemu_core.presets import load_preset

REPO = Path(__file__).resolve().parents[1]

NUM_ACTORS = 2
"""OakEmu actor processes; the SB3 side steps ``num_envs = NUM_ACTORS * envs_per_actor`` envs in one process."""


@dataclass(frozen=True)
class Case:
    """One comparison: the env and every PPO hyperparameter both systems get."""

    env_id: str
    total_env_steps: int
    num_envs: int  # OakEmu: NUM_ACTORS x envs_per_actor columns; SB3: n_envs
    rollout_length: int  # OakEmu --rollout-length; SB3 n_steps
    ppo_epochs: int  # --ppo-epochs; n_epochs
    num_minibatches: int  # --num-minibatches; SB3 batch_size = num_envs * rollout_length / this
    learning_rate: float  # constant on both sides (OakEmu --no-anneal-lr; SB3 float lr)
    gamma: float
    gae_lambda: float
    clip_coef: float  # --clip-coef; clip_range
    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    normalize_observations: bool  # OakEmu flag; SB3 VecNormalize(norm_obs=...)
    normalize_rewards: bool  # OakEmu flag; SB3 VecNormalize(norm_reward=..., gamma=gamma)
    action_masks: bool  # SB3 side: sb3-contrib MaskablePPO + ActionMasker; OakEmu reads info masks
    max_policy_lag: int = 1  # OakEmu only (SB3 is synchronous: lag 0)
    # Same on both sides and stated for completeness (both systems' defaults):
    normalize_advantages: bool = True
    clip_value_range: None = (
        None  # no value clipping (SB3 clip_range_vf=None; OakEmu --clip-value-range null)
    )
    target_kl: None = None
    net_arch: str = "separate actor and critic MLPs 64-64 tanh, orthogonal init, Gaussian log_std 0"

    @property
    def envs_per_actor(self) -> int:
        return self.num_envs // NUM_ACTORS

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.rollout_length // self.num_minibatches


def case_from_preset(name: str, *, vf_coef_per_sb3: float = 1.0, **fields: object) -> Case:
    """The :class:`Case` of a preset (``oakemu_core/presets/<name>.toml``, the one home of the tuned values):
    its env and hyperparameters, its ``num_envs``; ``vf_coef`` divided by
    ``vf_coef_per_sb3`` (the case holds SB3's meaning where the caller translates it); ``fields`` set the
    rest (budget, masks, policy lag, network description)."""
    settings = load_preset(name).settings
    keys = (
        "env_id",
        "total_env_steps",
        "rollout_length",
        "ppo_epochs",
        "num_minibatches",
        "learning_rate",
        "gamma",
        "gae_lambda",
        "clip_coef",
        "ent_coef",
        "max_grad_norm",
        "num_envs",
    )
    values: dict[str, object] = {key: settings[key] for key in keys}
    values.update(
        vf_coef=settings["vf_coef"] / vf_coef_per_sb3,
        action_masks=False,
        normalize_observations=settings.get("normalize_observations", False),
        normalize_rewards=settings.get("normalize_rewards", False),
    )
    return Case(**{**values, **fields})  # type: ignore[arg-type]


CASES: dict[str, Case] = {  # vf_coef: both sides get the preset's value as it is
    "pendulum": case_from_preset("pendulum"),
    "taxi": case_from_preset("taxi", action_masks=True),
}

VECNORMALIZE_CLIP = 10.0
"""SB3 ``VecNormalize`` clip_obs / clip_reward; OakEmu's ``RunningNormalizer`` clips observations at 10 too
(its reward scaler does not clip; normalised Pendulum rewards stay far below 10)."""


# --------------------------------------------------------------------------------------------- configs


def oakemu_args(
    case: Case, *, seed: int, steps: int, runs_dir: Path, run_name: str, ports: list[int]
) -> list[str]:
    """``oakemu train`` flags for ``case``: every hyperparameter explicit (no reliance on defaults)."""
    args = [
        "--env",
        case.env_id,
        "--total-env-steps",
        str(steps),
        "--seed",
        str(seed),
        "--num-actors",
        str(NUM_ACTORS),
        "--envs-per-actor",
        str(case.envs_per_actor),
        "--rollout-length",
        str(case.rollout_length),
        "--ppo-epochs",
        str(case.ppo_epochs),
        "--num-minibatches",
        str(case.num_minibatches),
        "--learning-rate",
        repr(case.learning_rate),
        "--no-anneal-lr",
        "--gamma",
        repr(case.gamma),
        "--gae-lambda",
        repr(case.gae_lambda),
        "--clip-coef",
        repr(case.clip_coef),
        "--clip-value-range",
        "null",
        "--ent-coef",
        repr(case.ent_coef),
        "--vf-coef",
        repr(case.vf_coef),
        "--max-grad-norm",
        repr(case.max_grad_norm),
        "--normalize-advantages" if case.normalize_advantages else "--no-normalize-advantages",
        "--normalize-observations"
        if case.normalize_observations
        else "--no-normalize-observations",
        "--normalize-rewards" if case.normalize_rewards else "--no-normalize-rewards",
        "--no-clip-rewards",
        "--max-policy-lag",
        str(case.max_policy_lag),
        "--device",
        "cpu",
        "--runs-dir",
        str(runs_dir),
        "--run-name",
        run_name,
        "--log-format",
        "plain",
        "--checkpoint-every-updates",
        "0",
        "--no-rollback",  # as SB3: no checkpoints, no automatic rollback
    ]
    for flag, port in zip(
        ("--data-port", "--control-port", "--weights-port", "--telemetry-port", "--metrics-port"),
        ports,
        strict=True,
    ):
        args += [flag, str(port)]
    return args


def sb3_kwargs(case: Case, *, seed: int) -> dict:
    """Keyword arguments of SB3 ``PPO`` / sb3-contrib ``MaskablePPO`` for ``case`` (JSON-able)."""
    return {
        "n_steps": case.rollout_length,
        "batch_size": case.batch_size,
        "n_epochs": case.ppo_epochs,
        "learning_rate": case.learning_rate,
        "gamma": case.gamma,
        "gae_lambda": case.gae_lambda,
        "clip_range": case.clip_coef,
        "clip_range_vf": case.clip_value_range,
        "ent_coef": case.ent_coef,
        "vf_coef": case.vf_coef,
        "max_grad_norm": case.max_grad_norm,
        "normalize_advantage": case.normalize_advantages,
        "target_kl": case.target_kl,
        "stats_window_size": 100,
        "seed": seed,
        "device": "cpu",
        "verbose": 0,
        # MlpPolicy's default for PPO is pi=[64, 64], vf=[64, 64], tanh, ortho_init, log_std_init 0;
        # stated so that a changed default cannot silently change the comparison.
        "policy_kwargs": {
            "net_arch": {"pi": [64, 64], "vf": [64, 64]},
            "ortho_init": True,
            # Gaussian policies only (MaskableActorCriticPolicy refuses the keyword)
            **({} if case.action_masks else {"log_std_init": 0.0}),
        },
    }


def sb3_vec_env_settings(case: Case) -> dict:
    return {
        "n_envs": case.num_envs,
        "vec_env_cls": "DummyVecEnv",
        "VecNormalize": (
            {
                "norm_obs": case.normalize_observations,
                "norm_reward": case.normalize_rewards,
                "gamma": case.gamma,
                "clip_obs": VECNORMALIZE_CLIP,
                "clip_reward": VECNORMALIZE_CLIP,
                "epsilon": 1e-8,
            }
            if case.normalize_observations or case.normalize_rewards
            else None
        ),
        "algorithm": "sb3_contrib.MaskablePPO + ActionMasker(Taxi action_mask)"
        if case.action_masks
        else "stable_baselines3.PPO",
    }


# ---------------------------------------------------------------------------------------------- OakEmu


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fresh_run_dir(runs_dir: Path, run_name: str) -> Path:
    """``runs_dir / run_name``, which must not exist yet: ``oakemu train`` would resume the run found
    there (a 100k-step run's final checkpoint turned a 150k-step benchmark into 50k steps at 2.3x
    the SPS). Raises SystemExit with the advice to pass a new ``--runs-dir``."""
    run_dir = runs_dir / run_name
    if run_dir.exists():
        raise SystemExit(
            f"{run_dir} already holds a run, which oakemu train would resume instead of starting "
            "a new one: pass a new --runs-dir"
        )
    return run_dir


def train_oakemu(
    args: list[str], *, log_path: Path, torch_threads: int, timeout_s: float = 3600
) -> float:
    """Run ``oakemu train ARGS`` (``python -m oakemu_services.cli``) from the repository root, output to ``log_path``;
    returns the wall seconds from launch to exit.  OMP_NUM_THREADS sets the learner's torch intra-op threads
    (actors use --torch-threads, default 1).  Also used by ``bench_vs_sb3.py``."""
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS=str(torch_threads),
    )
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.run(
            [sys.executable, "-m", "oakemu_services.cli", "train", *args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"oakemu train exited {process.returncode}; see {log_path}")
    return wall


def run_oakemu(
    case: Case,
    *,
    seed: int,
    steps: int,
    runs_dir: Path,
    eval_episodes: int,
    eval_seed: int,
    torch_threads: int,
) -> dict:
    run_name = f"oakemu-{case.env_id.replace('/', '-')}-s{seed}"
    run_dir = fresh_run_dir(runs_dir, run_name)
    args = oakemu_args(
        case, seed=seed, steps=steps, runs_dir=runs_dir, run_name=run_name, ports=_free_ports(5)
    )
    load_before = os.getloadavg()[0]
    wall = train_oakemu(args, log_path=runs_dir / f"{run_name}.log", torch_threads=torch_threads)
    load_after = os.getloadavg()[0]
    episodes = sorted(_read_jsonl(run_dir / "episodes.jsonl"), key=lambda e: e["global_step"])
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    returns = [float(e["episodic_return"]) for e in episodes]
    sys.path.insert(0, str(REPO))
    from oakemu_services.evaluate import evaluate  # after the run: keeps the parent light

    eval_returns = evaluate(run_dir, episodes=eval_episodes, greedy=True, seed=eval_seed)
    lags = [m["charts/policy_lag_mean"] for m in metrics if "charts/policy_lag_mean" in m]
    return {
        "wall_s": wall,
        "episodes": len(returns),
        "last100": _mean(returns[-100:]),
        "eval": _mean(eval_returns),
        "env_steps": int(metrics[-1]["global_step"]) if metrics else 0,
        "updates": len(metrics),
        "policy_lag_mean": _mean(lags),
        # env steps the actors played in finished episodes (trained or not): above env_steps when the
        # learner dropped actor steps (stale or no buffer capacity)
        "acted_steps": int(sum(e["episodic_length"] for e in episodes)),
        "episodes_per_actor": {
            a: sum(e.get("actor_id") == a for e in episodes)
            for a in sorted({str(e.get("actor_id")) for e in episodes})
        },
        "stale_rows": int(sum(m.get("charts/stale_rows", 0.0) for m in metrics)),
        "load_1min": [round(load_before, 2), round(load_after, 2)],
    }


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


# ------------------------------------------------------------------------------------------------- SB3


def sb3_worker(spec: dict) -> dict:
    """Train and evaluate one SB3 run (in a child process); returns the result dict."""
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    import torch

    torch.set_num_threads(spec["torch_threads"])
    import gymnasium as gym
    import numpy as np
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    case = Case(**spec["case"])
    kwargs = spec["kwargs"]
    seed, steps = spec["seed"], spec["steps"]
    venv_settings = spec["venv"]

    if case.action_masks:
        from sb3_contrib import MaskablePPO
        from sb3_contrib.common.wrappers import ActionMasker

        def taxi_mask(env: gym.Env) -> np.ndarray:
            return env.unwrapped.action_mask(env.unwrapped.s).astype(bool)

        venv = make_vec_env(
            case.env_id,
            n_envs=case.num_envs,
            seed=seed,
            vec_env_cls=DummyVecEnv,
            wrapper_class=ActionMasker,
            wrapper_kwargs={"action_mask_fn": taxi_mask},
        )
        algorithm = MaskablePPO
    else:
        from stable_baselines3 import PPO

        venv = make_vec_env(case.env_id, n_envs=case.num_envs, seed=seed, vec_env_cls=DummyVecEnv)
        algorithm = PPO
        taxi_mask = None  # type: ignore[assignment]
    normalize = venv_settings["VecNormalize"]
    if normalize is not None:
        venv = VecNormalize(venv, **normalize)
    model = algorithm("MlpPolicy", venv, **kwargs)
    model.learn(total_timesteps=steps)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    returns = [float(info["r"]) for info in model.ep_info_buffer]
    # Episodes finished over the whole run, from each env's Monitor.
    base = venv.venv if normalize is not None else venv
    from stable_baselines3.common.monitor import Monitor

    episodes = 0
    for env in base.envs:
        while not isinstance(env, Monitor):
            env = env.env
        episodes += len(env.get_episode_rewards())

    # Greedy evaluation on one env seeded like `oakemu evaluate --seed`.
    if normalize is not None:
        venv.training = False
    eval_env = gym.make(case.env_id)
    eval_returns = []
    obs, _ = eval_env.reset(seed=spec["eval_seed"])
    total = 0.0
    while len(eval_returns) < spec["eval_episodes"]:
        model_obs = (
            venv.normalize_obs(obs) if normalize is not None and normalize["norm_obs"] else obs
        )
        if case.action_masks:
            action, _ = model.predict(
                model_obs, deterministic=True, action_masks=taxi_mask(eval_env)
            )
        else:
            action, _ = model.predict(model_obs, deterministic=True)
        obs, reward, terminated, truncated, _ = eval_env.step(
            action.item() if action.shape == () else action
        )
        total += float(reward)
        if terminated or truncated:
            eval_returns.append(total)
            total = 0.0
            obs, _ = eval_env.reset()
    return {
        "wall_s": wall,
        "episodes": episodes,
        "last100": _mean(returns[-100:]),
        "eval": _mean(eval_returns),
        "env_steps": int(model.num_timesteps),
        "updates": int(model.num_timesteps // (case.num_envs * case.rollout_length)),
        "load_1min": [round(load_before, 2), round(load_after, 2)],
    }


def run_sb3(
    case: Case,
    *,
    seed: int,
    steps: int,
    eval_episodes: int,
    eval_seed: int,
    log_path: Path,
    torch_threads: int,
) -> dict:
    spec = {
        "torch_threads": torch_threads,
        "case": asdict(case),
        "kwargs": sb3_kwargs(case, seed=seed),
        "venv": sb3_vec_env_settings(case),
        "seed": seed,
        "steps": steps,
        "eval_episodes": eval_episodes,
        "eval_seed": eval_seed,
    }
    with open(log_path, "w") as log:
        process = subprocess.run(
            [sys.executable, __file__, "--sb3-worker", json.dumps(spec)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=3600,
            check=False,
        )
    if process.returncode != 0:
        raise RuntimeError(f"SB3 worker exited {process.returncode}; see {log_path}")
    return json.loads(process.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ main


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b != 0.0 and math.isfinite(a) and math.isfinite(b) else "n/a"


def print_configs(case_names: list[str], steps_override: int | None) -> None:
    for name in case_names:
        case = CASES[name]
        steps = steps_override or case.total_env_steps
        print(f"\n== {name}: {case.env_id}, {steps} env steps per run ==")
        print(
            "shared hyperparameters:",
            asdict(case),
            f"batch_size={case.batch_size}",
            f"rows_per_update={case.num_envs * case.rollout_length}",
        )
        print(
            "oakemu train",
            " ".join(
                oakemu_args(
                    case,
                    seed=0,
                    steps=steps,
                    runs_dir=Path("DIR"),
                    run_name="NAME",
                    ports=["P"] * 5,
                )
            ),
        )
        print("SB3:", sb3_vec_env_settings(case))
        print("SB3 kwargs:", sb3_kwargs(case, seed=0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["pendulum", "taxi"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument(
        "--steps", type=int, default=None, help="env steps per run (default: each case's, 100k)"
    )
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--eval-seed", type=int, default=1000)
    parser.add_argument(
        "--runs-dir", type=Path, default=None, help="keep run folders here (default: a temp dir)"
    )
    parser.add_argument(
        "--systems", nargs="+", choices=["oakemu", "sb3"], default=["oakemu", "sb3"]
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write every result to this JSON file"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads of the SB3 process and of OakEmu's learner (OMP_NUM_THREADS); "
        "OakEmu's actors use 1 (default 1: small MLPs on a shared 2-core machine)",
    )
    parser.add_argument("--sb3-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.sb3_worker:
        print(json.dumps(sb3_worker(json.loads(args.sb3_worker))))
        return 0

    print_configs(args.cases, args.steps)
    print(
        f"torch intra-op threads: {args.torch_threads} (SB3 process; OakEmu learner via OMP_NUM_THREADS; "
        "OakEmu actors --torch-threads 1)"
    )
    temp = None
    if args.runs_dir is None:
        temp = tempfile.TemporaryDirectory(prefix="bench_sb3_")
        runs_dir = Path(temp.name)
    else:
        runs_dir = args.runs_dir.resolve()
        runs_dir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for name in args.cases:
            case = CASES[name]
            steps = args.steps or case.total_env_steps
            for seed in args.seeds:
                row = {"case": name, "env": case.env_id, "seed": seed, "steps": steps}
                for system in args.systems:
                    print(f"\n-- {name} seed {seed}: {system} ...", flush=True)
                    if system == "oakemu":
                        result = run_oakemu(
                            case,
                            seed=seed,
                            steps=steps,
                            runs_dir=runs_dir,
                            eval_episodes=args.eval_episodes,
                            eval_seed=args.eval_seed,
                            torch_threads=args.torch_threads,
                        )
                    else:
                        result = run_sb3(
                            case,
                            seed=seed,
                            steps=steps,
                            eval_episodes=args.eval_episodes,
                            eval_seed=args.eval_seed,
                            log_path=runs_dir / f"sb3-{case.env_id}-s{seed}.log",
                            torch_threads=args.torch_threads,
                        )
                    print(f"   {system}: {result}", flush=True)
                    row[system] = result
                results.append(row)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=2))
    finally:
        if temp is not None:
            temp.cleanup()
    print_table(results, args.eval_episodes)
    return 0


def print_table(results: list[dict], eval_episodes: int) -> None:
    """Markdown table, one row per case and seed; a system not run shows as ``-``."""

    def cell(result: dict | None, key: str, spec: str) -> str:
        return "-" if result is None else format(result[key], spec)

    def diff(o: dict | None, s: dict | None, key: str) -> str:
        return "-" if o is None or s is None else f"{o[key] - s[key]:+.1f}"

    def ratio(o: dict | None, s: dict | None, key: str) -> str:
        return "-" if o is None or s is None else _ratio(o[key], s[key])

    print(
        "\n| env | seed | env steps OakEmu / SB3 | last-100 return OakEmu | SB3 | OakEmu - SB3 | ratio "
        f"| greedy eval ({eval_episodes} ep) OakEmu | SB3 | OakEmu - SB3 | wall s OakEmu | SB3 | ratio "
        "| OakEmu lag mean | stale rows | OakEmu acted steps |"
    )
    print("|" + " --- |" * 16)
    for row in results:
        o, s = row.get("oakemu"), row.get("sb3")
        print(
            f"| {row['env']} | {row['seed']} | {cell(o, 'env_steps', 'd')} / {cell(s, 'env_steps', 'd')} "
            f"| {cell(o, 'last100', '.1f')} | {cell(s, 'last100', '.1f')} | {diff(o, s, 'last100')} "
            f"| {ratio(o, s, 'last100')} "
            f"| {cell(o, 'eval', '.1f')} | {cell(s, 'eval', '.1f')} | {diff(o, s, 'eval')} "
            f"| {cell(o, 'wall_s', '.0f')} | {cell(s, 'wall_s', '.0f')} | {ratio(o, s, 'wall_s')} "
            f"| {cell(o, 'policy_lag_mean', '.2f')} | {cell(o, 'stale_rows', 'd')} "
            f"| {cell(o, 'acted_steps', 'd')} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
