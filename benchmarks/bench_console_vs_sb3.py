"""Console games side by side: SB3 PPO on the project's own emulator envs beside ``oakemu train --preset airstriker``.

Games (``--game``):

* ``airstriker``: ``retro:Airstriker-Genesis-v0`` (stable-retro's Genesis game, shipped with its ROM), the
  ``airstriker`` preset's budget of 200k env steps;
* ``gameboy``: the generated Game Boy test ROM (``oakemu_core/envs/emulators/testrom.py``) with the task of
  :data:`GAMEBOY_SETTINGS`: +1 per new press of A, 4 frames per agent step, 32-step episodes (random play
  scores 32/9 = 3.6 on average, the best possible is 32); 100k env steps (:data:`GAMES`).

For each seed the systems train from scratch one after another (their order rotates with the seed, so
that a change of machine load does not always hit the same system):

* ``oakemu``: ``oakemu train --preset airstriker --total-env-steps N --seed S --device cpu`` (the Game Boy:
  plus ``--env gameboy:<ROM> --emulator-settings <TOML>``), and nothing else but ``--oakemu-args``: the
  preset as a user gets it (async, 4 envs: Airstriker 4 actors x 1 emulator, the Game Boy 1 actor x 4;
  training rewards clipped to [-1, 1]; sampled evaluations of 5 episodes every 25 updates, recorded as
  ``evaluations``). Its ``episodes.jsonl`` holds the raw game scores.
* ``sb3``: Stable-Baselines3 ``PPO("CnnPolicy")`` (the Nature CNN, linear policy and value heads) with the
  preset's hyperparameters (:func:`sb3_spec`: 4 envs x 128 steps, 4 epochs of batch 128, learning rate
  2.5e-4 annealed linearly to 0, clip 0.1, entropy 0.01, ``vf_coef`` 0.25, which is the preset's 0.5 in
  SB3's meaning: OakEmu-RL's value loss is 0.5 x MSE, SB3's the MSE; max grad norm 0.5, gamma 0.99, GAE
  lambda 0.95, no value clipping). Each env slot is the project's own env
  (:func:`oakemu_core.envs.emulators.make_emulator_env`: the same frame skip, 84 x 84 (Game Boy 72 x 80)
  grey frames x 4, the same time limit), env ``i`` seeded ``seed + i``, with a ``Monitor`` logging the
  raw game score under ``gymnasium.wrappers.ClipReward(-1, 1)`` (the training rewards). stable-retro
  runs one emulator per process, so Airstriker's envs run in a ``SubprocVecEnv`` (one process each, as
  OakEmu's 4 actors); the Game Boy's in a ``DummyVecEnv`` (one process, as OakEmu's one actor). It runs
  in a child process under ``--sb3-python`` (a venv with stable-baselines3, stable-retro, PyBoy and the
  project; the project's venv needs no SB3). No periodic evaluation.
* ``random``: ``--random-episodes`` episodes of uniformly random actions (the action space's ``sample``:
  what an untrained policy samples) on the evaluation env (:func:`oakemu_core.envs.make_eval_env`),
  seeded ``seed + 1000``: the baseline.

Torch intra-op threads: ``--torch-threads`` (default 1) for the SB3 process and OakEmu's learner
(``--learner-threads``; its actors use 1 each anyway); 0 leaves each side's default (torch's, one per
core, whose threads wait on each other on a busy machine: docs/benchmarks.md).

What the numbers mean (``bench_vs_sb3.py``'s definitions): ``window k``: the mean raw game score of the
training episodes that ended in the k-th tenth of the budget; ``last100``: of the last 100 training
episodes; ``wall``: seconds from launching the training process to its exit; ``SPS``: env steps
trained / ``wall``; ``load``: the 1-minute load average before / after the run and its mean over the
run (sampled every 30 s; on a shared machine SPS and wall figures compare only between runs under
similar load).

Each run writes ``<out>/<game>/<label>-seed<k>-<steps>.json`` when it ends (random play:
``random-seed<k>-<episodes>ep.json``; an existing file is kept and its run skipped, so later sessions
continue the series; ``--force`` runs it again). ``--report`` prints the Markdown table for
``docs/benchmarks.md`` from those files.

How to run (inside ``. .venv/bin/activate``; the SB3 side needs its own venv, e.g. ``python -m venv
/work/venv-sb3 && /work/venv-sb3/bin/pip install stable-baselines3 stable-retro pyboy && /work/venv-sb3/bin/pip
install -e .``)::

    python benchmarks/bench_console_vs_sb3.py --game airstriker --sb3-python /work/venv-sb3/bin/python
    python benchmarks/bench_console_vs_sb3.py --game gameboy --sb3-python /work/venv-sb3/bin/python --seeds 1 2
    python benchmarks/bench_console_vs_sb3.py --game gameboy --systems oakemu random --quick --out /tmp/c
    python benchmarks/bench_console_vs_sb3.py --report

``--quick``: a smoke run of 1,024 env steps and 3 random episodes (for tests; not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spaces_vs_sb3 import REPO, _mean  # sibling helpers
from sb3_series import (
    WINDOWS,
    commit,
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
from showcase_airstriker import read_curve

SYSTEMS = ("sb3", "oakemu", "random")
REFERENCE = "sb3"
PRESET = "airstriker"
RESULTS = REPO / "benchmarks" / "results" / "console"
TIMEOUT_S = 4 * 3600
RANDOM_SEED_OFFSET = 1000
QUICK_STEPS = 1024
QUICK_EPISODES = 3
LOAD_SAMPLE_S = 30.0

GAMEBOY_SETTINGS = """\
# The generated test ROM (oakemu_core/envs/emulators/testrom.py): +1 per new press of A (RAM 0xC000),
# 4 frames per agent step (A held for 2 of them), 32-step episodes.
[gameboy]
frames_per_action = 4
press_frames = 2
max_episode_steps = 32

[[gameboy.reward]]
name = "a_presses"
kind = "delta"
address = 0xC000
"""


@dataclass(frozen=True)
class Game:
    """One game of the benchmark: its env id (the Game Boy's names a ROM written per run folder), the
    default budget in env steps, its emulator settings file's text (None: the defaults) and whether SB3
    needs one process per env (stable-retro)."""

    name: str
    env_id: str
    steps: int
    settings: str | None
    subprocesses: bool


GAMES: dict[str, Game] = {
    "airstriker": Game("airstriker", "retro:Airstriker-Genesis-v0", 200_000, None, True),
    "gameboy": Game("gameboy", "gameboy:{rom}", 100_000, GAMEBOY_SETTINGS, False),
}


def result_path(out: Path, game: str, label: str, seed: int, steps: int) -> Path:
    return out / game / f"{label}-seed{seed}-{steps}.json"


def random_path(out: Path, game: str, seed: int, episodes: int) -> Path:
    return out / game / f"random-seed{seed}-{episodes}ep.json"


def game_files(game: Game, folder: Path) -> tuple[str, str | None]:
    """``(env id, settings file or None)`` of ``game``; the Game Boy's ROM and settings file are written
    to ``folder`` (created)."""
    if game.settings is None:
        return game.env_id, None
    from oakemu_core.envs.emulators.testrom import write_test_rom

    folder.mkdir(parents=True, exist_ok=True)
    rom = write_test_rom(folder / "test.gb")
    settings = folder / "emulator.toml"
    settings.write_text(game.settings)
    return game.env_id.format(rom=rom), str(settings)


# ------------------------------------------------------------------------------------------------- SB3


def sb3_spec(
    *,
    env_id: str,
    settings_file: str | None,
    subprocesses: bool,
    seed: int,
    steps: int,
    torch_threads: int = 1,
) -> dict:
    """What the SB3 side trains with: the ``airstriker`` preset's settings (with the configuration's
    defaults) as SB3's ``PPO`` keyword arguments, the env and the vector env kind.

    ``vf_coef`` is halved (OakEmu-RL's value loss is 0.5 x MSE, SB3's the MSE); ``clip_range_vf`` is the
    preset's resolved ``clip_value_range`` (None for emulator ids); ``learning_rate`` falls linearly to 0
    when the preset anneals it (``"lin"`` schedule). ``torch_threads``: 0 keeps torch's default.
    """
    from oakemu_core.config import OakEmuConfig
    from oakemu_core.presets import load_preset

    config = OakEmuConfig(**{**load_preset(PRESET).settings, "env_id": env_id})
    num_envs = config.num_envs or config.num_actors * config.envs_per_actor
    return {
        "env_id": env_id,
        "settings_file": settings_file,
        "seed": seed,
        "steps": steps,
        "n_envs": num_envs,
        "vec_env": "subproc" if subprocesses else "dummy",
        "torch_threads": torch_threads,
        "clip_rewards": bool(config.resolved_clip_rewards),
        "schedule": "lin" if config.anneal_lr else "constant",
        "ppo": {
            "n_steps": config.rollout_length,
            "batch_size": config.rollout_length * num_envs // config.num_minibatches,
            "n_epochs": config.ppo_epochs,
            "learning_rate": config.learning_rate,
            "clip_range": config.clip_coef,
            "clip_range_vf": config.resolved_clip_value_range,
            "ent_coef": config.ent_coef,
            "vf_coef": config.vf_coef / 2,
            "max_grad_norm": config.max_grad_norm,
            "gamma": config.gamma,
            "gae_lambda": config.gae_lambda,
            "normalize_advantage": config.normalize_advantages,
            "target_kl": config.target_kl,
        },
    }


def project_env(
    env_id: str, settings_file: str | None, seed: int, clip_rewards: bool, monitor: Any = None
) -> Any:
    """One SB3 env slot: the project's emulator env (preprocessing and time limit included), ``monitor``
    (a wrapper class, e.g. SB3's ``Monitor``) on it, reward clipping to [-1, 1] above that."""
    import gymnasium

    from oakemu_core.envs.emulators import make_emulator_env

    env = make_emulator_env(env_id, max_episode_steps=None, settings_file=settings_file, seed=seed)
    if monitor is not None:
        env = monitor(env)
    if clip_rewards:
        env = gymnasium.wrappers.ClipReward(env, -1.0, 1.0)
    return env


def _monitored_env(env_id: str, settings_file: str | None, seed: int, clip_rewards: bool) -> Any:
    from stable_baselines3.common.monitor import Monitor

    return project_env(env_id, settings_file, seed, clip_rewards, monitor=Monitor)


def sb3_worker(spec: dict) -> dict:
    """Train one SB3 run (in a child process, the SB3 venv); returns every finished episode as
    ``(num_timesteps when it ended, raw score)``."""
    import functools

    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    env = (spec["env_id"], spec["settings_file"])
    makers = [
        functools.partial(_monitored_env, *env, spec["seed"] + i, spec["clip_rewards"])
        for i in range(spec["n_envs"])
    ]
    if spec["torch_threads"]:
        torch.set_num_threads(spec["torch_threads"])
    venv = SubprocVecEnv(makers) if spec["vec_env"] == "subproc" else DummyVecEnv(makers)
    venv.seed(spec["seed"])
    start_s = time.perf_counter()

    def progress(log: Any) -> None:  # in the worker's log, every 10th rollout
        if log.model._n_updates % (10 * spec["ppo"]["n_epochs"]) == 0:
            recent = [r for _, r in log.episodes[-100:]]
            print(
                f"{log.num_timesteps} env steps, {time.perf_counter() - start_s:.0f} s, "
                f"{len(log.episodes)} episodes, last-100 {_mean(recent):.1f}",
                file=sys.stderr,
                flush=True,
            )

    ppo = dict(spec["ppo"])
    start = ppo.pop("learning_rate")
    learning_rate = linear_schedule(start) if spec["schedule"] == "lin" else start
    model = PPO(
        "CnnPolicy",
        venv,
        learning_rate=learning_rate,
        seed=spec["seed"],
        device="cpu",
        verbose=0,
        **ppo,
    )
    try:  # the Monitor under the clipping: the raw game score
        return learn_logged(model, spec["steps"], on_rollout_end=progress)
    finally:
        venv.close()


def run_sb3(*, sb3_python: str, spec: dict, runs_dir: Path, log_name: str) -> dict:
    result = run_sb3_worker(
        sb3_worker_command(sb3_python, __file__, spec),
        log_path=runs_dir / f"{log_name}.log",
        timeout_s=TIMEOUT_S,
    )
    return {**result, "settings": {"sb3": spec}}


# ---------------------------------------------------------------------------------------------- OakEmu


def oakemu_command(
    *,
    env_id: str,
    settings_file: str | None,
    seed: int,
    steps: int,
    runs_dir: Path,
    run_name: str,
    torch_threads: int,
    extra: list[str],
) -> list[str]:
    """``oakemu train --preset airstriker`` with the budget, seed and run folder (and, for another env than
    the preset's, ``--env`` and ``--emulator-settings``; ``--learner-threads`` unless ``torch_threads``
    is 0); evaluation as the preset has it."""
    env = [] if env_id == GAMES["airstriker"].env_id else ["--env", env_id]
    if settings_file is not None:
        env += ["--emulator-settings", settings_file]
    if torch_threads:
        env += ["--learner-threads", str(torch_threads)]
    return preset_command(
        PRESET,
        steps=steps,
        seed=seed,
        runs_dir=runs_dir,
        run_name=run_name,
        leading=env,
        trailing=["--device", "cpu"],
        extra=extra,
    )


def run_oakemu(*, runs_dir: Path, run_name: str, **command_args: Any) -> dict:
    """Run :func:`oakemu_command` (``command_args``: its other arguments) and read the run folder."""
    command = oakemu_command(runs_dir=runs_dir, run_name=run_name, **command_args)
    result = train_oakemu_run(command, runs_dir=runs_dir, run_name=run_name, timeout_s=TIMEOUT_S)
    evaluations = read_curve((runs_dir / run_name / "metrics.jsonl").read_text().splitlines())
    return {
        **result,
        "evaluations": [
            [step, round(mean, 2), round(std, 2)]
            for step, mean, std in zip(
                evaluations.eval_steps, evaluations.eval_means, evaluations.eval_stds
            )
        ],
        "settings": {"oakemu_train": command[3:]},
    }


# ---------------------------------------------------------------------------------------------- random


def random_returns(env_id: str, settings_file: str | None, episodes: int, seed: int) -> list[float]:
    """Raw returns of ``episodes`` episodes of uniformly random actions on the evaluation env."""
    import numpy as np

    from oakemu_core.envs import make_eval_env

    env = make_eval_env(env_id, seed=seed, settings_file=settings_file)
    space = env.spec.action_space
    space.seed(seed)
    returns: list[float] = []
    try:
        env.reset()
        while len(returns) < episodes:
            returns.extend(env.step(np.stack([space.sample()])).episode_returns)
    finally:
        env.close()
    return [float(r) for r in returns[:episodes]]


# ------------------------------------------------------------------------------------------- records


class LoadSampler:
    """The 1-minute load average every ``period`` seconds while in a ``with`` block (a daemon thread);
    ``figures()`` gives ``[before, after, mean of the samples]``."""

    def __init__(self, period: float = LOAD_SAMPLE_S) -> None:
        self.period = period
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def figures(self) -> list[float]:
        return [
            round(self.samples[0], 2),
            round(self.samples[-1], 2),
            round(_mean(self.samples), 2),
        ]


def random_record(returns: list[float], *, seed: int, wall_s: float) -> dict:
    """The random-play baseline's record: mean and population std of the raw returns."""
    import numpy as np

    return {
        "system": "random",
        "seed": seed,
        "episodes": len(returns),
        "mean": round(float(np.mean(returns)), 2),
        "std": round(float(np.std(returns)), 2),
        "returns": returns,
        "wall_s": wall_s,
        "commit": commit(),
    }


def run_one(args: argparse.Namespace, system: str, seed: int, runs_dir: Path) -> None:
    """Train (or play, for ``random``) one run of ``args.game`` and write its record."""
    game = GAMES[args.game]
    env_id, settings_file = game_files(game, runs_dir / f"{game.name}-rom")
    label = args.label if system == "oakemu" else system
    if system == "random":
        path = random_path(args.out, game.name, seed, args.random_episodes)
    else:
        path = result_path(args.out, game.name, label, seed, args.steps)
    if kept(path, args.force, f"{label} {game.name} seed {seed}"):
        return
    print(f"-- {label} {game.name} seed {seed}, {args.steps} env steps ...", flush=True)
    with LoadSampler() as load:
        start = time.perf_counter()
        if system == "random":
            random_seed = seed + RANDOM_SEED_OFFSET
            returns = random_returns(env_id, settings_file, args.random_episodes, random_seed)
            wall = time.perf_counter() - start
        elif system == REFERENCE:
            spec = sb3_spec(
                env_id=env_id,
                settings_file=settings_file,
                subprocesses=game.subprocesses,
                seed=seed,
                steps=args.steps,
                torch_threads=args.torch_threads,
            )
            log_name = f"sb3-{game.name}-s{seed}"
            result = run_sb3(
                sb3_python=args.sb3_python, spec=spec, runs_dir=runs_dir, log_name=log_name
            )
        else:
            result = run_oakemu(
                env_id=env_id,
                settings_file=settings_file,
                seed=seed,
                steps=args.steps,
                runs_dir=runs_dir,
                run_name=f"{label}-{game.name}-s{seed}",
                torch_threads=args.torch_threads,
                extra=shlex.split(args.oakemu_args),
            )
    if system == "random":
        record = random_record(returns, seed=random_seed, wall_s=wall)
        record.update(game=game.name, env_id=env_id, load_1min=load.figures())
        summary = f"random {record['mean']:.1f} +- {record['std']:.1f}, {len(returns)} episodes"
    else:
        record = training_record(
            result,
            identity={"system": label, "game": game.name, "seed": seed},
            steps=args.steps,
            load=load.figures(),
        )
        summary = f"last100 {record['last100']:.1f}, wall {record['wall_s']:.0f} s, SPS {record['sps']:.0f}"
    if game.settings is not None:
        record["emulator_settings"] = game.settings
    write_record(path, record)
    print(f"   {summary}, load {record['load_1min']} -> {path}", flush=True)


def run_series(args: argparse.Namespace) -> None:
    runs_dir = runs_folder(args.runs_dir, "bench-console-")
    for seed, system in series(args.seeds, args.systems):
        run_one(args, system, seed, runs_dir)


# -------------------------------------------------------------------------------------------- report


def report(records: list[dict]) -> str:
    """Markdown: one row per (game, label, steps) with the per-window means over its seeds, last100, the
    last and best evaluation (OakEmu), wall, SPS and the ratios to ``sb3``'s runs of the same game, steps
    and seeds; one row per game for random play (mean +- std in the last100 column)."""
    trained = [r for r in records if r["system"] != "random"]
    lines = comparison_table(trained, place="game", reference=REFERENCE, evaluations=True)
    randoms: dict[str, list[dict]] = {}
    for record in records:
        if record["system"] == "random":
            randoms.setdefault(record["game"], []).append(record)
    for game, rows in sorted(randoms.items()):
        for r in rows:
            blanks = " | ".join("-" for _ in range(WINDOWS))
            lines.append(
                f"| {game} | random | - | {r['seed']} | {blanks} | {r['mean']:.1f} +- {r['std']:.1f} "
                f"({r['episodes']} episodes) | - | {r['wall_s']:.0f} | - | - | - | - | "
                f"{'-'.join(str(x) for x in r['load_1min'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--game", choices=sorted(GAMES), default="airstriker")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument(
        "--steps", type=int, default=None, help="env steps per run (default: the game's)"
    )
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument(
        "--label", default="oakemu", help="the name OakEmu's runs are recorded under"
    )
    parser.add_argument("--oakemu-args", default="", help="more `oakemu train` flags, one string")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads of the SB3 process and OakEmu's learner (0: each side's default)",
    )
    parser.add_argument("--random-episodes", type=int, default=100, help="episodes of random play")
    parser.add_argument("--sb3-python", default=sys.executable, help="the SB3 venv's python")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (%(default)s)")
    parser.add_argument("--runs-dir", type=Path, default=None, help="run folders (a temp dir)")
    parser.add_argument("--force", action="store_true", help="run again where a record exists")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1,024 env steps, 3 random episodes"
    )
    parser.add_argument("--report", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--sb3-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sb3_worker:
        print(json.dumps(sb3_worker(json.loads(args.sb3_worker))))
        return 0
    if args.report:
        records = load_records(args.out)
        if not records:
            parser.exit(2, f"--report: no records under {args.out}\n")
        print(report(records))
        return 0
    if args.label in SYSTEMS and args.label != "oakemu":
        parser.exit(2, f"--label: {args.label!r} names the {args.label} runs; choose another\n")
    if args.quick:
        args.steps, args.random_episodes = QUICK_STEPS, QUICK_EPISODES
    args.steps = args.steps or GAMES[args.game].steps
    if args.steps < 1 or args.random_episodes < 1 or args.torch_threads < 0:
        parser.exit(2, "--steps, --random-episodes: expected >= 1; --torch-threads: >= 0\n")
    run_series(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
