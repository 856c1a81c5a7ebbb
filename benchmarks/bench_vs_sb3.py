"""Throughput and sample efficiency side by side: SB3 PPO, OakEmu-RL asynchronous, OakEmu-RL synchronous.

What it measures.  For each case and seed, three runs from scratch with the same PPO hyperparameters and
env-step budget, strictly one after another, the three systems interleaved (their order rotates with the
seed, so that a change of machine load does not always hit the same system):

* ``sb3``: Stable-Baselines3 ``PPO`` over ``DummyVecEnv`` in a child process of this script;
* ``oakemu-async``: ``oakemu train`` (a learner and 2 actor processes, ``--mode async``, the default;
  ``--max-policy-lag 2``, the default);
* ``oakemu-sync``: the same with ``--mode sync`` (on-policy: actors wait for the weights trained on
  their rollout, policy lag 0, as SB3).

Cases (hyperparameters: rl-baselines3-zoo's ``ppo.yml``, read from the presets ``oakemu_core/presets/
{cartpole,lunarlander,atari}.toml``; printed in full, both sides, before the runs):

* ``cartpole``: ``CartPole-v1``, 8 envs x 32 steps, 20 epochs, 1 minibatch (batch 256), lr 1e-3, clip
  0.2, gamma 0.98, lambda 0.8, no entropy bonus; 100k steps.  The zoo anneals lr and clip range
  linearly; OakEmu cannot anneal the clip range, so both sides keep both constant (``--no-anneal-lr``).
* ``lunarlander``: ``LunarLander-v3``, 16 envs x 1024 steps, 4 epochs, batch 64 (256 minibatches, so
  1,024 SGD steps per update), lr 3e-4, gamma 0.999, lambda 0.98, entropy 0.01; 1M steps (the zoo's).
* ``breakout``: ``ALE/Breakout-v5``, 8 envs x 128 steps, 4 epochs, 4 minibatches, lr 2.5e-4 (constant,
  the zoo anneals it), clip 0.1, entropy 0.01, training rewards clipped to [-1, 1] on both sides, no
  value clipping (SB3's default; OakEmu's Atari ``auto`` would clip, CleanRL style); 40k steps, a
  throughput case (at 40k steps nobody has learnt Breakout).  Networks: Nature CNN trunk shared by
  linear policy and value heads on both sides.  Preprocessing: OakEmu steps ale-py's threaded
  ``AtariVectorEnv``; the SB3 side builds the same preprocessing from Gymnasium wrappers, one env per
  ``DummyVecEnv`` slot: ``gym.make(id, frameskip=1)`` (v5: sticky actions 0.25, 108,000-frame limit) +
  ``AtariPreprocessing`` (up to 30 no-ops, frame skip 4 with max-pooling of the last two frames, 84 x 84
  grayscale, no life-loss terminal, no fire reset) + ``FrameStackObservation(4)`` + ``ClipReward(-1, 1)``
  under the ``Monitor`` (raw scores logged).  What differs: ale-py's C++ resize and stacking instead of
  OpenCV in Python, and env stepping in C++ threads instead of one Python loop; the rl-zoo's
  ``AtariWrapper`` would add life-loss terminals and fire-on-reset, which OakEmu does not do, so it is
  not used.

Both sides get the same network and loss.  One difference in meaning is compensated: OakEmu's value
loss is CleanRL's ``0.5 * mean((V - R)^2)`` while SB3's is ``mean((V - R)^2)``, so OakEmu gets
``--vf-coef`` = 2 x SB3's ``vf_coef`` (``OAKEMU_VF_COEF_PER_SB3``): the same loss, gradient and clipping.
Adam eps is 1e-5 on both sides; advantages are normalised per minibatch on both sides.  Torch intra-op
threads: ``--torch-threads`` (default 1) for the SB3 process, OakEmu's learner (``OMP_NUM_THREADS``)
and each OakEmu actor (``--torch-threads``).  OakEmu's periodic evaluation is off
(``--eval-every-updates 0``: SB3 does not evaluate either) and so are periodic checkpoints.  Each OakEmu
run gets its own free ports.

What the numbers mean.

* ``SPS``: env steps trained / wall seconds from launching the training process to its exit
  (interpreter start-up, imports, process start-up and shutdown included, same definition both sides).
  ``ratio`` = OakEmu / SB3 (above 1: OakEmu faster).  Medians over seeds are printed per case.
  OakEmu's own ``charts/SPS`` (learner start to the last update) is in the JSON.
* ``to N``: env steps until the mean raw return of the last 20 finished episodes first reaches N
  (CartPole: 475); ``-`` when it never did within the budget.  OakEmu: ``episodes.jsonl`` ordered by
  ``global_step``; SB3: the ``Monitor`` infos with ``num_timesteps`` when each episode ended.
* ``last100``: mean raw return of the last 100 finished training episodes (LunarLander: the return
  "at the step budget"); ``curve``: the mean return per tenth of the budget (printed per run).
* ``lag``: OakEmu's mean policy lag over updates, in versions and in SGD steps (0 in sync mode);
  ``stale``: rows dropped as older than ``max_policy_lag``; ``acted``: env steps in finished episodes,
  trained or not: above the trained steps when the learner threw actor steps away (it undercounts: the
  unfinished episodes at the end are left out).
* ``load``: the 1-minute load average before / after the run: on a shared machine the SPS figures are
  only comparable between runs with similar load.

How to run (inside ``. .venv/bin/activate`` with the ``bench`` extra: ``pip install -e .[bench]``)::

    python benchmarks/bench_vs_sb3.py --quick                          # every case, tiny budgets, 1 seed
    python benchmarks/bench_vs_sb3.py --cases cartpole --seeds 1 2 3   # CartPole, 100k steps, 3 seeds
    python benchmarks/bench_vs_sb3.py --steps cartpole=100000 lunarlander=300000 breakout=40000 \\
        --seeds cartpole=1,2 lunarlander=1 breakout=1 --json results.json

``--steps`` and ``--seeds`` take one value for every case or ``case=value`` items.  On a 2-core machine
CartPole 100k takes about one to two minutes per run, LunarLander 1M about 4-15 minutes per run,
Breakout 40k two to three minutes per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spaces_vs_sb3 import (  # the sibling benchmark's case table, flag builders and helpers
    NUM_ACTORS,
    REPO,
    Case,
    _free_ports,
    _mean,
    _ratio,
    _read_jsonl,
    case_from_preset,
    fresh_run_dir,
    oakemu_args,
    sb3_kwargs,
    sb3_vec_env_settings,
    train_oakemu,
)
from sb3_series import commit, curve, learn_logged

from oakemu_core.actor.fitting import fit_actor_count  # noqa: E402  (after the sibling import path)
from oakemu_core.config import available_cpus  # noqa: E402

OAKEMU_VF_COEF_PER_SB3 = 2.0
"""OakEmu's value loss is ``0.5 * MSE`` (CleanRL), SB3's is ``MSE``: OakEmu ``--vf-coef`` = 2 x SB3 ``vf_coef``."""

SYSTEMS = ("sb3", "oakemu-async", "oakemu-sync")


@dataclass(frozen=True)
class Bench:
    """One case: the shared hyperparameters (:class:`Case`, SB3's meaning of ``vf_coef``) and what to report."""

    case: Case
    quick_steps: int
    atari: bool = False
    threshold: float | None = (
        None  # report env steps until the `window`-episode mean return reaches this
    )
    window: int = 20


_MLP = "separate actor and critic MLPs 64-64 tanh, orthogonal init, categorical head"
_ZOO = {
    "vf_coef_per_sb3": OAKEMU_VF_COEF_PER_SB3,
    "max_policy_lag": 2,
}  # max_policy_lag: OakEmu's default (async only)


def sb3_default_case(env_id: str, total_env_steps: int = 1_000_000) -> Case:
    """A MuJoCo locomotion case at SB3 ``PPO``'s default hyperparameters (one env, ``n_steps`` 2048, batch 64,
    10 epochs, lr 3e-4, gamma 0.99, lambda 0.95, clip 0.2, no entropy bonus, ``vf_coef`` 0.5, gradient norm
    0.5) with observations and rewards normalised (``VecNormalize``; rl-baselines3-zoo's ``normalize: true``
    for these tasks); 1M steps, the zoo's budget. Needs ``gymnasium[mujoco]``."""
    return Case(
        env_id=env_id,
        total_env_steps=total_env_steps,
        num_envs=1,
        rollout_length=2048,
        ppo_epochs=10,
        num_minibatches=32,
        learning_rate=3e-4,
        gamma=0.99,
        gae_lambda=0.95,
        clip_coef=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        normalize_observations=True,
        normalize_rewards=True,
        action_masks=False,
        max_policy_lag=2,
    )


# The hyperparameters are the presets' (oakemu_core/presets/*.toml: rl-baselines3-zoo's values).
BENCHES: dict[str, Bench] = {
    "cartpole": Bench(
        case_from_preset("cartpole", net_arch=_MLP, **_ZOO), quick_steps=16_384, threshold=475.0
    ),
    "lunarlander": Bench(
        case_from_preset("lunarlander", net_arch=_MLP, **_ZOO), quick_steps=32_768
    ),
    "breakout": Bench(
        case_from_preset(
            "atari",
            total_env_steps=40_000,
            **_ZOO,
            net_arch="Nature CNN (3 conv + 512 ReLU) shared by linear policy and value heads, orthogonal init",
        ),
        quick_steps=4_096,
        atari=True,
    ),
    "pendulum": Bench(case_from_preset("pendulum", **_ZOO), quick_steps=8_192),
    "hopper": Bench(sb3_default_case("Hopper-v5"), quick_steps=8_192),
    "halfcheetah": Bench(sb3_default_case("HalfCheetah-v5"), quick_steps=8_192),
}


# --------------------------------------------------------------------------------------------- configs


def oakemu_bench_args(
    bench: Bench,
    *,
    mode: str,
    seed: int,
    steps: int,
    runs_dir: Path,
    run_name: str,
    ports: list,
    torch_threads: int,
    num_actors: int = NUM_ACTORS,
) -> list[str]:
    """``oakemu train`` flags: the sibling's :func:`oakemu_args` (every hyperparameter explicit) with the value
    loss coefficient translated, reward clipping for Atari, the mode, ``num_actors`` actor processes
    sharing the case's envs, and no periodic evaluation. The sibling's flags turn automatic rollback
    off, as SB3 has none (an update whose approx KL passed the rollback threshold ended a CartPole
    run at 500 return at 90k steps, with no checkpoint to go back to)."""
    case = replace(bench.case, vf_coef=bench.case.vf_coef * OAKEMU_VF_COEF_PER_SB3)
    if case.num_envs % num_actors:
        raise SystemExit(
            f"--actors {num_actors}: must divide the {case.num_envs} envs of {case.env_id}"
        )
    args = oakemu_args(
        case, seed=seed, steps=steps, runs_dir=runs_dir, run_name=run_name, ports=ports
    )
    args[args.index("--num-actors") + 1] = str(num_actors)
    args[args.index("--envs-per-actor") + 1] = str(case.num_envs // num_actors)
    if bench.atari:
        args = ["--clip-rewards" if arg == "--no-clip-rewards" else arg for arg in args]
    return [
        *args,
        "--mode",
        mode,
        "--torch-threads",
        str(torch_threads),
        "--eval-every-updates",
        "0",
    ]


def sb3_bench_kwargs(bench: Bench, *, seed: int) -> dict:
    """SB3 ``PPO`` keyword arguments: the sibling's :func:`sb3_kwargs`; for Atari SB3's ``CnnPolicy`` default
    (Nature CNN features shared, no hidden layers after them)."""
    kwargs = sb3_kwargs(bench.case, seed=seed)
    if bench.atari:
        kwargs["policy_kwargs"] = {
            "net_arch": [],
            "ortho_init": True,
            "share_features_extractor": True,
        }
    return kwargs


def sb3_policy(bench: Bench) -> str:
    return "CnnPolicy" if bench.atari else "MlpPolicy"


def sb3_env_description(bench: Bench) -> str:
    if bench.atari:
        return (
            "DummyVecEnv of Monitor(FrameStackObservation(AtariPreprocessing(gym.make(id, frameskip=1), noop_max=30, "
            "frame_skip=4, screen_size=84, terminal_on_life_loss=False, grayscale_obs=True), 4)) + ClipReward(-1, 1)"
        )
    normalize = sb3_vec_env_settings(bench.case)["VecNormalize"]
    return "make_vec_env(id, vec_env_cls=DummyVecEnv) (Monitor per env)" + (
        f" + VecNormalize(**{normalize})" if normalize else ""
    )


# ------------------------------------------------------------------------------------------------- SB3


def sb3_worker(spec: dict) -> dict:
    """Train one SB3 run (in a child process); returns timings and every finished episode. ``wall_s``
    here starts after the interpreter and this script's imports; :func:`run_sb3` replaces it with the
    time from launch to exit (kept as ``worker_wall_s``)."""
    start = time.perf_counter()
    import torch

    torch.set_num_threads(spec["torch_threads"])
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    bench = BENCHES[spec["name"]]
    case = bench.case
    if bench.atari:
        import ale_py
        from gymnasium.wrappers import (
            AtariPreprocessing,
            ClipReward,
            FrameStackObservation,
        )

        from oakemu_core.envs.atari import (
            ATARI_FRAME_SKIP,
            ATARI_IMAGE_SIZE,
            ATARI_NOOP_MAX,
            ATARI_STACK,
        )

        gym.register_envs(ale_py)

        def make_atari() -> gym.Env:
            env = gym.make(case.env_id, frameskip=1)
            env = AtariPreprocessing(
                env,
                noop_max=ATARI_NOOP_MAX,
                frame_skip=ATARI_FRAME_SKIP,
                screen_size=ATARI_IMAGE_SIZE,
                terminal_on_life_loss=False,
                grayscale_obs=True,
            )
            return FrameStackObservation(env, ATARI_STACK)

        venv = make_vec_env(
            make_atari,
            n_envs=case.num_envs,
            seed=spec["seed"],
            vec_env_cls=DummyVecEnv,
            wrapper_class=ClipReward,
            wrapper_kwargs={"min_reward": -1.0, "max_reward": 1.0},
        )
    else:
        venv = make_vec_env(
            case.env_id, n_envs=case.num_envs, seed=spec["seed"], vec_env_cls=DummyVecEnv
        )
    normalize = sb3_vec_env_settings(case)["VecNormalize"]
    if normalize is not None:  # outside the Monitors: episode returns stay raw
        venv = VecNormalize(venv, **normalize)

    model = PPO(sb3_policy(bench), venv, **spec["kwargs"])
    learn_start = time.perf_counter()
    logged = learn_logged(model, spec["steps"])
    end = time.perf_counter()
    return {
        "wall_s": end - start,
        "learn_s": end - learn_start,
        "env_steps": int(model.num_timesteps),
        "updates": int(model.num_timesteps // (case.num_envs * case.rollout_length)),
        "episodes": logged["episodes"],
    }


def run_sb3(name: str, *, seed: int, steps: int, runs_dir: Path, torch_threads: int) -> dict:
    spec = {
        "name": name,
        "seed": seed,
        "steps": steps,
        "torch_threads": torch_threads,
        "kwargs": sb3_bench_kwargs(BENCHES[name], seed=seed),
    }
    log_path = runs_dir / f"sb3-{name}-s{seed}.log"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()  # from launch to exit, as train_oakemu times `oakemu train`
    with open(log_path, "w") as log:
        process = subprocess.run(
            [sys.executable, __file__, "--sb3-worker", json.dumps(spec)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=7200,
            check=False,
        )
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"SB3 worker exited {process.returncode}; see {log_path}")
    result = json.loads(process.stdout.strip().splitlines()[-1])
    # The worker's own clock starts after the interpreter and this script's imports: kept as worker_wall_s.
    result["worker_wall_s"] = result.pop("wall_s")
    return {**result, "wall_s": wall}


# ---------------------------------------------------------------------------------------------- OakEmu


def run_oakemu_mode(
    name: str,
    *,
    mode: str,
    seed: int,
    steps: int,
    runs_dir: Path,
    torch_threads: int,
    num_actors: int = NUM_ACTORS,
) -> dict:
    run_name = f"oakemu-{mode}-{name}-s{seed}"
    run_dir = fresh_run_dir(runs_dir, run_name)
    args = oakemu_bench_args(
        BENCHES[name],
        mode=mode,
        seed=seed,
        steps=steps,
        runs_dir=runs_dir,
        run_name=run_name,
        ports=_free_ports(5),
        torch_threads=torch_threads,
        num_actors=num_actors,
    )
    wall = train_oakemu(
        args, log_path=runs_dir / f"{run_name}.log", torch_threads=torch_threads, timeout_s=7200
    )
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    episodes = sorted(_read_jsonl(run_dir / "episodes.jsonl"), key=lambda e: e["global_step"])

    def series(key: str) -> list[float]:
        return [m[key] for m in metrics if m.get(key) is not None]

    return {
        "wall_s": wall,
        "env_steps": int(metrics[-1]["global_step"]) if metrics else 0,
        "updates": len(metrics),
        "sps_logged": series("charts/SPS")[-1] if metrics else float("nan"),
        "policy_lag_mean": _mean(series("charts/policy_lag_mean")),
        "policy_lag_max": max(series("charts/policy_lag_max"), default=float("nan")),
        "lag_sgd_steps_mean": _mean(series("charts/policy_lag_sgd_steps_mean")),
        "stale_rows": int(sum(series("charts/stale_rows"))),
        "acted_steps": int(sum(e["episodic_length"] for e in episodes)),
        "episodes": [(int(e["global_step"]), float(e["episodic_return"])) for e in episodes],
    }


# ------------------------------------------------------------------------------------------- summaries


def steps_to_threshold(episodes: list, threshold: float | None, window: int) -> int | None:
    """Env steps at the first finished episode after which the last ``window`` episodes average >= threshold."""
    if threshold is None:
        return None
    returns = [r for _, r in episodes]
    for i in range(window, len(returns) + 1):
        if sum(returns[i - window : i]) / window >= threshold:
            return int(episodes[i - 1][0])
    return None


def summarize(result: dict, bench: Bench, steps: int, load: tuple[float, float]) -> dict:
    episodes = result.pop("episodes")
    result.update(
        sps=result["env_steps"] / result["wall_s"],
        episodes=len(episodes),
        last100=_mean([r for _, r in episodes][-100:]),
        to_threshold=steps_to_threshold(episodes, bench.threshold, bench.window),
        curve=curve(episodes, steps),
        load_1min=[round(load[0], 2), round(load[1], 2)],
    )
    return result


# ------------------------------------------------------------------------------------------------ main


def _per_case(values: list[str], names: list[str], parse, what: str) -> dict:
    """``["N"]`` (every case) or ``["case=N", ...]`` -> {case: parse(value)}; cases not named get None."""
    if all("=" not in v for v in values):
        return dict.fromkeys(names, parse(" ".join(values)))
    out: dict = dict.fromkeys(names)
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or key not in BENCHES:
            raise SystemExit(
                f"{what}: expected N or case=N with case in {sorted(BENCHES)}, received {item!r}"
            )
        out[key] = parse(value)
    return out


def _seeds(text: str) -> list[int]:
    return [int(s) for s in text.replace(",", " ").split()]


def print_configs(names: list[str], steps: dict, torch_threads: int, num_actors: int) -> None:
    for name in names:
        bench = BENCHES[name]
        case = bench.case
        print(f"\n== {name}: {case.env_id}, {steps[name]} env steps per run ==")
        print(
            "shared hyperparameters (vf_coef in SB3's meaning):",
            asdict(case),
            f"batch_size={case.batch_size}",
            f"rows_per_update={case.num_envs * case.rollout_length}",
            f"sgd_steps_per_update={case.ppo_epochs * case.num_minibatches}",
        )
        for mode in ("async", "sync"):
            print(
                f"oakemu train ({mode}):",
                " ".join(
                    oakemu_bench_args(
                        bench,
                        mode=mode,
                        seed=0,
                        steps=steps[name],
                        runs_dir=Path("DIR"),
                        run_name="NAME",
                        ports=["P"] * 5,
                        torch_threads=torch_threads,
                        num_actors=num_actors,
                    )
                ),
            )
        print(
            f"SB3: PPO({sb3_policy(bench)!r}, {sb3_env_description(bench)}, n_envs={case.num_envs}, "
            f"**{sb3_bench_kwargs(bench, seed=0)})"
        )


def run_all(
    names: list[str],
    steps: dict,
    seeds: dict,
    systems: list[str],
    runs_dir: Path,
    torch_threads: int,
    json_path: Path | None,
    num_actors: int = NUM_ACTORS,
) -> list[dict]:
    results = []
    for name in names:
        for index, seed in enumerate(seeds[name]):
            row: dict = {
                "case": name,
                "env": BENCHES[name].case.env_id,
                "seed": seed,
                "steps": steps[name],
            }
            order = (
                systems[index % len(systems) :] + systems[: index % len(systems)]
            )  # rotate with the seed
            for system in order:
                print(f"\n-- {name} seed {seed}: {system} ...", flush=True)
                load_before = os.getloadavg()[0]
                common = {
                    "seed": seed,
                    "steps": steps[name],
                    "runs_dir": runs_dir,
                    "torch_threads": torch_threads,
                }
                if system == "sb3":
                    result = run_sb3(name, **common)
                else:
                    result = run_oakemu_mode(
                        name, mode=system.removeprefix("oakemu-"), num_actors=num_actors, **common
                    )
                row[system] = summarize(
                    result, BENCHES[name], steps[name], (load_before, os.getloadavg()[0])
                )
                print(f"   {system}: {row[system]}", flush=True)
            results.append(row)
            if json_path:
                json_path.write_text(json.dumps(results, indent=2))
    return results


def _actors(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, received {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", choices=sorted(BENCHES), default=list(BENCHES))
    parser.add_argument(
        "--seeds",
        nargs="+",
        default=["1", "2"],
        help="seeds for every case (1 2) or per case (cartpole=1,2 breakout=1); default 1 2",
    )
    parser.add_argument(
        "--steps",
        nargs="+",
        default=None,
        help="env steps per run for every case (N) or per case (cartpole=100000 ...); "
        "default each case's (100k, 1M, 40k)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny budgets (cartpole 16k, lunarlander 32k, breakout 4k) and seed 1 unless given",
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads of the SB3 process, OakEmu's learner and each OakEmu actor",
    )
    parser.add_argument(
        "--actors",
        default="auto",
        type=_actors,
        help="OakEmu actor processes sharing each case's envs; auto: what `oakemu train` fits "
        "to this machine (oakemu_core.config.fit_actor_count; 1 on a 2-core machine)",
    )
    parser.add_argument(
        "--runs-dir", type=Path, default=None, help="keep run folders here (default: a temp dir)"
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write every result to this JSON file"
    )
    parser.add_argument(
        "--print-configs", action="store_true", help="print both sides' settings and exit"
    )
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print the tables of earlier --json files (merged by case, seed and steps) and exit",
    )
    parser.add_argument("--sb3-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.report:
        missing = [str(p) for p in args.report if not p.is_file()]
        if missing:
            raise SystemExit(f"--report: no such file: {', '.join(missing)}")
        print_table(merge_results(args.report))
        return 0

    if args.sb3_worker:
        print(json.dumps(sb3_worker(json.loads(args.sb3_worker))))
        return 0
    names = args.cases
    steps = _per_case(args.steps, names, int, "--steps") if args.steps else dict.fromkeys(names)
    steps = {
        n: steps[n] or (BENCHES[n].quick_steps if args.quick else BENCHES[n].case.total_env_steps)
        for n in names
    }
    seed_values = args.seeds if not (args.quick and args.seeds == ["1", "2"]) else ["1"]
    seeds = _per_case(seed_values, names, _seeds, "--seeds")
    names = [n for n in names if seeds[n]]
    fitted = {fit_actor_count(BENCHES[n].case.num_envs, available_cpus()) for n in names}
    if args.actors == "auto" and len(fitted) > 1:
        raise SystemExit(
            f"--actors auto fits {sorted(fitted)} actors to these cases' envs: run them one at a time"
        )
    num_actors = fitted.pop() if args.actors == "auto" else args.actors
    print_configs(names, steps, args.torch_threads, num_actors)
    settings = " ".join(
        f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("OAKEMU_")
    )
    print(
        f"\nnum_actors={num_actors}; torch intra-op threads {args.torch_threads} everywhere; "
        f"seeds {seeds}; systems {args.systems}; commit {commit()}; "
        f"OakEmu settings from the environment: {settings or 'none'}"
    )
    if args.print_configs:
        return 0
    temp = None if args.runs_dir else tempfile.TemporaryDirectory(prefix="bench_vs_sb3_")
    runs_dir = Path(temp.name) if temp else args.runs_dir.resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    try:
        results = run_all(
            names, steps, seeds, args.systems, runs_dir, args.torch_threads, args.json, num_actors
        )
    finally:
        if temp is not None:
            temp.cleanup()
    print_table(results)
    return 0


def print_table(results: list[dict]) -> None:
    """Markdown table: one row per case and seed, then the per-case medians; ``-`` for what was not run."""

    def get(row: dict, system: str, key: str):
        return row.get(system, {}).get(key)

    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    def ratio(row: dict, system: str) -> str:
        o, s = get(row, system, "sps"), get(row, "sb3", "sps")
        return "-" if o is None or s is None else _ratio(o, s)

    print(
        "\n| case | seed | steps | SPS SB3 | async | sync | async/SB3 | sync/SB3 | to-threshold SB3 | async | sync "
        "| last100 SB3 | async | sync | async lag versions / SGD steps (max) | async stale rows "
        "| acted async / sync | load SB3 / async / sync |"
    )
    print("|" + " --- |" * 18)
    for row in results:
        cells = [row["case"], str(row["seed"]), str(row["steps"])]
        cells += [fmt(get(row, s, "sps"), ",.0f") for s in SYSTEMS]
        cells += [ratio(row, "oakemu-async"), ratio(row, "oakemu-sync")]
        cells += [fmt(get(row, s, "to_threshold"), ",d") for s in SYSTEMS]
        cells += [fmt(get(row, s, "last100"), ".1f") for s in SYSTEMS]
        lag = (
            f"{fmt(get(row, 'oakemu-async', 'policy_lag_mean'), '.2f')} / "
            f"{fmt(get(row, 'oakemu-async', 'lag_sgd_steps_mean'), '.0f')} "
            f"({fmt(get(row, 'oakemu-async', 'policy_lag_max'), '.0f')})"
        )
        cells += [
            lag,
            fmt(get(row, "oakemu-async", "stale_rows"), ",d"),
            f"{fmt(get(row, 'oakemu-async', 'acted_steps'), ',d')} / {fmt(get(row, 'oakemu-sync', 'acted_steps'), ',d')}",
            " / ".join(fmt((get(row, s, "load_1min") or [None])[0], ".1f") for s in SYSTEMS),
        ]
        print("| " + " | ".join(cells) + " |")

    def median(rows: list[dict], system: str, key: str):
        values = [get(r, system, key) for r in rows if get(r, system, key) is not None]
        return statistics.median(values) if values else None

    for name in dict.fromkeys(r["case"] for r in results):
        rows = [r for r in results if r["case"] == name]

        sps = {s: median(rows, s, "sps") for s in SYSTEMS}
        ratios = {
            s: (
                statistics.median(
                    [
                        get(r, s, "sps") / get(r, "sb3", "sps")
                        for r in rows
                        if get(r, s, "sps") and get(r, "sb3", "sps")
                    ]
                )
                if sps[s] and sps["sb3"]
                else None
            )
            for s in ("oakemu-async", "oakemu-sync")
        }
        print(
            f"\n{name}: median SPS SB3 {fmt(sps['sb3'], ',.0f')}, async {fmt(sps['oakemu-async'], ',.0f')}, "
            f"sync {fmt(sps['oakemu-sync'], ',.0f')}; median ratio async/SB3 {fmt(ratios['oakemu-async'], '.2f')}, "
            f"sync/SB3 {fmt(ratios['oakemu-sync'], '.2f')}; median last100 "
            + ", ".join(f"{s} {fmt(median(rows, s, 'last100'), '.1f')}" for s in SYSTEMS)
        )
        for row in rows:
            for system in SYSTEMS:
                if system in row:
                    print(
                        f"  curve (mean return per tenth of {row['steps']:,} steps) seed {row['seed']} {system}: "
                        f"{row[system]['curve']}"
                    )
        print_means(rows)


def mean_curve(rows: list[dict], system: str) -> list[float] | None:
    """Per-window mean over the rows (seeds) that ran ``system`` (nan windows left out); None when none did."""
    curves = [row[system]["curve"] for row in rows if system in row]
    if not curves:
        return None
    return [round(_mean([c[i] for c in curves if c[i] == c[i]]), 1) for i in range(len(curves[0]))]


def print_means(rows: list[dict]) -> None:
    """Means over seeds per system: last-100 return, wall time, the return per window, and how each OakEmu
    mode compares with SB3: the last-100 return's difference (and ratio where SB3's is positive), the
    wall-time ratio, and the windows where the mode's mean return is within 5 % of SB3's or better
    (``mode >= sb3 - 0.05 * |sb3|``: 0.95 x SB3 for positive returns, 1.05 x for negative ones)."""
    sb3_curve = mean_curve(rows, "sb3")
    for system in SYSTEMS:
        done = [row[system] for row in rows if system in row]
        if not done:
            continue
        seeds = [row["seed"] for row in rows if system in row]
        last100, wall = _mean([r["last100"] for r in done]), _mean([r["wall_s"] for r in done])
        line = f"  {system}: seeds {seeds}, mean last100 {last100:.1f}, mean wall {wall:,.0f} s"
        sb3 = [row["sb3"] for row in rows if "sb3" in row]
        if system != "sb3" and sb3:
            reference = _mean([r["last100"] for r in sb3])
            ratio = f", {last100 / reference:.2f} x" if reference > 0 else ""
            line += (
                f" ({last100 - reference:+.1f} against SB3's return{ratio}; "
                f"{wall / _mean([r['wall_s'] for r in sb3]):.2f} x its wall)"
            )
        print(line)
        curve_here = mean_curve(rows, system)
        print(f"    mean curve: {curve_here}")
        if system != "sb3" and sb3_curve and curve_here:
            pairs = [
                (o, b) for o, b in zip(curve_here, sb3_curve, strict=True) if o == o and b == b
            ]
            held = sum(o >= b - 0.05 * abs(b) for o, b in pairs)
            print(
                f"    windows within 5 % of SB3's mean or better: {held} of {len(pairs)}; "
                f"differences {[round(o - b, 1) for o, b in pairs]}"
            )


def merge_results(paths: list[Path]) -> list[dict]:
    """Rows of several ``--json`` files merged by (case, seed, steps); a later file's system replaces an earlier one's."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        for row in json.loads(path.read_text()):
            key = (row["case"], row["seed"], row["steps"])
            merged.setdefault(key, {k: row[k] for k in ("case", "env", "seed", "steps")}).update(
                {s: row[s] for s in SYSTEMS if s in row}
            )
    return sorted(merged.values(), key=lambda r: (r["case"], r["steps"], r["seed"]))


if __name__ == "__main__":
    raise SystemExit(main())
