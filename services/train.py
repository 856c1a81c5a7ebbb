"""``oakemu train``: the embedded default, a learner and ``num_actors`` actors as local processes.

The launcher writes the resolved configuration into the run folder, starts ``oakemu learner`` and
``oakemu actor`` children that read it (``OAKEMU_CONFIG_FILE``), shows live progress from the
learner's telemetry, restarts an actor that crashes, and on Ctrl-C / SIGTERM stops the learner
first (it writes a final checkpoint) and then the actors.  Children die with the launcher even
when it is killed (Linux parent-death signal), so no orphan process or shared-memory segment stays.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from oakemu_core.config import ConfigError, OakEmuConfig, to_toml
from oakemu_core.envs.factory import check_env
from oakemu_core.run.metrics import METRICS_FILE_NAME
from oakemu_core.run.run_folder import check_resume_folder, format_changes
from oakemu_core.run.telemetry import TelemetrySnapshot, TelemetrySubscriber
from oakemu_core.run.tracking import check_tracker_available
from oakemu_services.runtime import PARENT_PID_ENV, SETUP_ERROR_EXIT_STATUS, install_stop_signals, resolve_run_dir

log = logging.getLogger("oakemu.train")

STOP_GRACE_S = 60.0
"""How long the learner may take to finish an update and write its final checkpoint."""
MAX_ACTOR_RESTARTS = 5


class Child:
    """One service process with its log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.log_path = log_path
        self.restarts = 0
        self.gave_up = False  # exited with an error and not restarted
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it; closed when we exit
        # A session of its own: Ctrl-C reaches only the launcher, which then stops children in order.
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        log_file.close()

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int | None:
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _child_env(config_file: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")}
    env.update({"OAKEMU_CONFIG_FILE": str(config_file), PARENT_PID_ENV: str(os.getpid()), **extra})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _progress_text(snapshot: TelemetrySnapshot) -> str:
    """Short live figures for the progress bar (fits an 80-column terminal with the bar)."""
    ret = f"{snapshot.episodic_return_mean:.1f}" if snapshot.episodic_return_mean is not None else "n/a"
    return f"SPS {snapshot.sps_recent:5.0f} (last 10 s) | return {ret}"


def _update_line(snapshot: TelemetrySnapshot) -> str:
    """One line per PPO update: steps, SPS (since start, last 10 s), episodes, mean episodic return,
    losses, actors."""
    ret = f"{snapshot.episodic_return_mean:8.2f}" if snapshot.episodic_return_mean is not None else "     n/a"
    losses = (
        f" | pg {snapshot.policy_loss:+.3f} v {snapshot.value_loss:.3f} ent {snapshot.entropy:.3f}"
        if snapshot.policy_loss is not None
        else ""
    )
    return (f"update {snapshot.iterations:5d} | steps {snapshot.global_step:9d} | SPS {snapshot.sps:6.0f} "
            f"(recent {snapshot.sps_recent:6.0f}) | episodes {snapshot.episodes:6d} | return {ret}{losses} | "
            f"actors {snapshot.num_actors}")


def _final_update_line(run_dir: Path) -> tuple[int, str] | None:
    """``(update, line)`` of the last PPO update recorded in ``run_dir/metrics.jsonl`` (the durable
    record; telemetry is lossy and the learner may exit before its last snapshots are read), or None
    when no update was recorded."""
    last = None
    try:
        with open(run_dir / METRICS_FILE_NAME, encoding="utf-8") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "charts/update" in record:
                    last = record
    except OSError:
        return None
    if last is None:
        return None

    def figure(name: str, spec: str, missing: str = "n/a") -> str:
        value = last.get(name)
        return format(value, spec) if isinstance(value, (int, float)) else missing

    update = int(last["charts/update"])
    losses = (f" | pg {figure('losses/policy_loss', '+.3f')} v {figure('losses/value_loss', '.3f')} "
              f"ent {figure('losses/entropy', '.3f')}") if "losses/policy_loss" in last else ""
    return update, (f"update {update:5d} | steps {int(last['global_step']):9d} | SPS {figure('charts/SPS', '6.0f')} "
                    f"(recent {figure('charts/SPS_recent', '6.0f')}) | return "
                    f"{figure('charts/episodic_return', '8.2f', '     n/a')}{losses} | actors "
                    f"{figure('charts/actors', '.0f')} (final, metrics.jsonl)")


def main(config: OakEmuConfig, resume: Path | None = None) -> int:
    """Run learner + actors until the env-step budget is spent or the user stops it.

    Args:
        config: the resolved configuration (with ``--resume``, already layered over the run's own
            ``config.toml``).
        resume: run folder to continue; its last checkpoint is restored by the learner.

    Returns:
        The learner's exit status (0 on success).

    Raises:
        FileNotFoundError: ``resume`` is not a run folder with a checkpoint.
        oakemu_core.envs.UnsupportedEnvironmentError: unknown ``env_id``.
    """
    # An unknown env id or a bad emulator setting fails here, before any folder or process exists.
    spec = check_env(config.env_id, settings_file=config.emulator_settings, envs_per_process=config.envs_per_actor)
    if config.actor_inference == "bfloat16":
        from oakemu_core.policy.bfloat16_inference import check_supported

        try:
            check_supported(spec.observation_layout)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if config.actor_inference == "onnxruntime":
        from oakemu_core.policy.onnx_inference import check_available

        check_available()
    check_tracker_available(config.track)  # --track mlflow / wandb: its package is installed
    if resume is not None:
        resume = Path(resume)
        if not (resume / "checkpoints").is_dir():
            raise FileNotFoundError(f"--resume {resume}: not a run folder with checkpoints/")
        config = config.model_copy(update={"runs_dir": resume.parent, "run_name": resume.name})
    elif config.run_name is None:
        run_dir = resolve_run_dir(config)
        config = config.model_copy(update={"run_name": run_dir.name})
    run_dir = resolve_run_dir(config)
    # A folder with a checkpoint is resumed: refuse another env / spaces / model, or a change of a
    # setting that cannot change (ResumeMismatchError, exit 2), before anything in it is written.
    changes = check_resume_folder(run_dir, config)
    logs_dir = run_dir / "logs"
    logs_dir.mkdir(exist_ok=True)
    config_file = run_dir / "config.toml"
    config_file.write_text(to_toml(config))

    console = Console(stderr=True)
    if changes:
        console.print(f"[yellow]resuming {run_dir} with changed settings[/] (config.toml -> now): "
                      f"{format_changes(changes)}", highlight=False, soft_wrap=True)
    stop_event = install_stop_signals()
    cli = [sys.executable, "-m", "oakemu_services.cli"]
    learner = Child("learner", [*cli, "learner"], _child_env(config_file), logs_dir / "learner.log")
    actors = [
        Child(f"actor-{i}", [*cli, "actor"], _child_env(config_file, OAKEMU_ACTOR_ID=f"actor-{i}"),
              logs_dir / f"actor-{i}.log")
        for i in range(config.num_actors)
    ]
    console.print(f"[bold]oakemu train[/]: {config.env_id}, {config.num_actors} actors x {config.envs_per_actor} "
                  f"envs, {config.total_env_steps} env steps -> {run_dir}" + (" (resumed)" if resume else ""))
    subscriber = TelemetrySubscriber(config.learner_address(config.telemetry_port))
    learner.start()
    for actor in actors:
        actor.start()
    status = 1
    last_update = -1
    try:
        with Progress(
            TextColumn("[bold blue]env steps"), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), console=console, transient=False,
        ) as progress:
            task = progress.add_task("train", total=config.total_env_steps, info="starting learner and actors")
            while not stop_event.is_set():
                status_code = learner.poll()
                if status_code is not None:
                    status = status_code
                    break
                snapshot = subscriber.receive(timeout_s=0.1)  # short: the learner's exit is seen at once
                if snapshot is not None:
                    progress.update(task, completed=snapshot.global_step, info=_progress_text(snapshot))
                    if snapshot.is_update and snapshot.iterations != last_update:
                        last_update = snapshot.iterations
                        progress.console.print(_update_line(snapshot), highlight=False, soft_wrap=True)
                if _restart_crashed(actors, console):
                    console.print("[red]every actor has stopped for good[/]: stopping the learner")
                    learner.signal(signal.SIGTERM)
                    learner.wait(STOP_GRACE_S)
                    status = 1
                    break
            else:
                console.print("stopping: waiting for the learner's final checkpoint ...")
                learner.signal(signal.SIGTERM)
                status = learner.wait(STOP_GRACE_S) or 0
    finally:
        for actor in actors:
            actor.signal(signal.SIGTERM)
        learner.signal(signal.SIGTERM)
        learner.wait(STOP_GRACE_S)
        for actor in actors:
            actor.wait(10.0)
        subscriber.close()
    # The last update line agrees with metrics.jsonl (and the final checkpoint) even when the
    # telemetry of the last updates was not received before the learner exited.
    final = _final_update_line(run_dir)
    if final is not None and final[0] != last_update:
        console.print(final[1], highlight=False, soft_wrap=True)
    if status != 0:
        console.print(f"[red]learner exited with status {status}[/]; last lines of {learner.log_path}:\n"
                      + learner.log_tail())
    else:
        console.print(f"done: run folder {run_dir} (TensorBoard: tensorboard --logdir {run_dir.parent})")
    return status


def _restart_crashed(actors: list[Child], console: Console) -> bool:
    """Restart an actor that exited with an error (as compose's ``restart: on-failure`` does), at most
    :data:`MAX_ACTOR_RESTARTS` times, and never one that could not set up for this run (its status is
    ``SETUP_ERROR_EXIT_STATUS``: it would fail the same way). Returns True when every actor has exited
    and none will be restarted: nothing would ever fill a rollout."""
    for actor in actors:
        code = actor.poll()
        if code in (None, 0) or actor.gave_up:
            continue
        if code == SETUP_ERROR_EXIT_STATUS or actor.restarts >= MAX_ACTOR_RESTARTS:
            actor.gave_up = True
            console.print(f"[red]{actor.name} exited with status {code}; not restarted[/]\n{actor.log_tail(5)}")
            continue
        actor.restarts += 1
        console.print(f"[yellow]{actor.name} exited with status {code}; restarting "
                      f"({actor.restarts}/{MAX_ACTOR_RESTARTS})[/]\n{actor.log_tail(5)}")
        actor.start()
    return all(actor.gave_up for actor in actors)
