"""Recurrent policies side by side on a memory task: sb3-contrib RecurrentPPO, OakEmu-RL LSTM, OakEmu-RL feed-forward.

The task is ``CartPoleNoVel-v1`` (:mod:`oakemu_core.envs.memory`: CartPole-v1 observing the cart
position and the pole angle only), the budget rl-baselines3-zoo's 100k env steps.  For each seed,
the systems run from scratch one after another (their order rotates with the seed, so that a change
of machine load does not always hit the same system):

* ``sb3-recurrent``: sb3-contrib ``RecurrentPPO("MlpLstmPolicy")`` over ``DummyVecEnv`` +
  ``VecNormalize``, in a child process run by ``--sb3-python`` (a venv with stable-baselines3 and
  sb3-contrib; the project's venv needs neither);
* ``oakemu-recurrent``: ``oakemu train --recurrent lstm --recurrent-hidden 64 --sequence-length 32``
  (asynchronous, the default; ``--mode sync`` runs the same on-policy, recorded as
  ``oakemu-recurrent-sync``);
* ``oakemu-ff``: the same without the recurrent core: the feed-forward floor, which cannot see the
  velocities.

Settings: rl-baselines3-zoo's ``hyperparams/ppo_lstm.yml`` for ``CartPoleNoVel-v1`` (``normalize:
True``, ``n_envs`` 8, ``n_steps`` 32, ``batch_size`` 256, ``n_epochs`` 20, ``gamma`` 0.98,
``gae_lambda`` 0.8, ``ent_coef`` 0, ``learning_rate`` lin_1e-3, ``clip_range`` lin_0.2,
``policy_kwargs``: ``ortho_init=False``, ``activation_fn=nn.ReLU``, ``lstm_hidden_size=64``,
``enable_critic_lstm=True``, ``net_arch=dict(pi=[64], vf=[64])``), with RecurrentPPO's defaults for
the rest (``vf_coef`` 0.5, ``max_grad_norm`` 0.5, no value clipping, advantages normalised per
minibatch, Adam eps 1e-5).  Kept on both sides: every value above but the clip schedule; the learning
rate falls linearly to 0 over the budget on both sides (the zoo's ``lin_1e-3``; OakEmu's
``--anneal-lr`` per update); observations and rewards are normalised on both sides (``VecNormalize``
with ``gamma`` 0.98, clip 10; OakEmu's ``--normalize-observations --normalize-rewards``); OakEmu's
``--vf-coef`` is 2 x SB3's (its value loss is ``0.5 * MSE``, SB3's ``MSE``: the same loss).  Not
kept: the clip range is a constant 0.2 on both sides (OakEmu cannot anneal it, so SB3 does not
either).  The network is the zoo's on both sides: two LSTMs of 64, one for the actor and one for the
critic (OakEmu's default, ``--shared-core`` off), then ``pi=[64]`` / ``vf=[64]`` ReLU layers, PyTorch's
default initialisation throughout (the zoo's ``ortho_init=False``, OakEmu's ``--no-ortho-init``); the
records under ``shared-core/`` ran before those two options existed: one LSTM core shared by both torsos,
initialised orthogonally (CleanRL's).  Different by construction: RecurrentPPO's minibatch of 256 rows is the whole rollout cut into sequences at episode
starts, OakEmu's one minibatch is the 8 columns of 32 rows, each started from its stored state
(``--sequence-length 32``).  The feed-forward run gets the same flags without the core (where an
older ``oakemu train`` lacks ``--net-arch`` and ``--activation``: its default 64-64 tanh torsos;
each record holds the flags it ran with).
Torch intra-op threads: ``--torch-threads`` (default 1) for the SB3 process, OakEmu's learner and
each OakEmu actor; OakEmu's periodic evaluation and checkpoints are off (SB3 does neither here).

What the numbers mean (the definitions of ``bench_vs_sb3.py``):

* ``window k``: mean raw return of the training episodes that ended in the k-th tenth of the budget;
* ``last100``: mean raw return of the last 100 finished training episodes;
* ``SPS``: env steps trained / wall seconds from launching the training process to its exit;
* ``load``: the 1-minute load average before / after the run (SPS figures are comparable only between
  runs under similar load).

Each run writes ``<out>/<system>-seed<k>.json`` when it ends (an existing file is kept and its run
skipped, so a later session continues the series; ``--force`` runs it again).  ``--report`` prints
the Markdown tables for ``docs/benchmarks.md`` from those files: per system the per-window means over
seeds, last100, SPS, and each OakEmu system's ratio to ``sb3-recurrent`` (return per window, SPS).

How to run (inside ``. .venv/bin/activate``; the SB3 side needs its own venv, e.g.
``python -m venv /work/venv-sb3 && /work/venv-sb3/bin/pip install stable-baselines3 sb3-contrib &&
/work/venv-sb3/bin/pip install -e .``)::

    python benchmarks/bench_recurrent_vs_sb3.py --sb3-python /work/venv-sb3/bin/python --seeds 1 2 3
    python benchmarks/bench_recurrent_vs_sb3.py --systems oakemu-recurrent --mode sync --seeds 1
    python benchmarks/bench_recurrent_vs_sb3.py --report

On a 2-core machine one run of 100k steps takes a few minutes (RecurrentPPO's 20 epochs dominate).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spaces_vs_sb3 import (  # the sibling benchmarks' flag builders and helpers
    REPO,
    Case,
    _free_ports,
    _mean,
    _read_jsonl,
    fresh_run_dir,
    sb3_vec_env_settings,
    train_oakemu,
)
from bench_vs_sb3 import (
    Bench,
    oakemu_bench_args,
    steps_to_threshold,
)
from sb3_series import (
    WINDOWS,
    commit,
    curve,
    kept,
    learn_logged,
    linear_schedule,
    run_result,
    run_sb3_worker,
    sb3_worker_command,
    series,
    write_record,
)

from oakemu_core.actor.fitting import fit_actor_count  # noqa: E402  (after the sibling import path)
from oakemu_core.config import available_cpus  # noqa: E402

ENV_ID = "oakemu_core.envs.memory:CartPoleNoVel-v1"
SYSTEMS = ("sb3-recurrent", "oakemu-recurrent", "oakemu-ff")
REFERENCE = "sb3-recurrent"
RESULTS = REPO / "benchmarks" / "results" / "recurrent"

ZOO = (
    Case(  # rl-baselines3-zoo hyperparams/ppo_lstm.yml, CartPoleNoVel-v1; vf_coef in SB3's meaning
        env_id=ENV_ID,
        total_env_steps=100_000,
        num_envs=8,
        rollout_length=32,
        ppo_epochs=20,
        num_minibatches=1,  # batch_size 256 = 8 x 32
        learning_rate=1e-3,  # the start of lin_1e-3 (annealed on both sides)
        gamma=0.98,
        gae_lambda=0.8,
        clip_coef=0.2,  # the zoo's lin_0.2, constant here on both sides
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        normalize_observations=True,
        normalize_rewards=True,
        action_masks=False,
        max_policy_lag=2,  # OakEmu's default (async only)
        net_arch="LSTM 64 -> pi [64] / vf [64] ReLU, categorical head",
    )
)
LSTM_HIDDEN = 64
TORSOS = "pi=64 vf=64"  # OakEmu --net-arch for the zoo's net_arch=dict(pi=[64], vf=[64])
ACTIVATION = "relu"
ZOO_POLICY_KWARGS = {  # JSON-able; the worker turns "relu" into nn.ReLU
    "ortho_init": False,
    "activation_fn": ACTIVATION,
    "lstm_hidden_size": LSTM_HIDDEN,
    "enable_critic_lstm": True,
    "net_arch": {"pi": [64], "vf": [64]},
}
THRESHOLD = 475.0  # CartPole's reward threshold: env steps until a 20-episode mean reaches it


# --------------------------------------------------------------------------------------------- configs


def sb3_spec(*, seed: int, steps: int, torch_threads: int) -> dict:
    """The SB3 worker's JSON spec: ``RecurrentPPO("MlpLstmPolicy", venv, **kwargs)`` with the zoo's
    settings, its vector env (``sb3_vec_env_settings``) and ``learning_rate_schedule`` ("linear":
    ``progress_remaining * learning_rate``, the zoo's ``lin_``)."""
    kwargs = {
        "n_steps": ZOO.rollout_length,
        "batch_size": ZOO.batch_size,
        "n_epochs": ZOO.ppo_epochs,
        "learning_rate": ZOO.learning_rate,
        "gamma": ZOO.gamma,
        "gae_lambda": ZOO.gae_lambda,
        "clip_range": ZOO.clip_coef,
        "clip_range_vf": None,
        "ent_coef": ZOO.ent_coef,
        "vf_coef": ZOO.vf_coef,
        "max_grad_norm": ZOO.max_grad_norm,
        "normalize_advantage": ZOO.normalize_advantages,
        "target_kl": None,
        "stats_window_size": 100,
        "seed": seed,
        "device": "cpu",
        "verbose": 0,
        "policy_kwargs": dict(ZOO_POLICY_KWARGS),
    }
    return {
        "env_id": ENV_ID,
        "seed": seed,
        "steps": steps,
        "torch_threads": torch_threads,
        "policy": "MlpLstmPolicy",
        "learning_rate_schedule": "linear",
        "vec_env": {**sb3_vec_env_settings(ZOO), "algorithm": "sb3_contrib.RecurrentPPO"},
        "kwargs": kwargs,
    }


def sb3_command(sb3_python: str, spec: dict) -> list[str]:
    """The command line of one SB3 run: this script's ``--sb3-worker`` under ``sb3_python``."""
    return sb3_worker_command(sb3_python, __file__, spec)


def oakemu_system_args(
    system: str,
    *,
    mode: str,
    seed: int,
    steps: int,
    runs_dir: Path,
    run_name: str,
    ports: list,
    torch_threads: int,
    num_actors: int,
) -> list[str]:
    """``oakemu train`` flags of ``system`` (``oakemu-recurrent`` or ``oakemu-ff``): bench_vs_sb3's
    (every PPO value explicit, ``--vf-coef`` 2 x SB3's, no evaluation, no rollback) with the
    learning rate annealed, the zoo's torsos and activation, and for the recurrent system the LSTM
    core over sequences of one rollout column."""
    if system not in ("oakemu-recurrent", "oakemu-ff"):
        raise ValueError(f"system: expected oakemu-recurrent or oakemu-ff, received {system!r}")
    args = oakemu_bench_args(
        Bench(ZOO, quick_steps=ZOO.total_env_steps),
        mode=mode,
        seed=seed,
        steps=steps,
        runs_dir=runs_dir,
        run_name=run_name,
        ports=ports,
        torch_threads=torch_threads,
        num_actors=num_actors,
    )
    args = ["--anneal-lr" if arg == "--no-anneal-lr" else arg for arg in args]
    if system == "oakemu-recurrent" or network_options_known():
        args += ["--net-arch", TORSOS, "--activation", ACTIVATION, "--no-ortho-init"]
    if system == "oakemu-recurrent":
        args += [
            "--recurrent",
            "lstm",
            "--recurrent-hidden",
            str(LSTM_HIDDEN),
            "--sequence-length",
            str(ZOO.rollout_length),
        ]
    return args


def network_options_known() -> bool:
    """Whether this checkout's ``oakemu train`` takes ``--net-arch`` and ``--activation``."""
    from oakemu_core.config import OakEmuConfig

    return {"net_arch", "activation", "ortho_init"} <= set(OakEmuConfig.model_fields)


def system_label(system: str, mode: str) -> str:
    """The name a run is recorded under: OakEmu's synchronous runs get ``-sync``."""
    return f"{system}-sync" if system != REFERENCE and mode == "sync" else system


# ------------------------------------------------------------------------------------------------- SB3


def sb3_worker(spec: dict) -> dict:
    """Train one RecurrentPPO run (in a child process, the SB3 venv); returns every finished episode as
    ``(num_timesteps when it ended, raw return)``."""
    import torch

    torch.set_num_threads(spec["torch_threads"])
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    settings = spec["vec_env"]
    venv = make_vec_env(
        spec["env_id"], n_envs=settings["n_envs"], seed=spec["seed"], vec_env_cls=DummyVecEnv
    )
    if settings["VecNormalize"] is not None:  # outside the Monitors: episode returns stay raw
        venv = VecNormalize(venv, **settings["VecNormalize"])
    kwargs = dict(spec["kwargs"])
    policy_kwargs = dict(kwargs.pop("policy_kwargs"))
    policy_kwargs["activation_fn"] = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh}[
        policy_kwargs["activation_fn"]
    ]
    if spec["learning_rate_schedule"] == "linear":
        kwargs["learning_rate"] = linear_schedule(kwargs["learning_rate"])
    model = RecurrentPPO(spec["policy"], venv, policy_kwargs=policy_kwargs, **kwargs)
    return learn_logged(model, spec["steps"])


def run_sb3(*, sb3_python: str, seed: int, steps: int, runs_dir: Path, torch_threads: int) -> dict:
    spec = sb3_spec(seed=seed, steps=steps, torch_threads=torch_threads)
    result = run_sb3_worker(  # wall_s from launch to exit, as train_oakemu times `oakemu train`
        sb3_command(sb3_python, spec),
        log_path=runs_dir / f"sb3-recurrent-s{seed}.log",
        timeout_s=7200,
    )
    return {**result, "settings": spec}


# ---------------------------------------------------------------------------------------------- OakEmu


def run_oakemu(
    system: str,
    *,
    mode: str,
    seed: int,
    steps: int,
    runs_dir: Path,
    torch_threads: int,
    num_actors: int,
) -> dict:
    run_name = f"{system_label(system, mode)}-s{seed}"
    run_dir = fresh_run_dir(runs_dir, run_name)
    args = oakemu_system_args(
        system,
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
    stale = sum(m.get("charts/stale_rows", 0.0) for m in _read_jsonl(run_dir / "metrics.jsonl"))
    return {
        **run_result(run_dir, wall),
        "stale_rows": int(stale),
        "settings": {"oakemu_train": args},
    }


# ------------------------------------------------------------------------------------------- summaries


def summarize(result: dict, *, system: str, seed: int, steps: int, load: tuple) -> dict:
    """One run's record: the measures of the module docstring and the settings it ran with."""
    episodes = result.pop("episodes")
    return {
        "system": system,
        "env": ENV_ID,
        "seed": seed,
        "steps": steps,
        "commit": commit(),
        "episodes": len(episodes),
        "curve": curve(episodes, steps, WINDOWS),
        "last100": round(_mean([r for _, r in episodes][-100:]), 2),
        "to_475": steps_to_threshold(episodes, THRESHOLD, 20),
        "sps": result["env_steps"] / result["wall_s"],
        "load_1min": [round(load[0], 2), round(load[1], 2)],
        **result,
    }


def result_path(out: Path, label: str, seed: int) -> Path:
    return out / f"{label}-seed{seed}.json"


def run_all(
    systems: list[str],
    seeds: list[int],
    *,
    mode: str,
    steps: int,
    out: Path,
    runs_dir: Path,
    torch_threads: int,
    num_actors: int,
    sb3_python: str,
    force: bool,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for seed, system in series(seeds, systems):
        label = system_label(system, mode)
        path = result_path(out, label, seed)
        if kept(path, force, f"{label} seed {seed}"):
            continue
        print(f"\n-- {label} seed {seed}, {steps:,} steps ...", flush=True)
        load_before = os.getloadavg()[0]
        common = {"seed": seed, "steps": steps, "runs_dir": runs_dir}
        if system == REFERENCE:
            result = run_sb3(sb3_python=sb3_python, torch_threads=torch_threads, **common)
        else:
            result = run_oakemu(
                system, mode=mode, torch_threads=torch_threads, num_actors=num_actors, **common
            )
        record = summarize(
            result, system=label, seed=seed, steps=steps, load=(load_before, os.getloadavg()[0])
        )
        write_record(path, record)
        shown = {k: record[k] for k in ("curve", "last100", "to_475", "sps", "load_1min")}
        print(f"   {label} seed {seed}: {shown} -> {path}", flush=True)


# -------------------------------------------------------------------------------------------- report


RECORD_KEYS = ("system", "seed", "steps", "curve", "last100", "sps", "wall_s", "load_1min")


def load_records(paths: list[Path]) -> list[dict]:
    """The run records in ``paths`` (files, or folders of ``*.json``), in name order.

    Raises:
        SystemExit: a path that does not exist, or a file that is not a run record.
    """
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(path.glob("*.json"))
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"--report: no such file or folder: {path}")
    records = []
    for file in files:
        try:
            record = json.loads(file.read_text())
        except ValueError as error:
            raise SystemExit(f"--report: {file} is not JSON ({error})") from None
        missing = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
        if missing:
            raise SystemExit(
                f"--report: {file} is not a run record (it lacks {', '.join(missing)})"
            )
        records.append(record)
    return records


def summarize_systems(records: list[dict]) -> dict[tuple[str, int], dict]:
    """Means over seeds per (system, steps): ``curve`` (per window, over the seeds where an episode
    ended in it; nan where none did), ``last100``, ``sps``, ``wall_s``, ``seeds`` and ``load``
    (mean 1-minute load before and after)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["system"], int(record["steps"])), []).append(record)
    table = {}
    for key, runs in sorted(groups.items()):
        windows = len(runs[0]["curve"])
        table[key] = {
            "seeds": sorted(r["seed"] for r in runs),
            "curve": [
                _mean([r["curve"][i] for r in runs if _finite(r["curve"][i])])
                for i in range(windows)
            ],
            "last100": _mean([r["last100"] for r in runs]),
            "sps": _mean([r["sps"] for r in runs]),
            "wall_s": _mean([r["wall_s"] for r in runs]),
            "load": [_mean([r["load_1min"][i] for r in runs]) for i in (0, 1)],
        }
    return table


def ratios(table: dict[tuple[str, int], dict]) -> dict[tuple[str, int], dict]:
    """Each OakEmu system's means over ``sb3-recurrent``'s at the same budget: per window, last100 and
    SPS (None where either is missing or the reference is 0 or nan)."""
    out = {}
    for (system, steps), row in table.items():
        reference = table.get((REFERENCE, steps))
        if system == REFERENCE or reference is None:
            continue
        out[(system, steps)] = {
            "curve": [
                _divide(a, b) for a, b in zip(row["curve"], reference["curve"], strict=False)
            ],
            "last100": _divide(row["last100"], reference["last100"]),
            "sps": _divide(row["sps"], reference["sps"]),
        }
    return out


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _divide(a: float | None, b: float | None) -> float | None:
    return a / b if _finite(a) and _finite(b) and b != 0 else None


def _cell(value: float | None, spec: str) -> str:
    return format(value, spec) if _finite(value) else "-"


def print_report(records: list[dict]) -> None:
    """The Markdown tables of ``records``: means over seeds per system, then the ratios to SB3."""
    table = summarize_systems(records)
    windows = max((len(row["curve"]) for row in table.values()), default=WINDOWS)
    heads = " | ".join(f"w{i + 1}" for i in range(windows))
    print(
        f"Mean raw return per {100 // windows} % window of the budget (w1 .. w{windows}), last-100 "
        "return, env steps/s and wall time: means over the seeds; load: mean 1-minute load average "
        "before / after.\n"
    )
    print(f"| system | steps | seeds | {heads} | last100 | SPS | wall s | load |")
    print("|" + " --- |" * (windows + 7))
    for (system, steps), row in table.items():
        cells = [system, f"{steps:,}", ",".join(map(str, row["seeds"]))]
        cells += [_cell(v, ".1f") for v in row["curve"]]
        cells += [
            _cell(row["last100"], ".1f"),
            _cell(row["sps"], ",.0f"),
            _cell(row["wall_s"], ".0f"),
        ]
        cells.append(" / ".join(_cell(v, ".1f") for v in row["load"]))
        print("| " + " | ".join(cells) + " |")
    relative = ratios(table)
    if not relative:
        return
    print(f"\nRatio to {REFERENCE} (means over seeds; above 1: more return, or faster).\n")
    print(f"| system / {REFERENCE} | steps | {heads} | last100 | SPS |")
    print("|" + " --- |" * (windows + 4))
    for (system, steps), row in relative.items():
        cells = [system, f"{steps:,}", *(_cell(v, ".2f") for v in row["curve"])]
        cells += [_cell(row["last100"], ".2f"), _cell(row["sps"], ".2f")]
        print("| " + " | ".join(cells) + " |")


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="default 1 2 3")
    parser.add_argument(
        "--steps",
        type=int,
        default=ZOO.total_env_steps,
        help="env steps per run (default: the zoo's 100k)",
    )
    parser.add_argument(
        "--mode", choices=("async", "sync"), default="async", help="OakEmu's mode (default async)"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"folder of the run records (default {RESULTS})"
    )
    parser.add_argument(
        "--sb3-python",
        default=sys.executable,
        help="python of a venv with stable-baselines3 and sb3-contrib (default: this one)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads of the SB3 process, OakEmu's learner and each OakEmu actor",
    )
    parser.add_argument(
        "--actors",
        type=int,
        default=None,
        help="OakEmu actor processes sharing the 8 envs (default: what `oakemu train` fits here)",
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=None,
        help="keep run folders and logs here (default: a temp dir)",
    )
    parser.add_argument("--force", action="store_true", help="run again where a record exists")
    parser.add_argument(
        "--print-configs", action="store_true", help="print both sides' settings and exit"
    )
    parser.add_argument(
        "--report",
        nargs="*",
        type=Path,
        metavar="PATH",
        help="print the Markdown tables of the records in these files or folders (default --out) and exit",
    )
    parser.add_argument("--sb3-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.sb3_worker:
        print(json.dumps(sb3_worker(json.loads(args.sb3_worker))))
        return 0
    if args.report is not None:
        print_report(load_records(args.report or [args.out]))
        return 0
    if args.steps < ZOO.batch_size:
        raise SystemExit(
            f"--steps: expected at least one rollout ({ZOO.batch_size}), received {args.steps}"
        )
    num_actors = args.actors or fit_actor_count(ZOO.num_envs, available_cpus())
    print(f"{ENV_ID}, {args.steps:,} env steps per run; shared hyperparameters (SB3's vf_coef):")
    print(asdict(ZOO), f"batch_size={ZOO.batch_size}")
    print("SB3:", sb3_spec(seed=0, steps=args.steps, torch_threads=args.torch_threads))
    for system in ("oakemu-recurrent", "oakemu-ff"):
        flags = oakemu_system_args(
            system,
            mode=args.mode,
            seed=0,
            steps=args.steps,
            runs_dir=Path("DIR"),
            run_name="NAME",
            ports=["P"] * 5,
            torch_threads=args.torch_threads,
            num_actors=num_actors,
        )
        print(f"{system_label(system, args.mode)}: oakemu train {' '.join(flags)}")
    print(f"seeds {args.seeds}; systems {args.systems}; commit {commit()}; out {args.out}")
    if args.print_configs:
        return 0
    temp = None if args.runs_dir else tempfile.TemporaryDirectory(prefix="bench_recurrent_")
    runs_dir = Path(temp.name) if temp else args.runs_dir.resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    try:
        run_all(
            args.systems,
            args.seeds,
            mode=args.mode,
            steps=args.steps,
            out=args.out.resolve(),
            runs_dir=runs_dir,
            torch_threads=args.torch_threads,
            num_actors=num_actors,
            sb3_python=args.sb3_python,
            force=args.force,
        )
    finally:
        if temp is not None:
            temp.cleanup()
    print_report(load_records([args.out]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
