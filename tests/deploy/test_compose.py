"""Docker deployment: structure of docker-compose.yml / deploy/, and its services run as local processes.

This machine has no Docker engine. The tests read the compose file the way ``docker compose`` does
(YAML, then ``${VAR:-default}`` interpolation), check its structure, and run each service's command
with that service's environment as local processes, the service names resolved to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
GPU_OVERRIDE_FILE = REPO_ROOT / "deploy" / "compose.gpu.yml"
DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
EXAMPLE_TOML = REPO_ROOT / "deploy" / "example.toml"

# Container port -> the OAKEMU_* variable that sets it (the image defaults of OakEmuConfig).
CONTAINER_PORTS = {
    5555: "OAKEMU_DATA_PORT",
    5556: "OAKEMU_CONTROL_PORT",
    5557: "OAKEMU_WEIGHTS_PORT",
    5558: "OAKEMU_TELEMETRY_PORT",
    9100: "OAKEMU_METRICS_PORT",
}
ATARI_OBSERVATION_BYTES = 4 * 84 * 84  # 4 stacked 84x84 uint8 frames
# Per rollout-buffer row besides the observation: actions i64 (8) + log_probs, values, rewards,
# bootstrap_values, advantages, returns f32 (6 x 4) + dones, trainable bool (2) + policy_versions,
# policy_revisions i64 (16).
ROW_BYTES_BESIDES_OBSERVATION = 8 + 6 * 4 + 2 + 8 + 8


# --- reading compose files like `docker compose` does ----------------------------------------------

_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


def interpolate(text: str, variables: dict[str, str]) -> str:
    """Compose-file interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:?error}``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        value = variables.get(name)
        op, arg = match.group("op"), match.group("arg") or ""
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?") and not value:
            raise ValueError(f"compose variable {name} is required: {arg}")
        return value or ""

    return _VARIABLE.sub(replace, text)


def resolve(node: Any, variables: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, dict):
        return {key: resolve(value, variables) for key, value in node.items()}
    if isinstance(node, list):
        return [resolve(value, variables) for value in node]
    return node


def load_compose(
    path: Path = COMPOSE_FILE, variables: dict[str, str] | None = None
) -> dict[str, Any]:
    with path.open() as file:
        return resolve(yaml.safe_load(file), variables or {})


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or list form); entries without a value are unset."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    return {key: str(value) for key, value in raw.items() if value is not None}


def container_port(entry: Any) -> int:
    """Container (target) port of one ``ports`` entry, short (``"HOST:CONTAINER"``) or long form."""
    if isinstance(entry, dict):
        return int(entry["target"])
    return int(str(entry).split(":")[-1].split("/")[0])


def parse_bytes(size: str | int) -> int:
    """Compose byte value (``shm_size``): ``256m``, ``1g``, ``512mb``, plain bytes; binary units."""
    match = re.fullmatch(r"(\d+)\s*([bkmg]?)b?", str(size).strip().lower())
    assert match, f"not a byte value: {size!r}"
    return int(match.group(1)) * 1024 ** "bkmg".index(match.group(2) or "b")


def parse_duration_s(duration: str) -> float:
    total, rest = 0.0, duration
    for amount, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration):
        total += float(amount) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
        rest = rest.replace(amount + unit, "", 1)
    assert total > 0 and rest == "", f"not a duration: {duration!r}"
    return total


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            pairs.append((instruction.upper(), arguments.strip()))
    return pairs


def image_entrypoint() -> list[str]:
    entrypoints = [args for name, args in dockerfile_instructions() if name == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    return json.loads(entrypoints[0])


# --- structure ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


OAKEMU_SERVICES = {"learner", "actor", "monitor"}
OBSERVABILITY_SERVICES = {"prometheus", "grafana"}
"""Stock images under the profile "observability" (tests/deploy/test_observability.py)."""


def test_three_services_share_one_image_built_from_deploy_dockerfile(compose):
    assert set(compose["services"]) == OAKEMU_SERVICES | OBSERVABILITY_SERVICES
    services = {name: compose["services"][name] for name in OAKEMU_SERVICES}
    images = {service["image"] for service in services.values()}
    assert len(images) == 1
    for name, service in services.items():
        assert service["build"]["context"] == "."
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert service["build"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
        assert service.get("init") is True, f"{name}: PID 1 must forward signals"
        assert "container_name" not in service, f"{name}: a fixed name prevents --scale"
        assert "entrypoint" not in service, f"{name}: the image's exec-form entrypoint runs oakemu"


def test_learner_binds_ports_has_shm_volume_healthcheck_and_grace_period(compose):
    learner = compose["services"]["learner"]
    env = environment_of(learner)
    assert learner["command"] == ["learner"]
    assert {container_port(entry) for entry in learner["ports"]} == set(CONTAINER_PORTS)
    assert env["OAKEMU_BIND_HOST"] == "0.0.0.0"
    assert parse_duration_s(learner["stop_grace_period"]) >= 30  # time for the final checkpoint
    assert learner.get("restart", "no") == "no"
    # the run folders live on a named volume mounted where OAKEMU_RUNS_DIR points
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in learner["volumes"]}
    assert mounts[env["OAKEMU_RUNS_DIR"]] in compose["volumes"]
    # an optional TOML file is mounted read-only; OAKEMU_CONFIG_FILE is empty (= unset) by default
    assert any(volume.endswith(":/config:ro") for volume in learner["volumes"])
    assert env["OAKEMU_CONFIG_FILE"] == ""
    test = learner["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    assert parse_duration_s(learner["healthcheck"]["start_period"]) >= 30


def test_shm_size_holds_two_default_atari_rollout_buffers(compose):
    learner = compose["services"]["learner"]
    env = environment_of(learner)
    assert env["OAKEMU_ENV_ID"] == "ALE/Breakout-v5"
    rollout_length, num_envs = int(env["OAKEMU_ROLLOUT_LENGTH"]), int(env["OAKEMU_NUM_ENVS"])
    assert (rollout_length, num_envs) == (128, 16)
    # 2 buffers x 128 rows x 16 columns x (28224 + 50) bytes, + column_steps (8 bytes per column each)
    required = (
        2 * rollout_length * num_envs * (ATARI_OBSERVATION_BYTES + ROW_BYTES_BESIDES_OBSERVATION)
        + 2 * 8 * num_envs
    )
    assert required == 115_810_560
    assert parse_bytes(learner["shm_size"]) >= 1.5 * required  # headroom for page rounding
    assert parse_bytes(learner["shm_size"]) > 64 * 2**20  # Docker's default /dev/shm would not do


def test_shm_formula_in_the_docs_matches_the_learner():
    """The by-hand row size used above and in deploy/README.md is the learner's own figure."""
    from oakemu_core.config import load_config
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.run.learner_setup import rollout_buffer_bytes

    config = load_config(
        [
            "--env-id",
            "ALE/Breakout-v5",
            "--num-envs",
            "16",
            "--rollout-length",
            "128",
            "--mode",
            "async",
        ]
    )
    # + column_steps (8 bytes per column) + the layout record (meta, 3 x int64)
    expected_one_buffer = (
        128 * 16 * (ATARI_OBSERVATION_BYTES + ROW_BYTES_BESIDES_OBSERVATION) + 8 * 16 + 24
    )
    assert (
        rollout_buffer_bytes(config, schema_for_env(env_spec("ALE/Breakout-v5")))
        == expected_one_buffer
    )
    readme = (REPO_ROOT / "deploy" / "README.md").read_text()
    assert "115,810,608" in readme and "28224 + 50" in readme


def test_actor_finds_learner_by_name_scales_restarts_and_holds_no_state(compose):
    actor = compose["services"]["actor"]
    env = environment_of(actor)
    assert actor["command"] == ["actor"]
    assert actor["restart"] == "on-failure"
    assert "ports" not in actor and "volumes" not in actor
    assert env["OAKEMU_LEARNER_HOST"] == "learner"
    assert actor["depends_on"]["learner"]["condition"] == "service_healthy"
    assert parse_duration_s(actor["stop_grace_period"]) <= 10


def test_monitor_is_under_a_profile_and_connects_to_the_learner_telemetry_port(compose):
    monitor = compose["services"]["monitor"]
    assert monitor["profiles"] == ["monitor"]
    assert monitor["command"][:2] == ["monitor", "--connect"]
    assert monitor["command"][2] == "tcp://learner:5558"
    assert CONTAINER_PORTS[5558] == "OAKEMU_TELEMETRY_PORT"
    assert "restart" not in monitor and "ports" not in monitor and "depends_on" not in monitor


def test_configuration_is_only_oakemu_variables(compose):
    for name in OAKEMU_SERVICES:
        for key in environment_of(compose["services"][name]):
            assert key.startswith("OAKEMU_"), f"{name}: {key}"


def test_shell_variables_reach_the_services():
    compose = load_compose(
        variables={
            "OAKEMU_ENV_ID": "CartPole-v1",
            "OAKEMU_SHM_SIZE": "1g",
            "OAKEMU_LEARNER_HOST": "10.0.0.5",
            "OAKEMU_PUBLISH_TELEMETRY_PORT": "6558",
            "OAKEMU_NUM_ENVS": "64",
        }
    )
    learner, actor = compose["services"]["learner"], compose["services"]["actor"]
    assert (
        environment_of(learner)["OAKEMU_ENV_ID"]
        == environment_of(actor)["OAKEMU_ENV_ID"]
        == "CartPole-v1"
    )
    assert environment_of(learner)["OAKEMU_NUM_ENVS"] == "64"
    assert parse_bytes(learner["shm_size"]) == 2**30
    assert environment_of(actor)["OAKEMU_LEARNER_HOST"] == "10.0.0.5"  # an actor on another machine
    assert "6558:5558" in learner["ports"]


STACK_FILE = REPO_ROOT / "deploy" / "stack.yml"
REMOTE_ACTORS_FILE = REPO_ROOT / "deploy" / "compose.remote-actors.yml"
DEPLOY_README = REPO_ROOT / "deploy" / "README.md"


def learner_config(environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The configuration a learner builds from ``environment`` (its container's variables) alone."""
    from oakemu_core.config import make_config

    for key in list(os.environ):
        if key.startswith("OAKEMU_"):
            monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    return make_config()


@pytest.mark.parametrize("path", [COMPOSE_FILE, STACK_FILE], ids=["compose", "stack"])
def test_oakemu_max_actors_reaches_the_learner_with_the_learners_own_default(path, monkeypatch):
    """deploy/README.md tells users to raise ``OAKEMU_MAX_ACTORS`` (sync mode's most actors per rollout)
    with ``shm_size``: the variable reaches the learner, and unset it leaves the learner's default."""
    unset = environment_of(load_compose(path)["services"]["learner"])
    assert unset["OAKEMU_MAX_ACTORS"] == ""  # empty: the configuration model's default
    config = learner_config(unset, monkeypatch)
    assert config.max_actors is None
    assert config.resolved_max_actors == max(4, 2 * config.num_actors) == 4
    given = environment_of(load_compose(path, {"OAKEMU_MAX_ACTORS": "8"})["services"]["learner"])
    config = learner_config(given, monkeypatch)
    assert config.resolved_max_actors == 8
    assert config.allocated_num_envs == 8 * config.envs_per_actor  # the buffer grows: shm_size too


def substituted_variables(path: Path) -> set[str]:
    """The ``OAKEMU_*`` names a compose or stack file substitutes from the shell (``${OAKEMU_X...}``)."""
    return set(re.findall(r"\$\{(OAKEMU_[A-Z0-9_]+)", path.read_text()))


def test_every_variable_the_deploy_files_read_is_named_in_deploy_readme():
    readme = DEPLOY_README.read_text()
    files = (COMPOSE_FILE, GPU_OVERRIDE_FILE, REMOTE_ACTORS_FILE, STACK_FILE)
    variables = set().union(*(substituted_variables(path) for path in files))
    assert {"OAKEMU_MAX_ACTORS", "OAKEMU_CURVE_ACTOR_SECRET_KEY"} <= variables
    missing = sorted(name for name in variables if not re.search(rf"\b{name}\b", readme))
    assert missing == [], f"not in deploy/README.md: {missing}"


# The compose file's variables that Swarm has no use for: no /config mount in the stack (the learner's
# TOML file), and actors reach the learner over the overlay network on the image's ports.
COMPOSE_ONLY = {
    "learner": {"OAKEMU_CONFIG_FILE"},
    "actor": {"OAKEMU_DATA_PORT", "OAKEMU_CONTROL_PORT", "OAKEMU_WEIGHTS_PORT"},
}


@pytest.mark.parametrize("service", ["learner", "actor"])
def test_the_stack_passes_the_same_variables_as_the_compose_file(compose, service):
    stack = load_compose(STACK_FILE)
    in_compose = set(environment_of(compose["services"][service]))
    in_stack = set(environment_of(stack["services"][service]))
    assert in_compose - COMPOSE_ONLY[service] == in_stack


def test_dockerfile_base_argument_venv_build_stage_non_root_exec_entrypoint():
    instructions = dockerfile_instructions()
    names = [name for name, _ in instructions]
    # The base image is a build argument (default: the slim official image); two stages on it.
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    froms = [arguments for name, arguments in instructions if name == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    final_stage = instructions[names.index("FROM", names.index("FROM") + 1) :]
    build_stage = instructions[: names.index("FROM", names.index("FROM") + 1)]
    args = dict(arguments.split("=", 1) for name, arguments in build_stage if name == "ARG")
    assert args == {
        "BASE_IMAGE": "python:3.11-slim",
        "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu",
        "TORCH_VERSION": "2.13.0",
        "OAKEMU_EXTRAS": "onnx,emulators,video",
    }
    # Build stage: a venv, torch first (a wheelhouse wheel or TORCH_INDEX_URL), then the project.
    runs = [arguments for name, arguments in build_stage if name == "RUN"]
    torch_step = next(i for i, run in enumerate(runs) if '--index-url "$TORCH_INDEX_URL"' in run)
    assert (
        '"torch==$TORCH_VERSION"' in runs[torch_step]
        and "python3 -m venv /opt/oakemu" in runs[torch_step]
    )
    project_step = next(
        i
        for i, run in enumerate(runs)
        if '/opt/oakemu/bin/pip install --find-links /tmp/wheelhouse "/tmp/oakemu-src[$OAKEMU_EXTRAS]"'
        in run
    )
    assert torch_step < project_step
    assert all("ca-bundle.crt" in run for run in runs if "PIP_CERT" in run)
    # Final stage: only the venv is copied from the build stage (no wheelhouse, no CA bundle).
    copies = [arguments for name, arguments in final_stage if name == "COPY"]
    assert copies == ["--from=build /opt/oakemu /opt/oakemu"]
    assert not any(
        "wheelhouse" in arguments or "ca-bundle" in arguments for _, arguments in final_stage
    )
    final_names = [name for name, _ in final_stage]
    users = [arguments for name, arguments in final_stage if name == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert final_names.index("USER") > max(i for i, name in enumerate(final_names) if name == "RUN")
    assert image_entrypoint() == ["oakemu"]
    copied = " ".join(arguments for name, arguments in build_stage if name == "COPY")
    for needed in ("pyproject.toml", "README.md", "oakemu_core", "services", "deploy/wheelhouse/"):
        assert needed in copied
    # No BuildKit-only syntax: the classic builder (no buildx, no registry for a frontend) builds it.
    text = DOCKERFILE.read_text()
    assert not text.startswith("# syntax=") and "--mount=" not in text


def test_gpu_override_reserves_an_nvidia_gpu_and_builds_cuda_torch_for_the_learner():
    override = load_compose(GPU_OVERRIDE_FILE)
    assert set(override["services"]) == {"learner"}
    learner = override["services"]["learner"]
    (device,) = learner["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert environment_of(learner)["OAKEMU_DEVICE"] == "cuda"
    assert re.fullmatch(
        r"https://download\.pytorch\.org/whl/cu\d+", learner["build"]["args"]["TORCH_INDEX_URL"]
    )
    assert (
        learner["image"] != load_compose()["services"]["actor"]["image"]
    )  # actors keep the CPU image


def dockerignore_pattern(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax: ``**`` any number of folders, ``*`` / ``?`` within one path element."""
    regex = ""
    for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
        regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
            token, re.escape(token)
        )
    return re.compile(regex)


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matches a path or any parent of it."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for line in DOCKERIGNORE.read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        regex = dockerignore_pattern(pattern.lstrip("!").rstrip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


@pytest.mark.parametrize(
    "path",
    [
        "runs/CartPole__1/checkpoints/latest.pt",
        ".venv/bin/python",
        ".git/HEAD",
        "oakemu_core/__pycache__/wire.cpython-311.pyc",
        ".pytest_cache/v/x",
        "tests/deploy/test_compose.py",
        "docker-compose.yml",
    ],
)
def test_dockerignore_keeps_runs_and_caches_out(path):
    assert dockerignore_excludes(path)


@pytest.mark.parametrize(
    "path", ["pyproject.toml", "README.md", "oakemu_core/run/telemetry.py", "services/cli.py"]
)
def test_dockerignore_keeps_what_pip_install_needs(path):
    assert not dockerignore_excludes(path)


def test_example_toml_is_a_valid_configuration(monkeypatch):
    from oakemu_core.config import load_config

    for key in list(os.environ):
        if key.startswith("OAKEMU_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("OAKEMU_CONFIG_FILE", str(EXAMPLE_TOML))
    config = load_config(None)
    assert config.checkpoint_every_updates == 50 and config.clip_coef == 0.1


def compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.parametrize(
    "files", [["docker-compose.yml"], ["docker-compose.yml", "deploy/compose.gpu.yml"]]
)
def test_docker_compose_client_accepts_the_files(files):
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker compose client on this machine")
    arguments = [argument for file in files for argument in ("-f", file)]
    result = subprocess.run(
        [*cli, *arguments, "--profile", "monitor", "--profile", "observability", "config", "-q"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# --- the services as local processes -----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalDeployment:
    """Runs compose services as local processes: service names and 0.0.0.0 -> 127.0.0.1, container
    ports -> free local ports, the runs volume -> a temporary folder. Every process is killed at exit."""

    def __init__(self, compose: dict[str, Any], tmp_path: Path) -> None:
        self.compose = compose
        self.tmp_path = tmp_path
        self.ports = {container: free_port() for container in CONTAINER_PORTS}
        self.runs_dir = tmp_path / "runs"
        self.processes: list[tuple[str, subprocess.Popen[str], Path]] = []
        self.hosts = {name: "127.0.0.1" for name in compose["services"]} | {"0.0.0.0": "127.0.0.1"}

    def environment(self, service_name: str) -> dict[str, str]:
        service_env = {
            key: self.hosts.get(value, value)
            for key, value in environment_of(self.compose["services"][service_name]).items()
        }
        # one host for every service: give each its own ports, and the runs volume a local folder
        service_env.update(
            {
                variable: str(self.ports[container])
                for container, variable in CONTAINER_PORTS.items()
            }
        )
        service_env["OAKEMU_RUNS_DIR"] = str(self.runs_dir)
        env = {key: value for key, value in os.environ.items() if not key.startswith("OAKEMU_")}
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        return env | service_env

    def argv(self, service_name: str, *extra: str) -> list[str]:
        argv = [*image_entrypoint(), *self.compose["services"][service_name]["command"], *extra]
        assert argv[0] == "oakemu"
        argv = [sys.executable, "-m", "oakemu_services.cli", *argv[1:]]
        return [self._local_address(argument) for argument in argv]

    def _local_address(self, argument: str) -> str:
        match = re.fullmatch(r"tcp://([^:/]+):(\d+)", argument)
        if not match:
            return argument
        host, port = match.groups()
        return f"tcp://{self.hosts.get(host, host)}:{self.ports[int(port)]}"

    def start(
        self, service_name: str, *extra: str, stdout: int | None = None
    ) -> subprocess.Popen[str]:
        log_path = self.tmp_path / f"{service_name}-{len(self.processes)}.log"
        log = log_path.open("w")
        process = subprocess.Popen(
            self.argv(service_name, *extra),
            cwd=self.tmp_path,
            env=self.environment(service_name),
            stdout=stdout if stdout is not None else log,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        log.close()
        self.processes.append((service_name, process, log_path))
        return process

    def healthcheck(self, service_name: str) -> bool:
        test = self.compose["services"][service_name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        command = [sys.executable if test[1] == "python" else test[1], *test[2:]]
        result = subprocess.run(
            command, env=self.environment(service_name), capture_output=True, timeout=30
        )
        return result.returncode == 0

    def logs(self) -> str:
        parts = []
        for name, process, log_path in self.processes:
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            parts.append(f"--- {name} pid {process.pid} rc {process.poll()} ---\n{text[-3000:]}")
        return "\n".join(parts)

    def kill_all(self) -> None:
        for _, process, _ in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                process.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


class JsonLines:
    """Collects the JSON objects a process prints, from a reader thread."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.records: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        for line in process.stdout:
            if line.strip():
                self._queue.put(json.loads(line))
        self._queue.put(None)

    def wait_for(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout_s: float,
        what: str,
        deployment: LocalDeployment,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                record = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if record is None:
                break
            self.records.append(record)
            if predicate(record):
                return record
        seen = [(r["global_step"], r["iterations"], len(r["actors"])) for r in self.records[-10:]]
        raise AssertionError(
            f"monitor never showed {what}; last (steps, updates, actors): {seen}\n"
            f"{deployment.logs()}"
        )


def actor_ids(record: dict[str, Any]) -> set[str]:
    return {actor["actor_id"] for actor in record["actors"]}


def scrape_metrics(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
    }


@pytest.fixture
def local_deployment(tmp_path) -> Iterator[LocalDeployment]:
    # What a user would put in .env for a quick CartPole run; the file's own defaults do the rest.
    variables = {
        "OAKEMU_ENV_ID": "CartPole-v1",
        "OAKEMU_ENVS_PER_ACTOR": "2",
        "OAKEMU_NUM_ENVS": "4",
        "OAKEMU_ROLLOUT_LENGTH": "32",
        "OAKEMU_TOTAL_ENV_STEPS": "100000000",
        "OAKEMU_ACTOR_TIMEOUT_S": "3",
        "OAKEMU_RUN_NAME": "compose-local",
        "OAKEMU_DEVICE": "cpu",
        "OAKEMU_LOG_LEVEL": "INFO",
    }
    deployment = LocalDeployment(load_compose(variables=variables), tmp_path)
    try:
        yield deployment
    finally:
        deployment.kill_all()
        from oakemu_core.shared_memory import sweep_stale_segments

        sweep_stale_segments()  # segments of killed learners (owner pid gone) only


def wait_until(
    condition: Callable[[], bool],
    timeout_s: float,
    what: str,
    deployment: LocalDeployment,
    watch: subprocess.Popen[str] | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        if watch is not None and watch.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{what} did not happen within {timeout_s} s\n{deployment.logs()}")


def segments_owned_by(pid: int) -> list[str]:
    from oakemu_core.shared_memory import parse_segment_owner

    return [
        path.name
        for path in Path("/dev/shm").glob("oakemu_*")
        if parse_segment_owner(path.name) == pid
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compose_services_as_local_processes_scale_1_3_2_and_stop(local_deployment):
    deployment = local_deployment
    learner = deployment.start("learner")
    wait_until(
        lambda: deployment.healthcheck("learner"),
        120,
        "learner healthcheck",
        deployment,
        watch=learner,
    )

    monitor = deployment.start("monitor", "--json", "--timeout", "120", stdout=subprocess.PIPE)
    telemetry = JsonLines(monitor)
    actors = [deployment.start("actor")]

    # 1 actor: training advances
    one = telemetry.wait_for(
        lambda r: r["is_update"] and len(r["actors"]) == 1 and r["iterations"] >= 2,
        180,
        "updates with 1 actor",
        deployment,
    )
    assert all(len(record["actors"]) <= 1 for record in telemetry.records)
    assert one["actors"][0]["num_envs"] == 2

    # scale to 3
    actors += [deployment.start("actor"), deployment.start("actor")]
    three = telemetry.wait_for(
        lambda r: r["is_update"] and len(r["actors"]) == 3 and r["iterations"] > one["iterations"],
        180,
        "an update with 3 actors",
        deployment,
    )
    assert three["global_step"] > one["global_step"]
    assert all(actor["num_envs"] == 2 for actor in three["actors"])
    three = telemetry.wait_for(  # every actor has been heard from and contributes
        lambda r: (
            r["is_update"] and len(r["actors"]) == 3 and all(a["sps"] > 0 for a in r["actors"])
        ),
        120,
        "3 actors all stepping",
        deployment,
    )

    # one actor killed (SIGKILL): the learner drops it after actor_timeout_s and goes on with 2
    killed = actors.pop()
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=10)
    two = telemetry.wait_for(
        lambda r: r["is_update"] and len(r["actors"]) == 2,
        120,
        "an update with 2 actors after the kill",
        deployment,
    )
    assert len(actor_ids(three) - actor_ids(two)) == 1 and actor_ids(two) <= actor_ids(three)
    assert two["dropped"].get("timed_out_actors", 0) + two["dropped"].get("exited_actors", 0) >= 1
    later = telemetry.wait_for(
        lambda r: (
            r["is_update"] and len(r["actors"]) == 2 and r["iterations"] >= two["iterations"] + 2
        ),
        180,
        "two more updates with 2 actors",
        deployment,
    )
    assert later["global_step"] > two["global_step"] > three["global_step"]
    assert learner.poll() is None

    # the Prometheus endpoint serves the same figures while training runs
    metrics = scrape_metrics(deployment.ports[9100])
    for name in (
        "oakemu_env_steps",
        "oakemu_sps",
        "oakemu_policy_version",
        "oakemu_updates",
        "oakemu_episodes",
        "oakemu_episodic_return_mean",
        "oakemu_loss",
        "oakemu_approx_kl",
        "oakemu_clip_fraction",
        "oakemu_learning_rate",
        "oakemu_buffer_fill",
        "oakemu_rejected_messages",
        "oakemu_dropped",
        "oakemu_actors",
        "oakemu_policy_lag",
    ):
        assert name in metrics, name
    assert metrics["oakemu_actors"] == [({}, 2.0)]
    assert metrics["oakemu_env_steps"][0][1] >= later["global_step"]

    # `docker compose stop`: SIGTERM; actors exit at once, the learner checkpoints and exits 0
    for actor in actors:
        os.killpg(actor.pid, signal.SIGTERM)
    for actor in actors:
        actor.wait(
            timeout=parse_duration_s(deployment.compose["services"]["actor"]["stop_grace_period"])
        )
        assert actor.returncode in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    learner.send_signal(signal.SIGTERM)
    learner.wait(
        timeout=parse_duration_s(deployment.compose["services"]["learner"]["stop_grace_period"])
    )
    assert learner.returncode == 0, deployment.logs()
    assert segments_owned_by(learner.pid) == []

    from oakemu_core.run.checkpoint import latest_checkpoint

    run_dir = deployment.runs_dir / "compose-local"
    assert latest_checkpoint(run_dir) is not None, deployment.logs()

    # `docker compose up` again with the same run name: the learner resumes the run
    monitor.send_signal(signal.SIGTERM)
    monitor.wait(timeout=10)
    resumed = deployment.start("learner")
    wait_until(
        lambda: deployment.healthcheck("learner"),
        120,
        "resumed learner healthcheck",
        deployment,
        watch=resumed,
    )
    once = deployment.start(
        "monitor", "--json", "--once", "--timeout", "60", stdout=subprocess.PIPE
    )
    out, _ = once.communicate(timeout=90)
    assert once.returncode == 0, deployment.logs()
    first = json.loads(out.splitlines()[0])
    assert (
        first["iterations"] >= later["iterations"] and first["global_step"] >= later["global_step"]
    )
    assert first["actors"] == []
    resumed.send_signal(signal.SIGTERM)
    resumed.wait(timeout=60)
    assert resumed.returncode == 0, deployment.logs()
