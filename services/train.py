"""``oakemu train``: the embedded default, a learner and ``num_actors`` actors as local processes.

Four phases, one function each:

1. :func:`plan_run` checks everything that can refuse the run (env id, actor inference, device, a
   resumed folder and the budget it has left, ports) before any process or run folder exists, then
   makes the run folder and writes the resolved ``config.toml`` into it (atomically);
2. :class:`Launch` starts ``oakemu learner`` and ``oakemu actor`` children that read that file
   (``OAKEMU_CONFIG_FILE``), shows live progress from the learner's telemetry and restarts an actor
   that crashes (at most ``actor_restarts`` times);
3. on Ctrl-C / SIGTERM it stops the learner first (it writes a final checkpoint), then the actors;
   children die with the launcher even when it is killed (Linux parent-death signal), so no orphan
   process or shared-memory segment stays;
4. :func:`report` says how the run ended and returns the exit status: 0 only for a run that made
   PPO updates and ended by its budget; ``128 + signal`` (Ctrl-C: 130) after a stop by signal; 1
   when every actor gave up or no update was made (naming the first actor error), or the learner's
   own status when it failed.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from oakemu_core.config import ConfigError, OakEmuConfig, resolved_device, to_toml
from oakemu_core.envs.factory import check_env
from oakemu_core.presets import Preset
from oakemu_core.run.metrics import EVAL_EPISODIC_RETURN, METRICS_FILE_NAME
from oakemu_core.run.run_folder import (
    check_resume_folder,
    format_changes,
    make_run_folder,
    read_json_lines,
    write_text_atomic,
)
from oakemu_core.run.telemetry import TelemetrySnapshot, TelemetrySubscriber
from oakemu_core.run.tester import BEST_NAME
from oakemu_core.run.tracking import check_tracker_available
from oakemu_services.runtime import (
    PARENT_PID_ENV,
    SETUP_ERROR_EXIT_STATUS,
    StopRequest,
    check_ports_free,
    default_run_name,
    install_stop_signals,
    with_free_ports,
)

log = logging.getLogger("oakemu.train")

STOP_GRACE_S = 60.0
"""How long the learner may take to finish an update and write its final checkpoint."""

_ERROR_RECORD = re.compile(r"^\S+ (?:ERROR|CRITICAL) [\w.]+: (.+)$")
"""A plain log record of level ERROR or CRITICAL (:class:`oakemu_services.runtime.OneLineFormatter`)."""
_CLI_ERROR = re.compile(r"^oakemu \w+: error: (.+)$")
"""The one line ``oakemu`` prints for a user error (:mod:`oakemu_services.cli`)."""
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Failed|Interrupt)\b.*")
"""The last line of a Python traceback: ``module.ErrorName: message``."""


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

    def error_line(self) -> str | None:
        """The newest error in its log: the last traceback's final line or ERROR record, else None."""
        return last_error(self.log_tail(200))


def last_error(text: str) -> str | None:
    """The newest error of a log text: the last ERROR/CRITICAL record's message or traceback's final
    line (``module.NameError: message``), whichever comes last; None when there is none."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        record = _ERROR_RECORD.match(line) or _CLI_ERROR.match(line)
        if record:
            return record.group(1)
        if _EXCEPTION_LINE.match(line):
            return line
    return None


@dataclass
class RunPlan:
    """A run that passed every check: its configuration, folder and the settings a resume changes."""

    config: OakEmuConfig
    run_dir: Path
    resumed: bool
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def config_file(self) -> Path:
        return self.run_dir / "config.toml"


def check_can_start(config: OakEmuConfig) -> None:
    """What refuses a run before anything exists: the env id and emulator settings, the actors'
    inference backend, the learner's device, the learner's ports.

    Raises:
        UserError (a subclass): the first problem found, in one line.
    """
    spec = check_env(config.env_id, settings_file=config.emulator_settings, envs_per_process=config.envs_per_actor,
                     options=config.env_options)
    if config.actor_inference in ("bfloat16", "numpy"):  # backends for some observations only
        module = importlib.import_module(f"oakemu_core.policy.{config.actor_inference}_inference")
        try:
            module.check_supported(spec.observation_layout)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if config.actor_inference == "onnxruntime":
        from oakemu_core.policy.onnx_inference import check_available

        check_available()
    check_tracker_available(config.track)  # --track mlflow / wandb: its package is installed
    if config.device not in ("auto", "cpu"):
        resolved_device(config)  # imports torch: only for a device that may be missing
    check_ports_free(config)


def plan_run(config: OakEmuConfig, resume: Path | None = None) -> RunPlan:
    """Choose free ports for the ports not given (:func:`~oakemu_services.runtime.with_free_ports`), check
    the run (:func:`check_can_start`, the resumed folder and its budget), then make the run folder with
    ``logs/`` and write the resolved ``config.toml`` (atomically): it records the ports, which
    ``oakemu monitor RUN_DIR`` reads.

    Raises:
        UserError (a subclass): a check failed; nothing was created or written.
    """
    config = with_free_ports(config)
    check_can_start(config)
    if resume is not None:
        config = config.model_copy(update={"runs_dir": Path(resume).parent, "run_name": Path(resume).name})
    elif config.run_name is None:
        config = config.model_copy(update={"run_name": default_run_name(config)})
    run_dir = Path(config.runs_dir) / str(config.run_name)
    # A folder with a checkpoint is resumed: refuse another env / spaces / model, a setting that cannot
    # change, or a run with nothing left to train, before anything in it is written.
    changes = check_resume_folder(run_dir, config, check_budget=True)
    make_run_folder(run_dir)
    write_text_atomic(run_dir / "config.toml", to_toml(config))
    return RunPlan(config, run_dir, resumed=resume is not None, changes=changes)


def _child_env(config_file: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")}
    env.update({"OAKEMU_CONFIG_FILE": str(config_file), PARENT_PID_ENV: str(os.getpid()), **extra})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _progress_text(snapshot: TelemetrySnapshot) -> str:
    """Short live figures for the progress bar (fits an 80-column terminal with the bar)."""
    ret = f"{snapshot.episodic_return_mean:.1f}" if snapshot.episodic_return_mean is not None else "n/a"
    return f"{snapshot.sps_recent:.0f} SPS, return {ret}"


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


def _metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` ([] when it cannot be read)."""
    try:
        return list(read_json_lines(run_dir / METRICS_FILE_NAME))
    except OSError:
        return []


def _best_evaluation(run_dir: Path, records: list[dict[str, Any]]) -> str | None:
    """``best evaluation: ...`` naming ``checkpoints/best.pt`` and its return, when the tester kept one
    and the last evaluation in ``records`` (metrics.jsonl) is below it (the checkpoint to evaluate or
    export is then not the last one); None otherwise."""
    best_file = run_dir / "checkpoints" / BEST_NAME
    evaluations = [r for r in records if EVAL_EPISODIC_RETURN in r]
    if not evaluations or not best_file.is_file():
        return None
    best = max(evaluations, key=lambda r: r[EVAL_EPISODIC_RETURN])
    last = evaluations[-1]
    if last[EVAL_EPISODIC_RETURN] >= best[EVAL_EPISODIC_RETURN]:
        return None
    return (f"best evaluation: return {best[EVAL_EPISODIC_RETURN]:.2f} (policy version "
            f"{int(best.get('eval/policy_version', -1))}), last {last[EVAL_EPISODIC_RETURN]:.2f}: "
            f"oakemu evaluate {best_file}")


def _final_update_line(records: list[dict[str, Any]]) -> tuple[int, str] | None:
    """``(update, line)`` of the last PPO update in ``records`` (metrics.jsonl: telemetry is lossy and
    the learner may exit before its last snapshots are read), or None when no update was recorded."""
    updates = [record for record in records if "charts/update" in record]
    if not updates:
        return None
    last = updates[-1]

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


def _restart_crashed(actors: list[Child], console: Console, max_restarts: int) -> bool:
    """Restart an actor that exited with an error (as compose's ``restart: on-failure`` does), at most
    ``max_restarts`` times, and never one that could not set up for this run (its status is
    ``SETUP_ERROR_EXIT_STATUS``: it would fail the same way). Returns True when every actor has exited
    and none will be restarted: nothing would ever fill a rollout."""
    for actor in actors:
        code = actor.poll()
        if code in (None, 0) or actor.gave_up:
            continue
        if code == SETUP_ERROR_EXIT_STATUS or actor.restarts >= max_restarts:
            actor.gave_up = True
            console.print(f"[red]{actor.name} exited with status {code}; not restarted[/]\n{actor.log_tail(5)}")
            continue
        actor.restarts += 1
        console.print(f"[yellow]{actor.name} exited with status {code}; restarting "
                      f"({actor.restarts}/{max_restarts})[/]\n{actor.log_tail(5)}")
        actor.start()
    return all(actor.gave_up for actor in actors)


class Launch:
    """The learner and actor processes of one planned run, and the progress view while they train.

    :meth:`watch` returns why it stopped watching: ``"signal"`` (Ctrl-C / SIGTERM), ``"learner"`` (the
    learner exited: budget spent, or a failure) or ``"actors"`` (every actor gave up).
    """

    def __init__(self, plan: RunPlan, console: Console) -> None:
        self.plan = plan
        self.console = console
        config, logs_dir = plan.config, plan.run_dir / "logs"
        cli = [sys.executable, "-m", "oakemu_services.cli"]
        self.learner = Child("learner", [*cli, "learner"], _child_env(plan.config_file), logs_dir / "learner.log")
        self.actors = [
            Child(f"actor-{i}", [*cli, "actor"], _child_env(plan.config_file, OAKEMU_ACTOR_ID=f"actor-{i}"),
                  logs_dir / f"actor-{i}.log")
            for i in range(config.num_actors)
        ]
        self.first_actor_error: str | None = None
        """``actor-N: <error line>`` of the first actor that exited with an error."""
        self.last_update = -1
        self.learner_status: int | None = None

    def start(self) -> None:
        self.learner.start()
        for actor in self.actors:
            actor.start()

    def watch(self, stop: StopRequest) -> str:
        """Show progress until the learner exits, every actor gave up, or ``stop`` is set."""
        config = self.plan.config
        subscriber = TelemetrySubscriber(config.learner_address(config.telemetry_port))
        # "trained": env steps PPO trained on, the count the budget is spent by; ETA at the recent rate.
        columns = (TextColumn("[bold blue]trained"), BarColumn(bar_width=12), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(compact=True),
                   TextColumn("{task.fields[info]}"))
        try:
            with Progress(*columns, console=self.console, transient=False) as progress:
                task = progress.add_task("train", total=config.total_env_steps, info="starting learner and actors")
                while not stop.is_set():
                    self.learner_status = self.learner.poll()
                    if self.learner_status is not None:
                        return "learner"
                    snapshot = subscriber.receive(timeout_s=0.1)  # short: the learner's exit is seen at once
                    if snapshot is not None:
                        self._show(progress, task, snapshot)
                    self._note_actor_errors()
                    if _restart_crashed(self.actors, self.console, config.actor_restarts):
                        return "actors"
                return "signal"
        finally:
            subscriber.close()

    def _show(self, progress: Progress, task: Any, snapshot: TelemetrySnapshot) -> None:
        progress.update(task, completed=snapshot.trained_env_steps, info=_progress_text(snapshot))
        if snapshot.is_update and snapshot.iterations != self.last_update:
            self.last_update = snapshot.iterations
            progress.console.print(_update_line(snapshot), highlight=False, soft_wrap=True)

    def _note_actor_errors(self) -> None:
        if self.first_actor_error is not None:
            return
        for actor in self.actors:
            if actor.poll() not in (None, 0):
                self.first_actor_error = f"{actor.name}: {actor.error_line() or f'exit status {actor.poll()}'}"
                return

    def stop(self) -> None:
        """Stop the learner first (it finishes its update and writes the final checkpoint), then the actors."""
        self.learner.signal(signal.SIGTERM)
        status = self.learner.wait(STOP_GRACE_S)
        self.learner_status = status if self.learner_status is None else self.learner_status
        for actor in self.actors:
            actor.signal(signal.SIGTERM)
        for actor in self.actors:
            actor.wait(10.0)


def report(launch: Launch, ended_by: str, stop: StopRequest, console: Console) -> int:
    """Say how the run ended and return the exit status (see the module docstring)."""
    run_dir = launch.plan.run_dir
    records = _metrics_records(run_dir)
    final = _final_update_line(records)
    if final is not None and final[0] != launch.last_update:
        # The last update line agrees with metrics.jsonl even when the last telemetry was missed.
        console.print(final[1], highlight=False, soft_wrap=True)
    actor_error = f"; first actor error: {launch.first_actor_error}" if launch.first_actor_error else ""
    if ended_by == "signal":
        name = signal.Signals(stop.signum).name if stop.signum else "a signal"
        console.print(f"stopped by {name}: run folder {run_dir} (continue with oakemu train --resume {run_dir})",
                      highlight=False, soft_wrap=True)
        return stop.exit_status or 130
    if ended_by == "actors":
        console.print(f"[red]error: every actor stopped for good, the run cannot go on{actor_error}[/] "
                      f"(logs: {run_dir / 'logs'})", highlight=False, soft_wrap=True)
        return 1
    status = launch.learner_status or 0
    if status != 0:
        reason = launch.learner.error_line() or "see its log"
        console.print(f"[red]error: the learner exited with status {status}: {reason}[/] "
                      f"(log: {launch.learner.log_path})", highlight=False, soft_wrap=True)
        return status
    if final is None:
        console.print(f"[red]error: the run made no PPO update{actor_error}[/] (logs: {run_dir / 'logs'})",
                      highlight=False, soft_wrap=True)
        return 1
    best = _best_evaluation(run_dir, records)
    if best is not None:
        console.print(best, highlight=False, soft_wrap=True)
    console.print(f"done: run folder {run_dir} (TensorBoard: tensorboard --logdir {run_dir.parent})",
                  highlight=False, soft_wrap=True)
    return 0


def main(config: OakEmuConfig, resume: Path | None = None, *, preset: Preset | None = None) -> int:
    """Run learner + actors until the env-step budget is spent or the user stops it.

    Args:
        config: the resolved configuration (with ``--resume``, already layered over the run's own
            ``config.toml``).
        resume: run folder to continue; its last checkpoint is restored by the learner.
        preset: the preset ``config`` starts from; its line (what to expect) is printed once the run
            can start.

    Returns:
        The exit status (see the module docstring).

    Raises:
        UserError (a subclass): the run cannot start (:func:`plan_run`); nothing was started or created.
    """
    plan = plan_run(config, resume)
    config = plan.config
    console = Console(stderr=True)
    if preset is not None:
        console.print(f"preset {preset.name}: {preset.description}; expect {preset.expect}", highlight=False,
                      soft_wrap=True)
    if plan.changes:
        console.print(f"[yellow]resuming {plan.run_dir} with changed settings[/] (config.toml -> now): "
                      f"{format_changes(plan.changes)}", highlight=False, soft_wrap=True)
    if config.rollback:
        console.print(f"rollback on: a collapsing run returns to its last good checkpoint with the learning rate "
                      f"x {config.rollback_lr_factor} (at most {config.max_rollbacks} times; --no-rollback turns it off)",
                      highlight=False, soft_wrap=True)
    console.print(f"[bold]oakemu train[/]: {config.env_id}, {config.num_actors} actors x {config.envs_per_actor} "
                  f"envs, {config.total_env_steps} env steps -> {plan.run_dir}" + (" (resumed)" if plan.resumed else ""),
                  highlight=False, soft_wrap=True)
    prometheus = f"; Prometheus: http://127.0.0.1:{config.metrics_port}/metrics" if config.metrics_enabled else ""
    console.print(f"live view: oakemu monitor {plan.run_dir}{prometheus}", highlight=False, soft_wrap=True)
    stop = install_stop_signals()
    launch = Launch(plan, console)
    ended_by = "signal"
    try:
        launch.start()
        ended_by = launch.watch(stop)
        if ended_by == "signal":
            console.print("stopping: waiting for the learner's final checkpoint ..." if launch.last_update >= 0
                          else "stopping: no update made yet, stopping the learner and actors ...")
        elif ended_by == "actors":
            console.print("[red]every actor has stopped for good[/]: stopping the learner")
    finally:
        launch.stop()
    return report(launch, ended_by, stop, console)
