"""``oakemu tune`` end to end: real trials (tiny CartPole runs) in worker processes on SQLite and on a
throwaway PostgreSQL cluster, a crashing trial, a worker killed with ``kill -9``, and the command's
refusals (one line, exit 2). Every process started is tracked and stopped by the ``e2e`` fixture, which
also fails a test that leaves a process or a ``/dev/shm`` segment behind."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from oakemu_services import cli
from oakemu_services import tune as tune_service
from oakemu_services.tune import fit_jobs

from oakemu_core.config import load_config, make_config
from oakemu_core.tuning.study import sqlite_url
from tests.e2e_helpers import describe_all, free_ports, read_jsonl, update_records, wait_for

pytestmark = pytest.mark.usefixtures("no_oakemu_variables")

CRASHING_ENV = "tests.crash_envs:CrashingCartPole-v0"
TINY = (  # 5-10 s a trial on 2 quiet cores: 4 updates of 32 steps x 8 envs, 2 evaluations of 2 episodes
    "--preset cartpole --total-env-steps 1024 --eval-every-updates 2 --eval-episodes 2 --no-eval-video".split()
)
SPACE = """
[space.learning_rate]
low = 3e-4
high = 3e-3
log = true

[space.clip_coef]
choices = [0.1, 0.2, 0.3]
"""


def _space(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "space.toml"
    path.write_text(SPACE + extra, encoding="utf-8")
    return path


def _trials(storage: str, name: str = "cartpole") -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=storage).get_trials()


@pytest.mark.slow
def test_a_sweep_runs_its_trials_fails_a_crashing_one_and_its_best_toml_trains(
    e2e, tmp_path: Path
) -> None:
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    space = _space(tmp_path, f'\n[space.env_id]\nchoices = ["CartPole-v1", "{CRASHING_ENV}"]\n')
    study = optuna.create_study(
        storage=sqlite_url(study_dir), study_name="cartpole", direction="maximize"
    )
    for env_id, learning_rate in (
        ("CartPole-v1", 1e-3),
        (CRASHING_ENV, 1e-3),
        ("CartPole-v1", 2e-3),
    ):
        study.enqueue_trial({"env_id": env_id, "learning_rate": learning_rate, "clip_coef": 0.2})
    # 2048 env steps: the crashing env fails after 200 steps of each of its 8 envs, at the 7th update.
    options = f"--trials 3 --space {space} --study-dir {study_dir} --actor-restarts 0 --total-env-steps 2048"
    args = [*TINY, *options.split()]
    tune = e2e.start("tune", ["tune", *args])
    assert tune.wait(300) == 0, tune.describe()
    trials = _trials(sqlite_url(study_dir))
    assert [trial.state.name for trial in trials] == ["COMPLETE", "FAIL", "COMPLETE"], (
        tune.describe()
    )
    assert (
        trials[1]
        .user_attrs["error"]
        .startswith("TrainingFailed: oakemu train exited with status 1")
    )
    stderr = tune.stderr()
    assert "trial 1: failed: TrainingFailed" in stderr and "3/3 done" in stderr
    assert "Traceback" not in stderr
    rows = (study_dir / "trials.csv").read_text().splitlines()
    assert rows[0].startswith("number,state,objective,wall_s,env_steps,") and len(rows) == 4
    assert [row.split(",")[1] for row in rows[1:]] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert (study_dir / "runs" / "trial-0" / "metrics.jsonl").is_file()
    best = max((trials[0], trials[2]), key=lambda trial: (trial.value, -trial.number))
    config = load_config(["--config", str(study_dir / "best.toml")])
    assert config.learning_rate == best.params["learning_rate"] and config.env_id == "CartPole-v1"
    assert config.total_env_steps == 2048 and config.eval_video is False and config.num_envs == 8
    preset = tomllib.loads((study_dir / "best-preset.toml").read_text())
    flat = tomllib.loads((study_dir / "best.toml").read_text())
    assert set(preset) == {"preset", "settings"} and preset["settings"] == flat
    make_config(**preset["settings"])
    assert {path.name for path in (study_dir / "plots").iterdir()} >= {
        "history.html",
        "intermediate.html",
    }
    again = e2e.train(
        [
            "--config",
            str(study_dir / "best.toml"),
            "--total-env-steps",
            "256",
            "--eval-every-updates",
            "0",
        ],
        timeout_s=180,
        runs_dir=tmp_path / "again",
    )
    trained = tomllib.loads((again.run_dir / "config.toml").read_text())
    assert trained["learning_rate"] == best.params["learning_rate"] and trained["clip_coef"] == 0.2


@pytest.mark.slow
def test_two_worker_processes_split_the_trials_of_a_sqlite_study(e2e, tmp_path: Path) -> None:
    study_dir = tmp_path / "study"
    args = [
        *TINY,
        *f"--trials 2 --jobs 2 --study-dir {study_dir} --space {_space(tmp_path)}".split(),
    ]
    tune = e2e.start("tune", ["tune", *args])
    assert tune.wait(300) == 0, tune.describe()
    trials = _trials(sqlite_url(study_dir))
    assert [trial.state.name for trial in trials] == ["COMPLETE"] * 2, tune.describe()
    workers = {trial.user_attrs["worker"] for trial in trials}  # the two workers, one trial each
    assert len(workers) == 2 and str(tune.pid) not in {worker.split(":")[1] for worker in workers}
    assert "2 worker processes" in tune.stderr() and "2/2 done" in tune.stderr()


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL cluster (Debian's initdb and pg_ctl, run as the postgres user under root),
    listening on a Unix socket in a temporary folder; stopped and removed afterwards."""
    binaries = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    initdb = Path(binaries[-1]) if binaries else Path(shutil.which("initdb") or "/missing/initdb")
    if not initdb.is_file():
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    pytest.importorskip(
        "psycopg", reason="psycopg is not installed (pip install 'psycopg[binary]')"
    )
    run_as: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="oakemu-pg-"))
    if os.geteuid() == 0:  # postgres refuses to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root)
            pytest.skip("running as root and no postgres user to run PostgreSQL as")
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    pg_ctl, data, port = initdb.parent / "pg_ctl", root / "data", free_ports(1)[0]
    try:
        subprocess.run([*run_as, str(initdb), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        options = f"-k {root} -p {port} -c listen_addresses='' -c fsync=off"
        subprocess.run([*run_as, str(pg_ctl), "-D", str(data), "-l", str(root / "log"), "-o", options, "-w", "start"],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        yield f"postgresql+psycopg://postgres@/postgres?host={root}&port={port}"
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run([*run_as, str(pg_ctl), "-D", str(data), "-m", "immediate", "-w", "stop"],
                           capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_two_commands_on_one_postgresql_study_split_its_trials(
    e2e, tmp_path: Path, postgres_url: str
) -> None:
    args = [
        "tune",
        *TINY,
        *f"--trials 2 --space {_space(tmp_path)} --storage {postgres_url}".split(),
    ]
    args += ["--study", "shared", "--total-env-steps", "4096"]
    first = e2e.start("tune-1", [*args, "--study-dir", str(tmp_path / "one")])
    second = e2e.start("tune-2", [*args, "--study-dir", str(tmp_path / "two")])
    assert first.wait(300) == 0, first.describe()
    assert second.wait(120) == 0, second.describe()
    trials = _trials(postgres_url, "shared")
    assert [trial.state.name for trial in trials] == ["COMPLETE", "COMPLETE"], describe_all(
        first, second
    )()
    workers = {trial.user_attrs["worker"].split(":")[1] for trial in trials}
    assert workers == {str(first.pid), str(second.pid)}, describe_all(first, second)()
    for folder in ("one", "two"):  # each command writes the whole study's outputs
        assert len((tmp_path / folder / "trials.csv").read_text().splitlines()) == 3


@pytest.mark.slow
def test_a_worker_killed_mid_trial_leaves_no_process_and_its_trial_is_failed_by_the_next(
    e2e, tmp_path: Path
) -> None:
    study_dir = tmp_path / "study"
    args = [
        "tune",
        *TINY,
        *f"--trials 2 --space {_space(tmp_path)} --study-dir {study_dir}".split(),
    ]
    args += ["--heartbeat", "1"]
    killed = e2e.start("tune-killed", [*args, "--total-env-steps", "500000"])
    run_dir = study_dir / "runs" / "trial-0"
    wait_for(
        lambda: update_records(run_dir),
        120,
        "trial 0's first update",
        on_timeout=describe_all(killed),
    )
    trial_processes = {pid for pid, _ in e2e.alive()} - {killed.pid}
    assert len(trial_processes) >= 2, e2e.alive()  # the trial's learner and actor
    killed.popen.kill()
    assert killed.wait(10) == -9
    # The trial's learner and actors die with their launcher (the worker): they stop, no segment stays.
    wait_for(
        lambda: not e2e.alive(),
        90,
        "the killed worker's trial processes to exit",
        on_timeout=lambda: str(e2e.alive()),
    )
    assert e2e.leftover_segments() == []
    assert [trial.state.name for trial in _trials(sqlite_url(study_dir))] == ["RUNNING"]
    assert any("checkpoint" in str(path) for path in (run_dir / "checkpoints").iterdir())
    after = e2e.start("tune-after", args)
    assert after.wait(180) == 0, after.describe()
    trials = _trials(sqlite_url(study_dir))
    assert [trial.state.name for trial in trials] == ["FAIL", "COMPLETE"], after.describe()
    assert "trial 0: failed: no heartbeat: its worker stopped" in after.stderr()
    assert read_jsonl(
        run_dir / "metrics.jsonl"
    )  # the killed trial's run folder stays as it was left


def _refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    status = cli.main(["tune", *argv])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_mistakes_are_one_line_and_exit_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study_dir = str(tmp_path / "study")
    common = ["--study-dir", study_dir, "--space", str(_space(tmp_path))]
    err = _refusal(capsys, "--preset", "cartpole", *common, "--storage", "nosuchdb://host/db")
    assert "storage: cannot open nosuchdb://host/db" in err
    err = _refusal(
        capsys,
        "--preset",
        "cartpole",
        *common,
        "--storage",
        "postgresql+psycopg://u:pw@127.0.0.1:1/db",
    )
    assert "storage: cannot open postgresql+psycopg://u:***@127.0.0.1:1/db" in err
    bad_space = tmp_path / "bad.toml"
    bad_space.write_text("[space.lerning_rate]\nlow = 1e-5\nhigh = 1e-3\n")
    err = _refusal(
        capsys, "--preset", "cartpole", "--study-dir", study_dir, "--space", str(bad_space)
    )
    assert "'lerning_rate' is no setting; did you mean 'learning_rate'?" in err
    err = _refusal(capsys, "--preset", "cartpol", *common)
    assert "preset: expected one of" in err and "did you mean 'cartpole'?" in err
    err = _refusal(capsys, "--preset", "cartpole", *common, "--run-name", "mine")
    assert "run_name: each trial names its own run folder" in err
    err = _refusal(capsys, "--preset", "cartpole", *common, "--eval-every-updates", "0")
    assert "objective: 'eval' needs periodic evaluations" in err
    err = _refusal(capsys, "--preset", "cartpole", *common, "--trials", "0")
    assert "--trials" in err
    assert not Path(study_dir).exists()


def test_the_storage_help_and_the_docstring_give_the_postgresql_url_that_works() -> None:
    """``postgresql+psycopg://`` names the driver the tests and the README install (``psycopg[binary]``); a
    bare ``postgresql://`` leaves it to SQLAlchemy's version (psycopg2, which no extra installs, before 2.1)."""
    import sqlalchemy

    url = sqlalchemy.engine.make_url("postgresql+psycopg://u@db/x")
    assert url.get_dialect().driver == "psycopg"
    _, commands = cli.build_parser()
    help_text = " ".join(commands["tune"].format_help().split())
    for text in (help_text, tune_service.__doc__ or ""):
        assert "postgresql+psycopg://" in text and "psycopg[binary]" in text, text
        assert "postgresql://" not in text, text


def test_jobs_auto_gives_each_trial_two_cpus_and_workers_get_equal_shares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert [fit_jobs(cpus, trials=20) for cpus in (1, 2, 3, 8, 16)] == [1, 1, 1, 4, 8]
    assert fit_jobs(16, trials=3) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert tune_service._cpu_shares(2) == [[0, 1], [2, 3]]
    assert tune_service._cpu_shares(8) is None  # more workers than CPUs: not pinned


def test_best_toml_names_the_settings_the_preset_file_variables_and_options_gave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_file = tmp_path / "mine.toml"
    config_file.write_text("ent_coef = 0.01\n")
    monkeypatch.setenv("OAKEMU_GAE_LAMBDA", "0.9")
    names = tune_service._given_names(
        {"env_id": "CartPole-v1"}, {"config_file": str(config_file), "seed": 3}
    )
    assert names == ["env_id", "ent_coef", "gae_lambda", "config_file", "seed"]
