"""The Python API's training entry point: :func:`train` runs ``oakemu train`` from Python and returns its
:class:`~oakemu_core.run.results.Run` (exported as ``oakemu_core.train``).

    import oakemu_core

    run = oakemu_core.train(preset="cartpole", total_env_steps=20_000)
    print(run.run_dir, run.updates, run.best_evaluation)
    policy = run.load_policy()

It starts the same learner and actor processes as the command (this process waits for them, shows the
progress and handles Ctrl-C: call it from the main thread, as a notebook cell or a script does).
``callbacks`` are called on each PPO update and evaluation and may stop the run early
(:mod:`oakemu_core.run.callbacks`); ``verbose=0`` prints errors only.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterable
from typing import Any

from oakemu_services import train as launcher

from oakemu_core.config import OakEmuConfig, make_config
from oakemu_core.errors import ConfigError
from oakemu_core.presets import load_preset
from oakemu_core.run.callbacks import (
    Callback,
    CallbackLike,
    CallbackRunner,
    EvaluationInfo,
    UpdateInfo,
)
from oakemu_core.run.results import Run, read_run

__all__ = ["Callback", "EvaluationInfo", "TrainingFailed", "UpdateInfo", "train"]


class TrainingFailed(RuntimeError):
    """``oakemu train`` ended without training its budget (every actor gave up, no update was made, the
    learner failed); the message says why, :attr:`run` holds what the run folder recorded."""

    def __init__(self, message: str, run: Run) -> None:
        super().__init__(message)
        self.run = run


def train(
    config: OakEmuConfig | None = None,
    preset: str | None = None,
    *,
    callbacks: CallbackLike | Iterable[CallbackLike] | None = None,
    verbose: int = 1,
    **overrides: Any,
) -> Run:
    """Train until the env-step budget is spent or a callback stops the run; returns the :class:`Run`.

    Settings, highest precedence first: ``overrides`` (field name -> value, e.g. ``total_env_steps=20_000``),
    then ``config``'s settings (those it was given), or else ``OAKEMU_*`` variables and the TOML file of
    ``$OAKEMU_CONFIG_FILE``, then the ``preset``, then the defaults. Ports not given are chosen free, so
    several calls (or ``oakemu train`` runs) may share a machine.

    ``callbacks``: a :class:`~oakemu_core.run.callbacks.Callback` (``on_update(info)``,
    ``on_evaluation(info)``), a callable taking an :class:`UpdateInfo` or :class:`EvaluationInfo`, or a
    list of them, called in this process after each PPO update and each evaluation. One returning
    ``False`` stops the run as Ctrl-C would (the learner finishes its update and writes the final
    checkpoint) and ``train`` returns the run with ``stopped_by_callback`` True. ``verbose``: 1 shows
    progress on stderr (a bar on a terminal, a line every 15 s elsewhere), 0 only errors.

    Raises:
        UserError (a subclass, e.g. ConfigError): a setting, a preset name, the env or a port is wrong;
            nothing was started.
        TrainingFailed: the run ended without training its budget (message and :attr:`TrainingFailed.run`).
        KeyboardInterrupt: Ctrl-C stopped the run (after its final checkpoint).
        TypeError: a callback is neither a Callback nor callable (nothing was started).
        Exception: what a callback raised, once the run it stopped has ended (final checkpoint written).
    """
    if config is not None and preset is not None:
        raise ConfigError("train: expected config or preset, received both")
    base = load_preset(preset).settings if preset is not None else {}
    given = (
        {name: getattr(config, name) for name in config.model_fields_set}
        if config is not None
        else {}
    )
    config = make_config(base, **{**given, **overrides})
    runner = CallbackRunner(callbacks) if callbacks is not None else None
    plan = launcher.plan_run(
        config
    )  # chooses the run folder (a free name) and holds it and the ports
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = launcher.main(plan.config, verbose=verbose, callbacks=runner, plan=plan)
    finally:  # the launcher's stop handlers, run folder and ports served this run only
        plan.release()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    run = read_run(plan.run_dir, status)
    if runner is not None and runner.error is not None:
        raise runner.error
    if runner is not None and runner.stopping and status == 0:
        return dataclasses.replace(run, stopped_by_callback=True)
    if status in (130, 143):
        raise KeyboardInterrupt(
            f"training stopped by a signal; the run folder {run.run_dir} can be resumed"
        )
    if status != 0:
        raise TrainingFailed(
            f"oakemu train exited with status {status} after {run.updates} updates (logs: "
            f"{run.run_dir / 'logs'})",
            run,
        )
    return run
