"""``oakemu train``: the embedded default, a learner and ``num_actors`` actors as local processes.

Four phases, one function each:

1. :func:`plan_run` checks everything that can refuse the run (ports first, claimed for the run; env
   id, actor inference, device; a resumed folder, live or not, and the budget it has left) before any
   process exists, then makes a run folder of its own (held by this process for the run, never one
   that holds another run) and writes the resolved ``config.toml`` into it (atomically);
2. :class:`Launch` starts ``oakemu learner`` and ``oakemu actor`` children (and, for
   ``actor_inference`` central, the inference server) that read that file (``OAKEMU_CONFIG_FILE``),
   shows live progress from the learner's telemetry and restarts an actor or the server when it
   crashes (at most ``actor_restarts`` times each);
3. on Ctrl-C / SIGTERM it stops the learner first (it writes a final checkpoint), then the actors;
   children die with the launcher even when it is killed (Linux parent-death signal), so no orphan
   process or shared-memory segment stays;
4. :func:`report` says how the run ended and returns the exit status: 0 only for a run that made
   PPO updates and ended by its budget (or was stopped by a Python API callback); ``128 + signal``
   (Ctrl-C: 130) after a stop by signal; 1 when every actor gave up, no update was made (naming the
   first actor error), the learner was killed by a signal (naming it) or a callback raised; the
   learner's own status when it exited with an error.

Each child's output (stdout and stderr) goes through the launcher into its log file, so its last error
is known even when the log cannot be written (a full disk): :mod:`oakemu_services.train_children`. What
the console shows while the run trains and at its end: :mod:`oakemu_services.train_view`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oakemu_services.runtime import (
    PARENT_PID_ENV,
    SETUP_ERROR_EXIT_STATUS,
    PortClaims,
    StopRequest,
    claim_free_ports,
    default_run_name,
    install_stop_signals,
)
from oakemu_services.train_children import (
    OUTPUT_LINES_KEPT,
    Child,
    crash_traceback,
    exit_description,
    last_error,
)
from oakemu_services.train_view import end_lines, print_line, progress_view
from oakemu_services.train_view import final_update_line as _final_update_line
from oakemu_services.train_view import metrics_records as _metrics_records
from rich.console import Console

from oakemu_core.actor.central_inference import INFERENCE_ADDRESS_ENV
from oakemu_core.config import ConfigError, OakEmuConfig, resolved_device, to_toml
from oakemu_core.envs.factory import check_env
from oakemu_core.presets import Preset
from oakemu_core.run.callbacks import CallbackRunner, RecordFollower
from oakemu_core.run.checkpoint_paths import latest_checkpoint
from oakemu_core.run.metrics import METRICS_FILE_NAME
from oakemu_core.run.run_folder import (
    check_config_complete,
    check_resume_folder,
    format_changes,
    make_new_run_folder,
    make_run_folder,
    spent_budget,
    write_text_atomic,
)
from oakemu_core.run.run_lock import RunFolderLock
from oakemu_core.run.telemetry import TelemetrySubscriber
from oakemu_core.run.tracking import check_tracker_available

log = logging.getLogger("oakemu.train")

STOP_GRACE_S = 60.0
"""How long the learner may take to finish an update and write its final checkpoint."""


@dataclass
class RunPlan:
    """A run that passed every check: its configuration, folder, the settings a resume changes, and what
    this process holds for the run until :meth:`release` (or its exit): the run folder's lock and the
    learner's port claims."""

    config: OakEmuConfig
    run_dir: Path
    resumed: bool
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """Warnings to show before the run starts (an unreadable checkpoint set aside)."""
    resumed_from: str | None = None
    """A resumed run: which checkpoint it continues from (:meth:`~oakemu_core.run.run_folder.ResumeCheck.describe`)."""
    lock: RunFolderLock | None = None
    ports: PortClaims | None = None

    @property
    def config_file(self) -> Path:
        return self.run_dir / "config.toml"

    @property
    def learner_fds(self) -> tuple[int, ...]:
        """Descriptors the learner inherits: the run folder's lock, so that the run stays live (and its
        folder refused to another run) until the learner has exited too, also after ``kill -9`` of the
        launcher."""
        return () if self.lock is None or self.lock.fd is None else (self.lock.fd,)

    def release(self) -> None:
        """Give up the run folder and the ports; call it once the run's processes have exited."""
        for held in (self.ports, self.lock):
            if held is not None:
                held.release()


def check_can_start(config: OakEmuConfig) -> None:
    """What refuses a run before anything exists, after its ports (:func:`plan_run`): the env id and
    emulator settings, the actors' inference backend, the tracker, the learner's device.

    Raises:
        UserError (a subclass): the first problem found, in one line.
    """
    spec = check_env(
        config.env_id,
        settings_file=config.emulator_settings,
        envs_per_process=config.envs_per_actor,
        options=config.env_options,
    )
    if config.actor_inference in ("bfloat16", "numpy"):  # backends for some observations only
        module = importlib.import_module(f"oakemu_core.policy.{config.actor_inference}_inference")
        try:
            module.check_supported(spec.observation_layout)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if config.actor_inference == "onnxruntime":
        from oakemu_core.policy.onnx_inference import check_available

        check_available()
    if config.policy_module is not None:  # a user's encoder: built once on a probe batch, here
        _check_user_network(config, spec)
    check_tracker_available(config.track)  # --track mlflow / wandb: its package is installed
    if config.device not in ("auto", "cpu"):
        resolved_device(config)  # imports torch: only for a device that may be missing
    if config.actor_inference == "central" and config.inference_device not in ("auto", "cpu"):
        resolved_device(config, "inference_device")


def _check_user_network(config: OakEmuConfig, spec: Any) -> None:
    """Build the run's model on the CPU once: a user's encoder that cannot be imported, built or run on a
    probe batch is refused in one line (:class:`~oakemu_core.policy.encoders.UserEncoderError`)."""
    from oakemu_core.policy.encoders import UserEncoderError
    from oakemu_core.policy.models import build_model
    from oakemu_core.policy.schemas import schema_for_env

    try:
        build_model(
            spec.observation_layout,
            schema_for_env(spec, config.network).distribution,
            normalize_observations=config.normalize_observations,
            network=config.network,
        )
    except UserEncoderError as error:
        raise ConfigError(str(error)) from None


SETTING_NAMES = tuple(name for name in OakEmuConfig.model_fields if name != "config_file")
"""The settings a complete ``config.toml`` names."""


def plan_run(config: OakEmuConfig, resume: Path | None = None) -> RunPlan:
    """Check the run and claim what it needs, before any process exists; when a check fails, nothing is
    left made, written or held.

    1. ports: free ones for the ports not given, all claimed for this run
       (:func:`~oakemu_services.runtime.claim_free_ports`): a port in use is refused first, fast;
    2. :func:`check_can_start`;
    3. the run folder, held by this process for the run (:class:`~oakemu_core.run.run_lock.RunFolderLock`).
       With ``resume``: that folder, refused while a live run holds it or when its ``config.toml`` is
       incomplete. Otherwise a new folder, never one that holds a run: ``run_name`` is refused when it
       exists (naming the pid of a live run; pointing a stopped one to ``--resume``); without a name,
       :func:`~oakemu_services.runtime.default_run_name`, with ``-2``, ``-3``, ... when that is taken;
    4. a resumed folder: :func:`~oakemu_core.run.run_folder.check_resume_folder` (env, spaces, model,
       settings that cannot change, budget left; a newer checkpoint that does not load is set aside);
    5. ``logs/`` and the resolved ``config.toml`` (atomically): it records the ports and the run's name,
       which ``oakemu monitor RUN_DIR`` reads.

    Returns:
        The plan; :attr:`RunPlan.run_dir` is the folder chosen (the Python API reads it there).

    Raises:
        UserError (a subclass): a check failed; one line.
    """
    if resume is not None:
        check_config_complete(resume, SETTING_NAMES)
    config, ports = claim_free_ports(config)
    with contextlib.ExitStack() as undo:
        undo.callback(ports.release)
        check_can_start(config)
        lock = _claim_run_folder(config, resume, undo)
        run_dir = lock.run_dir
        config = config.model_copy(update={"runs_dir": run_dir.parent, "run_name": run_dir.name})
        notes: list[str] = []
        # A resumed folder: refuse another env / spaces / model, a setting that cannot change, or a run
        # with nothing left to train, before anything in it is written.
        check = (
            check_resume_folder(run_dir, config, check_budget=True, notes=notes)
            if resume is not None
            else None
        )
        make_run_folder(run_dir)
        write_text_atomic(run_dir / "config.toml", to_toml(config))
        undo.pop_all()
    return RunPlan(
        config,
        run_dir,
        resumed=resume is not None,
        changes=check.changes if check else {},
        notes=notes,
        resumed_from=check.describe(run_dir) if check else None,
        lock=lock,
        ports=ports,
    )


def _claim_run_folder(
    config: OakEmuConfig, resume: Path | None, undo: contextlib.ExitStack
) -> RunFolderLock:
    """The run folder of :func:`plan_run`'s step 3, held; ``undo`` gives it up (and removes a folder made
    here) when a later step fails."""
    if resume is not None:
        lock = RunFolderLock.acquire(
            Path(resume), hint="wait for it to end, or stop it, before resuming it"
        )
        undo.callback(lock.release)
        return lock
    runs_dir = Path(config.runs_dir)
    numbered = config.run_name is None
    name = default_run_name(config) if numbered else str(config.run_name)
    existed = not numbered and (runs_dir / name).exists()
    lock = make_new_run_folder(runs_dir, name, numbered=numbered, hint=_existing_run_hint)
    if (
        not existed
    ):  # runs last: after the lock file went, the folder and logs/ made here, if still empty
        undo.callback(_remove_empty, lock.run_dir)
    undo.callback(lock.release)
    return lock


def _existing_run_hint(run_dir: Path, live: bool) -> str:
    """What to do instead of ``--run-name`` of the run in ``run_dir``: resume it (once it stopped), with a
    larger ``--total-env-steps`` when it trained its whole budget, or choose another name."""
    new_run = "for a new run, choose another --run-name"
    if live:
        return f"to continue that run once stopped: oakemu train --resume {run_dir}; {new_run}"
    spent = spent_budget(run_dir)
    if spent is not None:
        return (
            f"it trained its whole budget ({spent[0]:,} env steps, total_env_steps={spent[1]}); to train it "
            f"longer: oakemu train --resume {run_dir} --total-env-steps N with N above {spent[0]}; {new_run}"
        )
    return f"to continue that run: oakemu train --resume {run_dir}; {new_run}"


def _remove_empty(run_dir: Path) -> None:
    for folder in (run_dir / "logs", run_dir):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _child_env(config_file: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")}
    env.update({"OAKEMU_CONFIG_FILE": str(config_file), PARENT_PID_ENV: str(os.getpid()), **extra})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _restart_crashed(
    actors: list[Child], console: Console, max_restarts: int, shown_errors: set[str] | None = None
) -> bool:
    """Restart an actor that exited with an error (as compose's ``restart: on-failure`` does), at most
    ``max_restarts`` times, and never one that could not set up for this run (its status is
    ``SETUP_ERROR_EXIT_STATUS``: it would fail the same way). Returns True when every actor has exited
    and none will be restarted: nothing would ever fill a rollout.

    Each exit is one line on ``console``; the first exit with an error not in ``shown_errors`` (the
    errors already shown, updated here) adds the crash's traceback (:func:`crash_traceback`, else the
    output's last lines), a later one says ``(same error: ...)``."""
    shown = set() if shown_errors is None else shown_errors
    for actor in actors:
        code = actor.poll()
        if code in (None, 0) or actor.gave_up:
            continue
        actor.gave_up = code == SETUP_ERROR_EXIT_STATUS or actor.restarts >= max_restarts
        if not actor.gave_up:
            actor.restarts += 1
        what = "not restarted" if actor.gave_up else f"restarting ({actor.restarts}/{max_restarts})"
        style = "red" if actor.gave_up else "yellow"
        output = actor.log_tail(OUTPUT_LINES_KEPT)
        error = last_error(output)
        if error is not None and error in shown:
            print_line(
                console,
                f"{actor.name} {exit_description(code)} (same error: {error}); {what}",
                style,
            )
        else:
            shown.update([error] if error is not None else [])
            details = crash_traceback(output) or output.splitlines()[-5:]
            print_line(console, f"{actor.name} {exit_description(code)}; {what}", style)
            print_line(console, "\n".join(details))
        if not actor.gave_up:
            actor.start()
    return all(actor.gave_up for actor in actors)


class Launch:
    """The learner and actor processes of one planned run (with ``actor_inference`` central, the
    inference server too: ``oakemu_services.inference``, restarted as an actor is), and the progress
    view while they train.

    :meth:`watch` returns why it stopped watching: ``"signal"`` (Ctrl-C / SIGTERM), ``"learner"`` (the
    learner exited: budget spent, or a failure), ``"actors"`` (every actor gave up), ``"inference"``
    (the inference server gave up) or ``"callback"`` (a Python API callback returned False or raised).

    Args:
        plan: the planned run.
        console: where progress and notes go (a quiet console for ``verbose=0``).
        verbose: 0: no progress output, only errors; 1: progress (:func:`~oakemu_services.train_view.progress_view`).
        callbacks: the Python API's callbacks, fed with the run's ``metrics.jsonl`` records, or None.
    """

    def __init__(
        self,
        plan: RunPlan,
        console: Console,
        *,
        verbose: int = 1,
        callbacks: CallbackRunner | None = None,
    ) -> None:
        self.plan = plan
        self.console = console
        self.errors = Console(stderr=True) if console.quiet else console
        """Where errors go: the console, or a console of their own when it is quiet."""
        self.verbose = verbose
        config, logs_dir = plan.config, plan.run_dir / "logs"
        cli = [sys.executable, "-m", "oakemu_services.cli"]
        self.learner = Child(
            "learner",
            [*cli, "learner"],
            _child_env(plan.config_file),
            logs_dir / "learner.log",
            pass_fds=plan.learner_fds,
        )
        central: dict[str, str] = {}  # actor_inference "central": the server's address
        self.inference: Child | None = None
        self.inference_dir: str | None = None
        if config.actor_inference == "central":  # an ipc:// socket in a folder of this user only
            self.inference_dir = tempfile.mkdtemp(prefix="oakemu-")
            central[INFERENCE_ADDRESS_ENV] = f"ipc://{self.inference_dir}/inference"
            self.inference = Child(
                "inference",
                [sys.executable, "-m", "oakemu_services.inference"],
                _child_env(plan.config_file, **central),
                logs_dir / "inference.log",
            )
        self.actors = [
            Child(
                f"actor-{i}",
                [*cli, "actor"],
                _child_env(plan.config_file, OAKEMU_ACTOR_ID=f"actor-{i}", **central),
                logs_dir / f"actor-{i}.log",
            )
            for i in range(config.num_actors)
        ]
        self.first_actor_error: str | None = None
        """``actor-N: <error line>`` of the first actor that exited with an error."""
        self.shown_errors: set[str] = set()
        """Actor errors already shown with their traceback."""
        self.last_update = -1
        self.learner_status: int | None = None
        self.callbacks = callbacks
        self._records = RecordFollower(plan.run_dir / METRICS_FILE_NAME, since=time.time())

    def start(self) -> None:
        self.learner.start()
        if self.inference is not None:
            self.inference.start()
        for actor in self.actors:
            actor.start()

    def watch(self, stop: StopRequest) -> str:
        """Show progress until the learner exits, every actor gave up, a callback stops the run, or
        ``stop`` is set."""
        config = self.plan.config
        subscriber = TelemetrySubscriber(config.learner_address(config.telemetry_port))
        view = progress_view(self.console, config.total_env_steps, self.verbose)
        try:
            while not stop.is_set():
                self.learner_status = self.learner.poll()
                if self.learner_status is not None:
                    return "learner"
                snapshot = subscriber.receive(
                    timeout_s=0.1
                )  # short: the learner's exit is seen at once
                if snapshot is not None:
                    view.show(snapshot)
                view.tick()
                if self.feed_callbacks():
                    return "callback"
                self._note_actor_errors()
                if _restart_crashed(
                    self.actors, self.console, config.actor_restarts, self.shown_errors
                ):
                    return "actors"
                if self.inference is not None and _restart_crashed(
                    [self.inference], self.console, config.actor_restarts, self.shown_errors
                ):
                    return "inference"
            return "signal"
        finally:
            self.last_update = view.last_update
            view.close()
            subscriber.close()

    def feed_callbacks(self, *, may_stop: bool = True) -> bool:
        """Give the callbacks the run's new ``metrics.jsonl`` records; True when one stops the run
        (``may_stop=False``: the run has ended, a ``False`` is ignored)."""
        return self.callbacks is not None and self.callbacks.feed(
            self._records.new_records(), may_stop=may_stop
        )

    def _note_actor_errors(self) -> None:
        if self.first_actor_error is not None:
            return
        for actor in self.actors:
            code = actor.poll()
            if code not in (None, 0):
                self.first_actor_error = (
                    f"{actor.name}: {actor.error_line() or exit_description(code)}"
                )
                return

    def stop(self) -> None:
        """Stop the learner first (it finishes its update and writes the final checkpoint), then the
        actors; then remove the shared memory of a child a signal killed and wait (briefly) for the rest
        of their output."""
        self.learner.signal(signal.SIGTERM)
        status = self.learner.wait(STOP_GRACE_S)
        self.learner_status = status if self.learner_status is None else self.learner_status
        for actor in self.actors:
            actor.signal(signal.SIGTERM)
        for actor in self.actors:
            actor.wait(10.0)
        server = [] if self.inference is None else [self.inference]
        for child in server:  # after the actors: none of them waits for it any more
            child.signal(signal.SIGTERM)
            child.wait(10.0)
        for child in (self.learner, *self.actors, *server):
            child.remove_leftover_segments()
            if child.output is not None:
                child.output.drain()
        if self.inference_dir is not None:
            shutil.rmtree(self.inference_dir, ignore_errors=True)


def report(launch: Launch, ended_by: str, stop: StopRequest, console: Console) -> int:
    """Say how the run ended and return the exit status (see the module docstring). Errors go to
    ``launch.errors``, the rest to ``console``."""
    run_dir, errors = launch.plan.run_dir, launch.errors
    records = _metrics_records(run_dir)
    final = _final_update_line(records)
    if final is not None and final[0] > launch.last_update:
        # The last update line agrees with metrics.jsonl even when the last telemetry was missed.
        print_line(console, final[1])
    actor_error = (
        f"; first actor error: {launch.first_actor_error}" if launch.first_actor_error else ""
    )
    resume = f"oakemu train --resume {run_dir}" if latest_checkpoint(run_dir) is not None else None
    callbacks = launch.callbacks
    if callbacks is not None and callbacks.error is not None:
        print_line(
            errors, f"error: {callbacks.stop_reason}: the run stopped (run folder {run_dir})", "red"
        )
        return 1
    status = launch.learner_status or 0
    if ended_by == "signal":
        name = signal.Signals(stop.signum).name if stop.signum else "a signal"
        continue_with = f" (continue with {resume})" if resume else ""
        print_line(console, f"stopped by {name}: run folder {run_dir}{continue_with}")
        if (
            status > 0 and status != stop.exit_status
        ):  # the learner's own failure (its final checkpoint)
            print_line(errors, f"error: {_learner_failure(launch.learner, status)}", "red")
        return stop.exit_status or 130
    if ended_by in ("actors", "inference"):
        who = "every actor" if ended_by == "actors" else "the inference server"
        server_error = launch.inference.error_line() if launch.inference is not None else None
        because = f"; its error: {server_error}" if ended_by == "inference" and server_error else ""
        print_line(
            errors,
            f"error: {who} stopped for good, the run cannot go on{because or actor_error} "
            f"(logs: {run_dir / 'logs'})",
            "red",
        )
        return 1
    if status != 0:
        then = f"; continue with {resume}" if status < 0 and resume else ""
        print_line(
            errors, f"error: {_learner_failure(launch.learner, status, actor_error)}{then}", "red"
        )
        return 1 if status < 0 else status
    if final is None and launch.last_update < 0:
        print_line(
            errors,
            f"error: the run made no PPO update{actor_error} (logs: {run_dir / 'logs'})",
            "red",
        )
        return 1
    if resume is None:  # a learner that exited 0 wrote its final checkpoint: this one did not
        print_line(
            errors,
            f"error: the run ended without a checkpoint in {run_dir / 'checkpoints'} "
            f"({launch.learner.log_note()})",
            "red",
        )
        return 1
    stopped = ended_by == "callback" and callbacks is not None
    lines = end_lines(run_dir, records, resumable=stopped)
    for line in lines[:-1]:
        print_line(console, line)
    print_line(
        console,
        f"stopped by a callback ({callbacks.stop_reason}): run folder {run_dir}"
        if stopped
        else f"done: run folder {run_dir}",
    )
    print_line(console, lines[-1])
    return 0


def _learner_failure(learner: Child, status: int, actor_error: str = "") -> str:
    """``the learner <exited with status N: its error | was killed by SIG...>`` with its log (and, for
    SIGKILL, the OOM killer's part), for a learner that exited with ``status`` != 0."""
    note = learner.log_note()
    if status < 0:  # a signal the launcher did not send (the launcher's own stop ends as "signal")
        reason = f"the learner {exit_description(status)}"
        if status == -signal.SIGKILL:
            note = f"out of memory? the kernel's OOM killer sends SIGKILL: see dmesg; {note}"
    else:
        reason = f"the learner {exit_description(status)}: {learner.stop_reason() or 'its output holds no error'}"
    return f"{reason}{actor_error} ({note})"


def _count(number: int, noun: str) -> str:
    """``1 actor``, ``2 actors``."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def announce_run(plan: RunPlan, preset: Preset | None, console: Console) -> None:
    """What a run is about to do, on ``console`` before anything starts: the preset's line, the plan's
    warnings and resume notes, changed settings, rollback, the run's size and folder, and where to
    watch it live (``oakemu monitor``, Prometheus)."""
    config = plan.config
    if preset is not None:
        console.print(
            f"preset {preset.name}: {preset.description}; expect {preset.expect}",
            highlight=False,
            soft_wrap=True,
        )
    for note in plan.notes:
        print_line(console, f"warning: {note}", "yellow")
    if plan.resumed_from is not None:
        print_line(console, plan.resumed_from)
    if plan.changes:
        console.print(
            f"[yellow]changed settings[/] (config.toml -> now): {format_changes(plan.changes)}",
            highlight=False,
            soft_wrap=True,
        )
    if config.rollback:
        console.print(
            f"rollback on: a collapsing run returns to its last good checkpoint with the learning rate "
            f"x {config.rollback_lr_factor} (at most {config.max_rollbacks} times; --no-rollback turns it off)",
            highlight=False,
            soft_wrap=True,
        )
    actors, envs = _count(config.num_actors, "actor"), _count(config.envs_per_actor, "env")
    network = config.network.describe()
    network = "" if network == "default" else f", network {network}"
    console.print(
        f"[bold]oakemu train[/]: {config.env_id}, {actors} x {envs}{network}, {config.total_env_steps} env steps -> "
        f"{plan.run_dir}" + (" (resumed)" if plan.resumed else ""),
        highlight=False,
        soft_wrap=True,
    )
    prometheus = (
        f"; Prometheus: http://127.0.0.1:{config.metrics_port}/metrics"
        if config.metrics_enabled
        else ""
    )
    console.print(
        f"live view: oakemu monitor {plan.run_dir}{prometheus}", highlight=False, soft_wrap=True
    )


def main(
    config: OakEmuConfig,
    resume: Path | None = None,
    *,
    preset: Preset | None = None,
    verbose: int = 1,
    callbacks: CallbackRunner | None = None,
    plan: RunPlan | None = None,
) -> int:
    """Run learner + actors until the env-step budget is spent or the user stops it.

    Args:
        config: the resolved configuration (with ``--resume``, already layered over the run's own
            ``config.toml``).
        resume: run folder to continue; its last checkpoint is restored by the learner.
        preset: the preset ``config`` starts from; its line (what to expect) is printed once the run
            can start.
        verbose: 1: progress and notes on stderr; 0: errors only (the Python API's quiet mode).
        callbacks: the Python API's callbacks (:class:`~oakemu_core.run.callbacks.CallbackRunner`): fed
            each update and evaluation; when one stops the run, the run stops as after SIGTERM.
        plan: the run already planned (:func:`plan_run`; the Python API plans first to know the run's
            folder, and releases the plan); ``config`` and ``resume`` are then not used. Without it the
            run's folder and ports stay held until this process exits.

    Returns:
        The exit status (see the module docstring).

    Raises:
        UserError (a subclass): the run cannot start (:func:`plan_run`); nothing was started or created.
    """
    plan = plan_run(config, resume) if plan is None else plan
    console = Console(stderr=True, quiet=verbose <= 0)
    announce_run(plan, preset, console)
    stop = install_stop_signals()
    launch = Launch(plan, console, verbose=verbose, callbacks=callbacks)
    ended_by = "signal"
    try:
        launch.start()
        ended_by = launch.watch(stop)
        if ended_by in ("signal", "callback"):
            why = (
                f" ({callbacks.stop_reason})"
                if ended_by == "callback" and callbacks is not None
                else ""
            )
            print_line(
                console,
                f"stopping{why}: "
                + (
                    "waiting for the learner's final checkpoint ..."
                    if launch.last_update >= 0
                    else "no update made yet, stopping the learner and actors ..."
                ),
            )
        elif ended_by in ("actors", "inference"):
            who = "every actor has" if ended_by == "actors" else "the inference server has"
            print_line(launch.errors, f"{who} stopped for good: stopping the learner", "red")
    finally:
        launch.stop()
    if (
        ended_by == "learner"
    ):  # the records of the run's end (the final evaluation) for the callbacks
        launch.feed_callbacks(may_stop=False)
    return report(launch, ended_by, stop, console)
