"""The Docker story on a real engine: image build without a registry, compose, and Docker Swarm.

Marked ``docker`` (select with ``-m docker``, leave out with ``-m "not docker"``) and ``slow``. Every
test skips with the reason when no Docker engine answers (``docker info``) or Compose v2 is missing;
``.ci/run`` installs and starts one. One image (``oakemu-rl:test``, built by ``deploy/build-image.sh``)
serves all tests of the module. Every container, network, volume and swarm a test makes is removed
even when the test fails (fixture finalizers), and the tests assert it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
STACK_FILE = REPO_ROOT / "deploy" / "stack.yml"
BUILD_SCRIPT = REPO_ROOT / "deploy" / "build-image.sh"
TEST_IMAGE = os.environ.get("OAKEMU_TEST_IMAGE", "oakemu-rl:test")

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1500)]

# Small CartPole runs: 3 actors x 4 envs fill a 12-column, 32-step buffer in a fraction of a second.
RUN_SETTINGS = {
    "OAKEMU_ENV_ID": "CartPole-v1",
    "OAKEMU_MODE": "sync",
    "OAKEMU_ENVS_PER_ACTOR": "4",
    "OAKEMU_NUM_ENVS": "12",
    "OAKEMU_ROLLOUT_LENGTH": "32",
    "OAKEMU_ACTOR_TIMEOUT_S": "3",
    "OAKEMU_SHM_SIZE": "64m",
    "OAKEMU_IMAGE": TEST_IMAGE,
}


# --- helpers --------------------------------------------------------------------------------------


def run(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    check: bool = True,
    cwd: Path = REPO_ROOT,
) -> subprocess.CompletedProcess[str]:
    """Run a command, capture its output; on ``check`` a failure shows the command and its output."""
    result = subprocess.run(
        args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited with {result.returncode}\nstdout:\n{result.stdout[-3000:]}\n"
            f"stderr:\n{result.stderr[-3000:]}"
        )
    return result


def engine_unavailable_reason() -> str | None:
    """Why these tests cannot run here, or None when a Docker engine and Compose v2 answer."""
    if shutil.which("docker") is None:
        return "no docker client on PATH (.ci/run installs docker.io and starts dockerd)"
    try:
        info = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "docker info timed out: no Docker engine answers"
    if info.returncode != 0 or not info.stdout.strip():
        return f"no Docker engine answers (docker info: {info.stderr.strip()[:200]}); .ci/run starts one"
    compose = subprocess.run(
        ["docker", "compose", "version", "--short"],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    if compose.returncode != 0 or not compose.stdout.strip().lstrip("v").startswith("2"):
        return "Docker Compose v2 is not installed (deploy/install-compose.sh installs the pinned version)"
    return None


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, period_s: float = 2.0) -> Any:
    """Call ``probe`` until it returns a truthy value; fail with ``what`` and the last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = probe()
        except AssertionError as error:  # a probe command failed: keep trying until the deadline
            last = error
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout_s:.0f} s waiting for {what}; last: {str(last)[:2000]}"
            )
        time.sleep(period_s)


def matching(
    snapshot: dict[str, Any], predicate: Callable[[dict[str, Any]], bool]
) -> dict[str, Any] | None:
    """``snapshot`` when it satisfies ``predicate``, else None (for :func:`wait_for`)."""
    return snapshot if predicate(snapshot) else None


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def leftovers(label: str) -> dict[str, list[str]]:
    """Containers, networks and volumes that carry ``label`` (``key=value``)."""
    found = {}
    for kind, command in (
        ("containers", ["docker", "ps", "-aq"]),
        ("networks", ["docker", "network", "ls", "-q"]),
        ("volumes", ["docker", "volume", "ls", "-q"]),
    ):
        output = run([*command, "--filter", f"label={label}"], check=False).stdout.split()
        if output:
            found[kind] = output
    return found


def remove_labelled(label: str) -> None:
    """Force-remove every container, then network and volume, that carries ``label``."""
    for command in (
        ["docker", "ps", "-aq"],
        ["docker", "network", "ls", "-q"],
        ["docker", "volume", "ls", "-q"],
    ):
        ids = run([*command, "--filter", f"label={label}"], check=False).stdout.split()
        if ids:
            remove = {
                "ps": ["docker", "rm", "-f", "-v"],
                "network": ["docker", "network", "rm"],
                "volume": ["docker", "volume", "rm", "-f"],
            }[command[1]]
            run([*remove, *ids], check=False, timeout=120)


def snapshot_from(output: str) -> dict[str, Any]:
    """The telemetry snapshot printed by ``oakemu monitor --once --json`` (its last JSON line)."""
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"the monitor printed no JSON: {output[-1000:]}"
    return json.loads(lines[-1])


class Compose:
    """``docker compose`` for one test project (its own name, environment and files)."""

    def __init__(
        self, project: str, files: list[Path], env: dict[str, str], env_file: Path
    ) -> None:
        self.project = project
        self.files = files
        self.env = env
        self.env_file = env_file

    def __call__(
        self,
        *args: str,
        timeout: float = 180,
        check: bool = True,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``docker compose -p PROJECT -f ... ARGS``."""
        command = ["docker", "compose", "-p", self.project, "--env-file", str(self.env_file)]
        for file in self.files:
            command += ["-f", str(file)]
        return run(
            [*command, *args], env={**self.env, **(extra_env or {})}, timeout=timeout, check=check
        )

    def monitor(self) -> dict[str, Any]:
        """One telemetry snapshot through the compose file's monitor service (a one-off container)."""
        result = self(
            "run",
            "--rm",
            "-T",
            "monitor",
            "monitor",
            "--connect",
            "tcp://learner:5558",
            "--once",
            "--json",
            "--timeout",
            "10",
            timeout=90,
        )
        return snapshot_from(result.stdout)

    def logs(self, service: str) -> str:
        """The service's container logs (all its containers, no prefixes)."""
        return self("logs", "--no-color", "--no-log-prefix", service, timeout=60).stdout

    def container_ids(self, service: str, all_states: bool = False) -> list[str]:
        """Container ids of ``service`` (running ones unless ``all_states``)."""
        return self("ps", "-q", *(["-a"] if all_states else []), service).stdout.split()

    def down(self) -> None:
        """``down -v --remove-orphans``, then force-remove anything of the project that is left."""
        self("down", "-v", "--remove-orphans", "--timeout", "20", timeout=180, check=False)
        remove_labelled(f"com.docker.compose.project={self.project}")


def clean_environment() -> dict[str, str]:
    """This process's environment without OAKEMU_* / COMPOSE_* / DOCKER_HOST-like overrides of the test."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OAKEMU_", "COMPOSE_"))}


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docker_engine() -> None:
    """Skip the module's tests with the reason when there is no engine or no Compose v2."""
    reason = engine_unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def oakemu_image(docker_engine: None) -> str:
    """``oakemu-rl:test`` built once per module by ``deploy/build-image.sh`` (no registry involved)."""
    started = time.monotonic()
    result = run([str(BUILD_SCRIPT), "--tag", TEST_IMAGE, "--quiet"], timeout=1500, check=False)
    if result.returncode != 0:
        pytest.fail(f"deploy/build-image.sh failed ({result.returncode}):\n{result.stderr[-4000:]}")
    print(f"image {TEST_IMAGE} built in {time.monotonic() - started:.0f} s")
    return TEST_IMAGE


@pytest.fixture
def compose(tmp_path: Path, oakemu_image: str) -> Iterator[Compose]:
    """A compose project of the repository's docker-compose.yml, brought down with its volumes at the end.

    An override drops the learner's published host ports (other tests use those ports on loopback):
    everything the test needs happens inside the project's network.
    """
    override = tmp_path / "no-host-ports.yml"
    override.write_text("services:\n  learner:\n    ports: !reset []\n")
    env_file = tmp_path / "empty.env"  # not the repository's .env, if a developer has one
    env_file.write_text("")
    project = f"oakemu-test-{os.getpid()}"
    environment = {**clean_environment(), **RUN_SETTINGS}
    project_compose = Compose(project, [COMPOSE_FILE, override], environment, env_file)
    project_compose.down()  # a project of a killed earlier run of this test
    try:
        yield project_compose
    finally:
        project_compose.down()


# --- the image ------------------------------------------------------------------------------------


def test_image_runs_oakemu_from_its_venv_as_an_unprivileged_user_without_the_build_ca_bundle(
    oakemu_image: str, tmp_path: Path
) -> None:
    """The image: oakemu on PATH from /opt/oakemu, uid 10001, CPU torch, and no CA bundle or wheelhouse."""
    script = (
        "command -v oakemu; id -u; python -c 'import torch, sys; print(torch.__version__, sys.prefix)';"
        " test ! -e /tmp/wheelhouse && echo no-wheelhouse"
    )
    probe = run(
        ["docker", "run", "--rm", "--entrypoint", "sh", oakemu_image, "-c", script], timeout=120
    )
    lines = probe.stdout.split()
    assert lines[0] == "/opt/oakemu/bin/oakemu"
    assert lines[1] == "10001"
    assert lines[2].startswith("2.") and "+cu" not in lines[2], (
        f"expected a CPU torch build, got {lines[2]}"
    )
    assert lines[3] == "/opt/oakemu"
    assert lines[4] == "no-wheelhouse"
    help_text = run(["docker", "run", "--rm", oakemu_image, "--help"], timeout=120).stdout
    assert "learner" in help_text and "actor" in help_text and "monitor" in help_text

    # The CA bundle the build used is in no file of the image (compared by content, via docker export).
    ca_bundle = find_ca_bundle()
    if ca_bundle is None:
        pytest.skip("this machine names no CA bundle, so the build used none")
    ca_bytes = ca_bundle.read_bytes()
    ca_digest = hashlib.sha256(ca_bytes).hexdigest()
    container = run(["docker", "create", oakemu_image]).stdout.strip()
    try:
        export = subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE)
        assert export.stdout is not None
        same = []
        with tarfile.open(fileobj=export.stdout, mode="r|") as archive:
            for member in archive:
                if member.isfile() and member.size == len(ca_bytes):
                    handle = archive.extractfile(member)
                    if (
                        handle is not None
                        and hashlib.sha256(handle.read()).hexdigest() == ca_digest
                    ):
                        same.append(member.name)
        assert export.wait(timeout=300) == 0
    finally:
        run(["docker", "rm", "-f", container], check=False)
    assert not same, f"the build's CA bundle was left in the image: {same}"


def find_ca_bundle() -> Path | None:
    """The CA bundle deploy/build-image.sh picks on this machine (pip's ``global.cert`` or the usual variables)."""
    config = subprocess.run(
        ["python3", "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    match = re.search(r"^global\.cert='(.*)'$", config.stdout, re.MULTILINE)
    for candidate in (
        match.group(1) if match else None,
        os.environ.get("PIP_CERT"),
        os.environ.get("REQUESTS_CA_BUNDLE"),
        os.environ.get("SSL_CERT_FILE"),
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def test_the_image_trains_the_generated_game_boy_rom_and_records_its_screen(
    oakemu_image: str, tmp_path: Path
) -> None:
    """The emulators and video extras are in the image: ``oakemu train`` on the generated Game Boy test
    ROM (tests/emulator_envs.py) for 2,048 env steps in a container, with evaluation videos."""
    import imageio.v3 as iio

    from tests.emulator_envs import test_files

    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)  # the image's user (uid 10001) writes the run folder here
    for source in test_files():
        shutil.copy(source, work / source.name)
    label = f"oakemu-test-gameboy={os.getpid()}"
    try:
        run(
            [
                "docker",
                "run",
                "--rm",
                "--label",
                label,
                "--shm-size",
                "64m",
                "-v",
                f"{work}:/work",
                oakemu_image,
                "train",
                "--env",
                "gameboy:/work/test.gb",
                "--emulator-settings",
                "/work/emulator.toml",
                "--num-actors",
                "1",
                "--envs-per-actor",
                "2",
                "--rollout-length",
                "64",
                "--total-env-steps",
                "2048",
                "--eval-every-updates",
                "8",
                "--eval-episodes",
                "1",
                "--runs-dir",
                "/work/runs",
                "--run-name",
                "gb",
                "--log-format",
                "plain",
            ],
            timeout=900,
        )
    finally:
        remove_labelled(label)
    assert leftovers(label) == {}
    run_dir = work / "runs" / "gb"
    steps = [
        json.loads(line)["global_step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert max(steps) >= 2048
    videos = sorted((run_dir / "videos").glob("update_*.mp4"))
    assert videos, f"no evaluation video in {run_dir}"
    frames = iio.imread(videos[-1], plugin="FFMPEG", index=None)
    assert frames.shape[1:] == (144, 160, 3) and len({frame.tobytes() for frame in frames}) > 1


# --- compose ---------------------------------------------------------------------------------------


def test_compose_scale_kill_stop_resume_and_down(compose: Compose) -> None:
    """The README's compose story on a real engine, step by step (CartPole, small rollouts)."""
    compose("up", "-d", "--no-build", "--scale", "actor=3")

    # 3 actors train and the env-step count rises (the monitor is a one-off container in the network).
    first = wait_for(
        "3 actors and env steps in the monitor",
        lambda: matching(
            compose.monitor(), lambda s: len(s["actors"]) == 3 and s["global_step"] > 0
        ),
        timeout_s=240,
    )
    wait_for(
        "rising env steps with 3 actors",
        lambda: matching(
            compose.monitor(),
            lambda s: s["global_step"] > first["global_step"] and len(s["actors"]) == 3,
        ),
        timeout_s=60,
    )

    # Logs: one record per line, no rich wrapping (every line starts with a timestamp and a level).
    learner_log = compose.logs("learner")
    update_lines = [line for line in learner_log.splitlines() if " update " in line]
    assert update_lines, learner_log[-2000:]
    record = re.compile(
        r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d{4} (DEBUG|INFO|WARNING|ERROR|CRITICAL) oakemu\."
    )
    bad = [line for line in learner_log.splitlines() if line.strip() and not record.match(line)]
    assert not bad, f"log lines that are not one record each: {bad[:5]}"
    whole = re.compile(
        r"\| actors \d+( \| \d+ of \d+ columns)?$"
    )  # the record's last fields, unwrapped
    assert all(whole.search(line.rstrip()) for line in update_lines), update_lines[:3]

    # Scale down to 1: two actors leave, training goes on.
    compose("up", "-d", "--no-build", "--scale", "actor=1")
    one = wait_for(
        "1 actor after scaling down",
        lambda: matching(compose.monitor(), lambda s: len(s["actors"]) == 1),
        timeout_s=60,
    )

    # kill -9 the remaining actor: the learner drops it after actor_timeout_s (3 s) ...
    [actor_container] = compose.container_ids("actor")
    killed_actor_id = one["actors"][0]["actor_id"]
    run(["docker", "kill", "-s", "KILL", actor_container])
    wait_for(
        "the learner to drop the killed actor",
        lambda: (
            "silent for" in compose.logs("learner") and killed_actor_id in compose.logs("learner")
        ),
        timeout_s=60,
    )
    # ... and training goes on with an actor again (`up` starts it when Docker's restart policy did not).
    compose("up", "-d", "--no-build", "--scale", "actor=1")
    at_kill = compose.monitor()["global_step"]
    wait_for(
        "env steps rising again after the kill",
        lambda: matching(
            compose.monitor(), lambda s: s["global_step"] > at_kill and len(s["actors"]) == 1
        ),
        timeout_s=120,
    )
    last_seen = compose.monitor()["global_step"]

    # stop: actors exit, the learner writes a final checkpoint.
    compose("stop", "--timeout", "60", timeout=240)
    assert "final checkpoint" in compose.logs("learner")
    checkpoint_step = read_checkpoint_step(compose)
    assert checkpoint_step >= last_seen, (checkpoint_step, last_seen)

    # up: the learner resumes at the checkpoint's env-step count.
    compose("up", "-d", "--no-build", "--scale", "actor=1")
    resumed = wait_for(
        "the learner to resume",
        lambda: re.search(r"resumed from \S+ at (\d+) env steps", compose.logs("learner")),
        timeout_s=120,
    )
    assert int(resumed.group(1)) == checkpoint_step
    after = wait_for(
        "training after the resume",
        lambda: matching(compose.monitor(), lambda s: s["global_step"] > checkpoint_step),
        timeout_s=120,
    )
    assert after["run_name"] == "main"

    # A changed env id on the same run: the learner must refuse with a message, no traceback.
    compose("stop", "--timeout", "60", timeout=240)
    refusal_problem = check_env_change_refused(compose)

    # down -v leaves no container, network or volume of the project.
    compose("down", "-v", "--remove-orphans", "--timeout", "20")
    left = leftovers(f"com.docker.compose.project={compose.project}")
    assert not left, f"docker compose down -v left {left}"
    assert not refusal_problem, refusal_problem


def read_checkpoint_step(compose: Compose) -> int:
    """The ``global_step`` of the run's latest checkpoint, read in a one-off learner container."""
    code = (
        "from pathlib import Path; from oakemu_core.run.checkpoint import latest_checkpoint, load_checkpoint; "
        "p = latest_checkpoint(Path('/data/runs/main')); print(load_checkpoint(p, map_location='cpu')['global_step'])"
    )
    result = compose(
        "run",
        "--rm",
        "--no-deps",
        "-T",
        "--entrypoint",
        "python",
        "learner",
        "-c",
        code,
        timeout=120,
    )
    return int(result.stdout.split()[-1])


def check_env_change_refused(compose: Compose) -> str:
    """Start the learner on the stopped run with another env id; '' when refused cleanly, else the problem."""
    since = str(
        int(time.time()) - 1
    )  # this start's log lines only (the container keeps earlier ones)
    compose(
        "up", "-d", "--no-build", "--no-deps", "learner", extra_env={"OAKEMU_ENV_ID": "Acrobot-v1"}
    )
    [learner] = compose.container_ids("learner", all_states=True)

    def exited() -> bool:
        state = run(
            ["docker", "inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}", learner]
        ).stdout.split()
        return state[0] == "false"

    deadline = time.monotonic() + 90
    while not exited() and time.monotonic() < deadline:
        time.sleep(2)
    logs_result = run(["docker", "logs", "--since", since, learner])
    logs = logs_result.stdout + logs_result.stderr
    running = not exited()
    compose("stop", "--timeout", "30", timeout=120)
    if running:
        return "the learner kept running on a run folder of another env id"
    if "Traceback" in logs:
        return f"the learner crashed with a traceback: ...{logs[-400:]}"
    if "CartPole-v1" not in logs or "Acrobot-v1" not in logs:
        return f"the refusal does not name both env ids: {logs[-600:]}"
    return ""


# --- several hosts: learner, actors and monitor in three compose projects ------------------------------

REMOTE_ACTORS_FILE = REPO_ROOT / "deploy" / "compose.remote-actors.yml"


@pytest.fixture
def projects(tmp_path: Path, oakemu_image: str) -> Iterator[Callable[..., Compose]]:
    """Makes compose projects (``make(name, files, **settings)``); every one is brought down at the end."""
    env_file = tmp_path / "empty.env"  # not the repository's .env, if a developer has one
    env_file.write_text("")
    made: list[Compose] = []

    def make(name: str, files: list[Path], **settings: str) -> Compose:
        environment = {**clean_environment(), **RUN_SETTINGS, **settings}
        project = Compose(f"oakemu-test-{os.getpid()}-{name}", files, environment, env_file)
        project.down()  # a project of a killed earlier run of this test
        made.append(project)
        return project

    try:
        yield make
    finally:
        for project in reversed(made):  # actors before the learner they talk to
            project.down()
    left = {
        project.project: leftovers(f"com.docker.compose.project={project.project}")
        for project in made
    }
    assert not any(left.values()), f"docker compose down -v left {left}"


def make_keys(image: str, folder: Path) -> None:
    """``oakemu keygen`` in the image (so uid 10001 owns the secret files): learner, actor, monitor,
    and a stranger whose key is not authorised; public keys of actor and monitor filed by role."""
    folder.mkdir()
    folder.chmod(0o777)
    names = ("learner", "actor", "monitor", "stranger")
    script = "; ".join(f"oakemu keygen {name} --dir /keys >/dev/null" for name in names)
    run(
        [
            "docker",
            "run",
            "--rm",
            "-v",
            f"{folder}:/keys",
            "--entrypoint",
            "sh",
            image,
            "-c",
            f"set -e; {script}",
        ]
    )
    for role, name in (("actors", "actor"), ("monitors", "monitor")):
        (folder / "authorized" / role).mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / f"{name}.key", folder / "authorized" / role / f"{name}.key")
    folder.chmod(0o755)


def inspect(container: str, template: str) -> Any:
    """``docker inspect --format TEMPLATE`` of one container, the template giving JSON (``{{json ...}}``)."""
    return json.loads(run(["docker", "inspect", "--format", template, container]).stdout)


def scrape_metrics(port: int) -> dict[str, float]:
    """The learner's Prometheus figures from the host's published port: ``name{labels}`` -> value
    ({} while nothing answers there)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:  # the learner is starting: the port is published, nothing listens behind it yet
        return {}
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_actors_and_monitor_of_other_projects_reach_a_curve_learner_only_through_its_published_ports(
    projects: Callable[..., Compose], oakemu_image: str, tmp_path: Path
) -> None:
    """Multi-host on one engine: the learner (docker-compose.yml, CURVE on) in one project, two actors
    with the authorised key and one with an unauthorised key in a second (deploy/compose.remote-actors.yml,
    its own network, learner reached as host.docker.internal through the published ports), and the
    monitor in a third. The keyed actors train, the stranger is refused and counted."""
    keys = tmp_path / "keys"
    make_keys(oakemu_image, keys)
    ports = {name: free_port() for name in ("DATA", "CONTROL", "WEIGHTS", "TELEMETRY", "METRICS")}
    override = tmp_path / "learner-keys.yml"
    override.write_text(f"services:\n  learner:\n    volumes: ['{keys}:/keys:ro']\n")
    learner = projects(
        "learner",
        [COMPOSE_FILE, override],
        OAKEMU_NUM_ENVS="8",
        OAKEMU_CURVE="true",
        OAKEMU_CURVE_SECRET_KEY="/keys/learner.key_secret",
        OAKEMU_CURVE_AUTHORIZED_KEYS="/keys/authorized",
        **{f"OAKEMU_PUBLISH_{name}_PORT": str(port) for name, port in ports.items()},
    )
    remote = {
        "OAKEMU_LEARNER_HOST": "host.docker.internal",
        "OAKEMU_KEYS_DIR": str(keys),
        "OAKEMU_DATA_PORT": str(ports["DATA"]),
        "OAKEMU_CONTROL_PORT": str(ports["CONTROL"]),
        "OAKEMU_WEIGHTS_PORT": str(ports["WEIGHTS"]),
        "OAKEMU_TELEMETRY_PORT": str(ports["TELEMETRY"]),
    }
    actors = projects("actors", [REMOTE_ACTORS_FILE], **remote)
    monitor = projects("monitor", [REMOTE_ACTORS_FILE], **remote)

    learner("up", "-d", "--no-build", "learner")
    actors("up", "-d", "--no-build", "--scale", "actor=2")
    stranger = (
        actors(
            "run",
            "-d",
            "--no-deps",
            "-e",
            "OAKEMU_CURVE_SECRET_KEY=/keys/stranger.key_secret",
            "actor",
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    [learner_container] = learner.container_ids("learner")
    keyed = actors.container_ids("actor")
    assert len(keyed) == 2
    learner_networks = inspect(learner_container, "{{json .NetworkSettings.Networks}}").keys()
    for container in (
        *keyed,
        stranger,
    ):  # no network in common: only the published ports lead to the learner
        assert learner_networks.isdisjoint(inspect(container, "{{json .NetworkSettings.Networks}}"))

    def trained_and_refused() -> dict[str, float]:
        figures = scrape_metrics(ports["METRICS"])
        seen = {
            name: figures.get(name, 0)
            for name in (
                "oakemu_actors",
                "oakemu_updates_total",
                'oakemu_rejected_messages_total{reason="unauthorized_key"}',
            )
        }
        assert list(seen.values())[0] == 2 and all(value >= 1 for value in seen.values()), seen
        return figures

    figures = wait_for(
        "2 actors, updates and a refused key in the published /metrics",
        trained_and_refused,
        timeout_s=120,
        period_s=1,
    )

    snapshot = snapshot_from(
        monitor(
            "run",
            "--rm",
            "-T",
            "monitor",
            "monitor",
            "--once",
            "--json",
            "--timeout",
            "10",
            timeout=90,
        ).stdout
    )
    joined = {
        actor["actor_id"]: actor for actor in snapshot["actors"]
    }  # ids: <container hostname>-<pid>
    keyed_hosts = sorted(inspect(container, "{{json .Config.Hostname}}") for container in keyed)
    assert sorted(name.rsplit("-", 1)[0] for name in joined) == keyed_hosts, (joined, keyed_hosts)
    assert all(actor["policy_lag"] is not None for actor in joined.values()), (
        joined
    )  # rows arrived from each
    assert snapshot["global_step"] >= figures["oakemu_env_steps_total"] > 0
    assert snapshot["rejected_messages"].get("unauthorized_key", 0) >= 1, snapshot[
        "rejected_messages"
    ]
    assert set(snapshot["rejected_messages"]) <= {"unauthorized_key"}, snapshot["rejected_messages"]

    learner_log = learner.logs("learner")
    for actor_id in joined:
        assert f"actor {actor_id} joined" in learner_log
    assert "unauthorized_key" in learner_log and "for the actor role" in learner_log
    assert inspect(stranger, "{{json .Config.Hostname}}") not in learner_log, (
        "the unauthorised actor got through"
    )
    assert inspect(stranger, "{{json .State.Running}}") is True, (
        "the refused actor should keep retrying, not crash"
    )


# --- swarm -----------------------------------------------------------------------------------------


class Swarm:
    """A single-node swarm this test made (``docker swarm init`` on loopback) and one stack on it."""

    def __init__(self, stack: str, env: dict[str, str]) -> None:
        self.stack = stack
        self.env = env
        self.made_gwbridge = False
        self.joined = False

    def init(self) -> None:
        """``docker swarm init`` on 127.0.0.1 (skip when this engine is in a swarm already)."""
        state = run(["docker", "info", "--format", "{{.Swarm.LocalNodeState}}"]).stdout.strip()
        if state != "inactive":
            pytest.skip(
                f"this engine's swarm state is {state!r}; the test needs to make and leave its own swarm"
            )
        had_gwbridge = (
            run(["docker", "network", "inspect", "docker_gwbridge"], check=False).returncode == 0
        )
        run(
            [
                "docker",
                "swarm",
                "init",
                "--advertise-addr",
                "127.0.0.1",
                "--listen-addr",
                "127.0.0.1:2377",
            ]
        )
        self.joined = True
        self.made_gwbridge = not had_gwbridge

    def monitor(self) -> dict[str, Any]:
        """One snapshot from a monitor container attached to the stack's overlay network."""
        result = run(
            [
                "docker",
                "run",
                "--rm",
                "--network",
                f"{self.stack}_default",
                self.env["OAKEMU_IMAGE"],
                "monitor",
                "--connect",
                "tcp://tasks.learner:5558",
                "--once",
                "--json",
                "--timeout",
                "10",
            ],
            timeout=90,
        )
        return snapshot_from(result.stdout)

    def teardown(self) -> dict[str, list[str]]:
        """Remove the stack (and what it leaves), leave the swarm; returns what could not be removed."""
        label = f"com.docker.stack.namespace={self.stack}"
        if self.joined:
            run(["docker", "stack", "rm", self.stack], check=False, timeout=120)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and leftovers(label).get("containers"):
                time.sleep(1)
        remove_labelled(label)
        if self.joined:
            run(["docker", "swarm", "leave", "--force"], check=False, timeout=120)
            self.joined = False
        if self.made_gwbridge:
            run(["docker", "network", "rm", "docker_gwbridge"], check=False)
            self.made_gwbridge = False
        left = leftovers(label)
        if (
            run(["docker", "info", "--format", "{{.Swarm.LocalNodeState}}"]).stdout.strip()
            != "inactive"
        ):
            left["swarm"] = ["still active"]
        return left


@pytest.fixture
def swarm(oakemu_image: str) -> Iterator[Swarm]:
    """A single-node swarm for one test; the stack removed and the swarm left at the end, always."""
    settings = {**RUN_SETTINGS, "OAKEMU_IMAGE": oakemu_image, "OAKEMU_ACTORS": "2"}
    for name in ("DATA", "CONTROL", "WEIGHTS", "TELEMETRY", "METRICS"):
        settings[f"OAKEMU_PUBLISH_{name}_PORT"] = str(free_port())
    test_swarm = Swarm(f"oakemu-test-{os.getpid()}", {**clean_environment(), **settings})
    try:
        yield test_swarm
    finally:
        test_swarm.teardown()


def test_swarm_stack_deploys_scales_and_is_removed(swarm: Swarm) -> None:
    """deploy/stack.yml on a single-node swarm: learner + 2 actors, scale to 3, monitor, remove, leave."""
    swarm.init()
    run(
        ["docker", "stack", "deploy", "--detach=true", "-c", str(STACK_FILE), swarm.stack],
        env=swarm.env,
    )

    first = wait_for(
        "2 actors and env steps on the swarm",
        lambda: matching(swarm.monitor(), lambda s: len(s["actors"]) == 2 and s["global_step"] > 0),
        timeout_s=240,
    )
    assert first["env_id"] == "CartPole-v1"

    # The learner's /dev/shm is the stack file's memory-backed tmpfs (Swarm ignores shm_size).
    [learner] = run(
        [
            "docker",
            "ps",
            "-q",
            "--filter",
            f"label=com.docker.swarm.service.name={swarm.stack}_learner",
        ]
    ).stdout.split()
    shm = run(
        [
            "docker",
            "exec",
            learner,
            "python",
            "-c",
            "import os; s = os.statvfs('/dev/shm'); print(s.f_blocks * s.f_frsize)",
        ]
    ).stdout.strip()
    assert int(shm) == 256 * 2**20
    mounts = json.loads(
        run(["docker", "inspect", "--format", "{{json .HostConfig.Mounts}}", learner]).stdout
    )
    assert any(m.get("Type") == "tmpfs" and m.get("Target") == "/dev/shm" for m in mounts), mounts

    run(["docker", "service", "scale", "--detach=true", f"{swarm.stack}_actor=3"])
    wait_for(
        "3 actors and rising env steps after docker service scale",
        lambda: matching(
            swarm.monitor(),
            lambda s: len(s["actors"]) == 3 and s["global_step"] > first["global_step"],
        ),
        timeout_s=180,
    )

    left = swarm.teardown()
    assert not left, f"stack rm + swarm leave left {left}"
