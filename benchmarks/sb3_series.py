"""What the side-by-side SB3 benchmarks share: a series of training runs, SB3 beside ``oakemu train``, one
record per run, and the report of those records.

Used by ``bench_atari_vs_sb3.py``, ``bench_console_vs_sb3.py`` and ``bench_recurrent_vs_sb3.py``. Each
script keeps what is its own: the settings of both sides, the SB3 worker's env and model, its record's
path and the summary line it prints.

The pieces, in the order a run goes through them:

* :func:`series`: the ``(seed, system)`` pairs of a series, the systems' order rotating with the seed
  (so that a change of machine load does not always hit the same system); :func:`kept`: skip a run
  whose record exists unless ``--force``.
* :func:`run_sb3_worker`: the script's own ``--sb3-worker`` (:func:`sb3_worker_command`) in a child
  process under the SB3 venv's python; the worker trains with :func:`learn_logged` and prints its
  result as one JSON line.
* :func:`train_oakemu_run`: ``oakemu train`` (:func:`preset_command`) as a child process with a time
  limit, then :func:`run_result` of its run folder.
* :func:`training_record`, :func:`write_record`: the run's record; :func:`load_records`,
  :func:`comparison_table`: the report. ``bench_recurrent_vs_sb3.py`` writes records of its own
  (``episodes`` and ``to_475`` instead of ``games`` and ``cpus``) and prints its own report.

A training run's record (:func:`training_record`; one JSON object, ``indent=1``, one file per run)
holds, in this order:

* the script's identity fields (``system``: the label the run is recorded under; ``env`` or ``game``;
  ``seed``), then ``steps`` (the budget in env steps), ``commit`` (``git rev-parse --short HEAD``),
  ``cpus`` (``os.cpu_count()``);
* ``games``: finished training episodes; ``curve``: their mean raw return per tenth of the budget
  (:data:`WINDOWS` values, by the env step at which each ended; nan where none ended); ``last100``:
  the mean raw return of the last 100 (rounded to 2 places);
* ``sps``: ``env_steps / wall_s``; ``load_1min``: the 1-minute load average before and after the run
  (the console benchmark: and the mean of samples taken while it ran);
* the run's own results, in the order the run gave them: ``wall_s`` (seconds from launching the
  training process to its exit; a resumed SB3 run adds its earlier segments, ``resumed_wall_s``, and
  says how many processes it took, ``segments``) and ``env_steps`` (env steps trained); OakEmu's ``sps_logged`` (the
  learner's last logged ``charts/SPS``) and ``policy_lag_mean``; whatever the script adds
  (``evaluations``, ...); last ``settings`` (what the run ran with: ``{"sb3": spec}`` or
  ``{"oakemu_train": flags}``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_spaces_vs_sb3 import REPO, _mean, _read_jsonl, fresh_run_dir  # sibling helpers

from oakemu_core.run.atomic_files import write_text_atomic  # noqa: E402  (after the sibling import path)

WINDOWS = 10
"""Parts of the budget a record's ``curve`` has: one mean return per tenth."""
TRAIN = (sys.executable, "-m", "oakemu_services.cli", "train")
"""``oakemu train`` as this interpreter runs it (``python -m oakemu_services.cli train``)."""


# ---------------------------------------------------------------------------------------------- series


def curve(episodes: list, steps: int, parts: int = WINDOWS) -> list[float]:
    """Mean return of the episodes ``[[env step when it ended, return], ...]`` that ended in each
    ``1/parts`` of the budget of ``steps`` env steps, rounded to 1 place (nan where none ended)."""
    bins: list[list[float]] = [[] for _ in range(parts)]
    for step, value in episodes:
        bins[min(parts - 1, max(0, (step - 1) * parts // steps))].append(value)
    return [round(_mean(b), 1) for b in bins]


def commit() -> str:
    """``git rev-parse --short HEAD`` of the repository, or ``unknown``."""
    process = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    return process.stdout.strip() or "unknown"


def series(seeds: list[int], systems: list[str]) -> Iterator[tuple[int, str]]:
    """``(seed, system)`` of each run, seed by seed; the k-th seed (from 0) starts with ``systems[k %
    len(systems)]`` and goes on in the given order, wrapping round."""
    for index, seed in enumerate(seeds):
        shift = index % len(systems)
        for system in systems[shift:] + systems[:shift]:
            yield seed, system


def kept(path: Path, force: bool, run: str) -> bool:
    """Whether the run's record at ``path`` is kept (it exists and ``force`` is off); if so, says so on
    stdout: ``-- <run>: <path> exists, skipped (--force runs it again)``."""
    if path.exists() and not force:
        print(f"-- {run}: {path} exists, skipped (--force runs it again)")
        return True
    return False


def runs_folder(runs_dir: Path | None, prefix: str) -> Path:
    """``runs_dir`` (created), or a new temporary folder named ``<prefix>...`` that is kept after the
    series (its logs tell what went wrong)."""
    folder = runs_dir or Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _environment() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``."""
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


# ------------------------------------------------------------------------------------------------- SB3


def sb3_worker_command(sb3_python: str, script: str, spec: dict) -> list[str]:
    """``<sb3_python> <script> --sb3-worker <spec as JSON>``: one SB3 run of ``script`` (a path)."""
    return [sb3_python, str(Path(script).resolve()), "--sb3-worker", json.dumps(spec)]


def run_sb3_worker(command: list[str], *, log_path: Path, timeout_s: float) -> dict:
    """Run an SB3 worker (:func:`sb3_worker_command`) from the repository root, stderr to ``log_path``.

    Returns:
        The JSON object of the worker's last stdout line, with ``wall_s``: seconds from launch to exit,
        plus the worker's ``resumed_wall_s`` (earlier segments of a resumed run, :func:`learn_logged`).

    Raises:
        RuntimeError: the worker exited with a non-zero status (the log says why).
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds (it is killed).
    """
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.run(
            command,
            cwd=REPO,
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"SB3 worker exited {process.returncode}; see {log_path}")
    result = json.loads(process.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": wall + result.get("resumed_wall_s", 0.0)}


def linear_schedule(start: float) -> Callable[[float], float]:
    """SB3's schedule falling linearly from ``start`` to 0 over the budget (rl-baselines3-zoo's
    ``lin_<start>``)."""
    return lambda progress_remaining: progress_remaining * start


def learn_logged(
    model: Any,
    steps: int,
    *,
    on_rollout_end: Callable[[Any], None] | None = None,
    checkpoint: Path | None = None,
    checkpoint_every_s: float = 600.0,
) -> dict:
    """``model.learn(total_timesteps=steps)`` (an SB3 model, in the SB3 venv), keeping every finished
    episode its envs' ``Monitor`` reports.

    ``on_rollout_end(callback)`` (if given) runs after each rollout; ``callback.episodes`` holds the
    episodes so far, ``callback.model`` the model.

    With ``checkpoint`` (a folder), the run survives being killed: after a rollout, once
    ``checkpoint_every_s`` seconds have passed since the last save, the model (weights and optimizer
    state) and the episodes so far are saved there; a later call with the same folder and a freshly
    built ``model`` of the same settings loads them and trains the rest of the budget (the learning
    rate and clip schedules go on from the saved step count; the envs' games start afresh). The caller
    removes the folder once the result is stored.

    Returns:
        ``{"env_steps": model.num_timesteps, "episodes": [[env steps when it ended, raw return], ...],
        "segments": processes the run took (1 when never resumed), "resumed_wall_s": seconds the
        earlier segments trained}``.
    """
    from stable_baselines3.common.callbacks import BaseCallback

    start = time.perf_counter()
    done = _load_checkpoint(model, checkpoint) if checkpoint is not None else None
    segments, earlier_wall_s = (done["segments"] + 1, done["wall_s"]) if done else (1, 0.0)

    class EpisodeLog(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.episodes: list[tuple[int, float]] = (
                [tuple(e) for e in done["episodes"]] if done else []
            )
            self.saved_at = start

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:  # a Monitor's episode ended: its raw return
                    self.episodes.append((int(self.num_timesteps), float(info["episode"]["r"])))
            return True

        def _on_rollout_end(self) -> None:
            now = time.perf_counter()
            if checkpoint is not None and now - self.saved_at >= checkpoint_every_s:
                progress = {
                    "env_steps": int(self.model.num_timesteps),
                    "episodes": self.episodes,
                    "segments": segments,
                    "wall_s": earlier_wall_s + now - start,
                }
                _save_checkpoint(self.model, checkpoint, progress)
                self.saved_at = now
            if on_rollout_end is not None:
                on_rollout_end(self)

    log = EpisodeLog()
    trained = int(model.num_timesteps)
    model.learn(total_timesteps=steps - trained, callback=log, reset_num_timesteps=trained == 0)
    return {
        "env_steps": int(model.num_timesteps),
        "episodes": log.episodes,
        "segments": segments,
        "resumed_wall_s": earlier_wall_s,
    }


def _save_checkpoint(model: Any, folder: Path, progress: dict) -> None:
    """``model-<env_steps>.zip`` (SB3's ``save``), then ``progress.json`` naming it (``write_text_atomic``:
    whole or not at all), then older model files removed: a kill at any point leaves a consistent pair."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"model-{progress['env_steps']}.zip"
    model.save(folder / name)
    write_text_atomic(folder / "progress.json", json.dumps({**progress, "model": name}))
    for old in folder.glob("model-*.zip"):
        if old.name != name:
            old.unlink()


def _load_checkpoint(model: Any, folder: Path) -> dict | None:
    """Load ``folder``'s saved weights, optimizer state and step count into ``model``; returns the saved
    progress, or None where nothing was saved."""
    path = folder / "progress.json"
    if not path.exists():
        return None
    progress = json.loads(path.read_text())
    model.set_parameters(str(folder / progress["model"]), exact_match=True)
    model.num_timesteps = int(progress["env_steps"])
    return progress


# ---------------------------------------------------------------------------------------------- OakEmu


def preset_command(
    preset: str,
    *,
    steps: int,
    seed: int,
    runs_dir: Path,
    run_name: str,
    leading: list[str],
    trailing: list[str],
    extra: list[str],
) -> list[str]:
    """``oakemu train --preset <preset> <leading> --total-env-steps <steps> --seed <seed> <trailing>
    --runs-dir <runs_dir> --run-name <run_name> <extra>`` (:data:`TRAIN` first)."""
    return [
        *TRAIN,
        "--preset",
        preset,
        *leading,
        "--total-env-steps",
        str(steps),
        "--seed",
        str(seed),
        *trailing,
        "--runs-dir",
        str(runs_dir),
        "--run-name",
        run_name,
        *extra,
    ]


def train_oakemu_run(
    command: list[str], *, runs_dir: Path, run_name: str, timeout_s: float
) -> dict:
    """Run ``command`` (an ``oakemu train`` command line naming ``runs_dir`` and ``run_name``) from the
    repository root, its output to ``<runs_dir>/<run_name>.log``, and read its run folder.

    Returns:
        :func:`run_result` of ``runs_dir / run_name``.

    Raises:
        SystemExit: the run folder exists already (:func:`fresh_run_dir`: it would be resumed).
        RuntimeError: ``oakemu train`` exited with a non-zero status.
        subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds (it is killed).
    """
    run_dir = fresh_run_dir(runs_dir, run_name)
    start = time.perf_counter()
    with open(runs_dir / f"{run_name}.log", "wb") as log:
        process = subprocess.run(
            command,
            cwd=REPO,
            env=_environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"oakemu train exited {process.returncode}; see {run_dir}/logs")
    return run_result(run_dir, wall)


def run_result(run_dir: Path, wall_s: float) -> dict:
    """What an ``oakemu train`` run folder says about the run, which took ``wall_s`` seconds.

    Returns:
        ``wall_s``; ``env_steps`` (the last ``metrics.jsonl`` record's ``global_step``, 0 without
        one); ``sps_logged`` (the last ``charts/SPS`` logged, None without one); ``policy_lag_mean``
        (the mean of ``charts/policy_lag_mean``, nan without one); ``episodes``: every finished episode
        of ``episodes.jsonl`` as ``(global_step, raw return)``, by ``global_step``.
    """
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    episodes = sorted(_read_jsonl(run_dir / "episodes.jsonl"), key=lambda e: e["global_step"])
    lags = [m["charts/policy_lag_mean"] for m in metrics if "charts/policy_lag_mean" in m]
    return {
        "wall_s": wall_s,
        "env_steps": int(metrics[-1]["global_step"]) if metrics else 0,
        "sps_logged": next((m["charts/SPS"] for m in reversed(metrics) if "charts/SPS" in m), None),
        "policy_lag_mean": _mean(lags),
        "episodes": [(int(e["global_step"]), float(e["episodic_return"])) for e in episodes],
    }


# ------------------------------------------------------------------------------------------- records


def training_record(result: dict, *, identity: dict, steps: int, load: list[float]) -> dict:
    """One training run's record (the module docstring's fields): ``identity`` (``system``, ``env`` or
    ``game``, ``seed``) first, then the measures of ``result["episodes"]`` (removed from ``result``)
    over ``steps``, ``load`` as ``load_1min``, then the rest of ``result``."""
    episodes = result.pop("episodes")
    return {
        **identity,
        "steps": steps,
        "commit": commit(),
        "cpus": os.cpu_count(),
        "games": len(episodes),
        "curve": curve(episodes, steps, WINDOWS),
        "last100": round(_mean([r for _, r in episodes][-100:]), 2),
        "sps": result["env_steps"] / result["wall_s"],
        "load_1min": load,
        **result,
    }


def write_record(path: Path, record: dict) -> None:
    """``record`` as JSON (``indent=1``, a final newline) to ``path``, its folder created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def load_records(out: Path) -> list[dict]:
    """The records ``<out>/<game>/*.json``, in path order."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/*.json"))]


# -------------------------------------------------------------------------------------------- report


def comparison_table(
    records: list[dict],
    *,
    place: str,
    reference: str,
    name: Callable[[str], str] = str,
    evaluations: bool = False,
) -> list[str]:
    """Markdown lines: one row per (``record[place]``, system, steps), shown as ``name(place)``, with
    the per-window means over its seeds, last100, wall and SPS, and the ratios to ``reference``'s runs
    of the same place, steps and seeds (``-`` where those seeds lack a reference run, and for the
    reference itself): last100, windows at least the reference's, wall. ``evaluations``: a column of
    the mean last and best evaluation (records' ``evaluations``: ``[step, mean, std]`` rows; ``-``
    without). ``load``: each seed's ``load_1min`` figures joined by ``-``, seeds by ``; ``."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record[place], record["system"], record["steps"]), []).append(record)
    windows = " | ".join(f"w{k + 1}" for k in range(WINDOWS))
    eval_head = " eval last / best |" if evaluations else ""
    lines = [
        f"| game | system | steps | seeds | {windows} | last100 |{eval_head} wall s | SPS | "
        "last100 / SB3 | windows >= SB3 | wall / SB3 | load |",
        "|" + " --- |" * (WINDOWS + 12 + evaluations),
    ]
    for (where, label, steps), rows in sorted(groups.items()):
        seeds = sorted(r["seed"] for r in rows)
        means = [_mean([r["curve"][k] for r in rows]) for k in range(WINDOWS)]
        last100 = _mean([r["last100"] for r in rows])
        wall = _mean([r["wall_s"] for r in rows])
        eval_cell = f" {_evaluation_cell(rows)} |" if evaluations else ""
        ref = [r for r in groups.get((where, reference, steps), []) if r["seed"] in seeds]
        if label != reference and sorted(r["seed"] for r in ref) == seeds:
            ref_means = [_mean([r["curve"][k] for r in ref]) for k in range(WINDOWS)]
            ratio_last = f"{last100 / _mean([r['last100'] for r in ref]):.2f}"
            at_least = f"{sum(m >= rm for m, rm in zip(means, ref_means))}/{WINDOWS}"
            ratio_wall = f"{wall / _mean([r['wall_s'] for r in ref]):.2f}"
        else:
            ratio_last = at_least = ratio_wall = "-"
        loads = "; ".join("-".join(str(x) for x in r["load_1min"]) for r in rows)
        lines.append(
            f"| {name(where)} | {label} | {steps:,} | {','.join(map(str, seeds))} | "
            f"{' | '.join(f'{m:.1f}' for m in means)} | {last100:.1f} |{eval_cell} {wall:.0f} | "
            f"{_mean([r['sps'] for r in rows]):.0f} | {ratio_last} | {at_least} | {ratio_wall} | {loads} |"
        )
    return lines


def _evaluation_cell(rows: list[dict]) -> str:
    """``<mean last> / <mean best>`` evaluation return over the rows that have evaluations, else ``-``."""
    evaluations = [r["evaluations"] for r in rows if r.get("evaluations")]
    if not evaluations:
        return "-"
    final = _mean([e[-1][1] for e in evaluations])
    best = _mean([max(m for _, m, _ in e) for e in evaluations])
    return f"{final:.1f} / {best:.1f}"
