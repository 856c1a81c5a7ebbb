"""deploy/kubernetes: the kustomize manifests, validated offline against the Kubernetes schemas.

No cluster runs here. Every manifest file, and what ``kubectl kustomize`` renders from the base and
the autoscale overlay, is validated with ``kubernetes-validate`` (it bundles the API schemas: no
network) in strict mode (unknown fields are errors); then the pieces are checked to fit together
(Service <-> StatefulSet <-> actors, /dev/shm sized like ``shm_size``, probes, resources).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate (dev extra)"
)

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = REPO_ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = (
    "1.30.0"  # validate against an older API release than the newest, as clusters lag
)
LEARNER_PORTS = {"data": 5555, "control": 5556, "weights": 5557, "telemetry": 5558, "metrics": 9100}
ATARI_OBSERVATION_BYTES = 4 * 84 * 84
ROW_BYTES_BESIDES_OBSERVATION = 50  # deploy/README.md, "Sizing shm_size"


def manifest_files() -> list[Path]:
    """Every Kubernetes manifest file (not the kustomization files, not config.env)."""
    return sorted(p for p in K8S_DIR.rglob("*.yaml") if p.name != "kustomization.yaml")


def validate(document: dict[str, Any]) -> None:
    """Strict schema validation of one resource (raises kubernetes_validate.ValidationError)."""
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def render(path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize PATH`` (or ``kustomize build PATH``) as a list of resources."""
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(path)]
    elif shutil.which("kustomize"):
        command = ["kustomize", "build", str(path)]
    else:
        pytest.skip("neither kubectl nor kustomize is installed: cannot render the kustomizations")
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(documents: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for doc in documents:
        found.setdefault(doc["kind"], []).append(doc)
    return found


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity (``256Mi``, ``4Gi``, ``500M``, bytes) in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert match, f"not a memory quantity: {text!r}"
    factor = {
        None: 1,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }[match.group(2)]
    return int(match.group(1)) * factor


@pytest.fixture
def no_oakemu_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``OAKEMU_*`` variable of this process reaches the configurations built here."""
    for key in list(os.environ):
        if key.startswith("OAKEMU_"):
            monkeypatch.delenv(key)


def learner_shm_bytes(settings: dict[str, str], mode: str) -> int:
    """The learner's own figure for its rollout buffers' shared memory, in ``mode``, for the ConfigMap's
    ``settings`` (``OAKEMU_*`` names; an empty value is unset, as for the learner)."""
    from oakemu_core.config import make_config
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.schemas import schema_for_env
    from oakemu_core.run.learner_setup import num_rollout_buffers, rollout_buffer_bytes

    fields = {"env_id", "envs_per_actor", "num_envs", "max_actors", "rollout_length"}
    given = {
        key.removeprefix("OAKEMU_").lower(): value
        for key, value in settings.items()
        if value != "" and key.removeprefix("OAKEMU_").lower() in fields
    }
    config = make_config(**given, mode=mode)
    schema = schema_for_env(env_spec(config.env_id))
    return num_rollout_buffers(config) * rollout_buffer_bytes(config, schema)


def test_the_learners_shm_bytes_grow_with_max_actors_in_sync_mode(
    no_oakemu_variables: None,
) -> None:
    settings = {
        "OAKEMU_ENV_ID": "ALE/Breakout-v5",
        "OAKEMU_NUM_ENVS": "16",
        "OAKEMU_ENVS_PER_ACTOR": "8",
    }
    default = learner_shm_bytes(settings | {"OAKEMU_MAX_ACTORS": ""}, "sync")
    row = ATARI_OBSERVATION_BYTES + ROW_BYTES_BESIDES_OBSERVATION
    assert default == 128 * 32 * row + 8 * 32 + 24  # one buffer, room for 4 actors of 8 envs
    assert learner_shm_bytes(settings | {"OAKEMU_MAX_ACTORS": "8"}, "sync") > 1.9 * default


def test_every_manifest_file_is_valid_against_the_kubernetes_schemas() -> None:
    files = manifest_files()
    assert {f.name for f in files} >= {
        "learner-service.yaml",
        "learner-statefulset.yaml",
        "actor-deployment.yaml",
        "actor-hpa.yaml",
        "monitor-pod.yaml",
    }
    for path in files:
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                validate(document)


def test_the_validator_rejects_broken_manifests() -> None:
    """The check can fail: a wrong type and an unknown field are reported."""
    statefulset = yaml.safe_load((K8S_DIR / "base" / "learner-statefulset.yaml").read_text())
    wrong_type = copy.deepcopy(statefulset)
    wrong_type["spec"]["replicas"] = "one"
    unknown_field = copy.deepcopy(statefulset)
    unknown_field["spec"]["template"]["spec"]["containers"][0]["shmSize"] = "1Gi"
    for broken in (wrong_type, unknown_field):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken)


@pytest.mark.parametrize("overlay", ["", "autoscale"])
def test_rendered_kustomization_is_valid_and_fits_together(
    overlay: str, no_oakemu_variables: None
) -> None:
    documents = render(K8S_DIR / overlay if overlay else K8S_DIR)
    for document in documents:
        validate(document)
    kinds = by_kind(documents)
    [config] = kinds["ConfigMap"]
    [service] = kinds["Service"]
    [learner] = kinds["StatefulSet"]
    [actors] = kinds["Deployment"]
    settings = config["data"]

    # The learner: one replica behind a headless Service with every port, runs on a PVC.
    assert learner["spec"]["replicas"] == 1
    assert learner["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert (
        service["spec"]["selector"].items()
        <= learner["spec"]["template"]["metadata"]["labels"].items()
    )
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == LEARNER_PORTS
    pod = learner["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == LEARNER_PORTS
    assert container["readinessProbe"]["tcpSocket"]["port"] == "control"
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["runs"] == env["OAKEMU_RUNS_DIR"] == "/data/runs"
    assert [c["metadata"]["name"] for c in learner["spec"]["volumeClaimTemplates"]] == ["runs"]
    assert env["OAKEMU_BIND_HOST"] == "0.0.0.0" and env["OAKEMU_RUN_NAME"]

    # /dev/shm: memory-backed, at least 1.5 x the two rollout buffers of the configured run, and
    # inside the container's memory limit (a memory-backed emptyDir counts against it).
    [shm] = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert mounts["dshm"] == "/dev/shm" and shm["emptyDir"]["medium"] == "Memory"
    assert settings["OAKEMU_ENV_ID"].startswith("ALE/"), (
        "the sizing below assumes Atari observations"
    )
    t, n = int(settings["OAKEMU_ROLLOUT_LENGTH"]), int(settings["OAKEMU_NUM_ENVS"])
    required = 2 * t * n * (ATARI_OBSERVATION_BYTES + ROW_BYTES_BESIDES_OBSERVATION) + 16 * n + 48
    # Sync mode's one buffer has room for OAKEMU_MAX_ACTORS actors (empty: the learner's default).
    assert "OAKEMU_MAX_ACTORS" in settings
    required = max(
        required, learner_shm_bytes(settings, "sync"), learner_shm_bytes(settings, "async")
    )
    size_limit = quantity_bytes(shm["emptyDir"]["sizeLimit"])
    assert size_limit >= 1.5 * required, (size_limit, required)
    assert quantity_bytes(container["resources"]["limits"]["memory"]) > size_limit + 2**30

    # Actors: find the learner by the Service's name, read the same (generated) ConfigMap.
    actor_pod = actors["spec"]["template"]["spec"]
    for workload in (pod, actor_pod):
        for c in workload["containers"]:
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            assert [ref["configMapRef"]["name"] for ref in c["envFrom"]] == [
                config["metadata"]["name"]
            ]
    assert settings["OAKEMU_LEARNER_HOST"] == service["metadata"]["name"]
    assert settings["OAKEMU_LOG_FORMAT"] in ("plain", "json")
    assert actors["spec"]["replicas"] >= 1

    if overlay == "autoscale":
        [hpa] = kinds["HorizontalPodAutoscaler"]
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": actors["metadata"]["name"],
        }
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    else:
        assert "HorizontalPodAutoscaler" not in kinds
