"""``oakemu export``: a checkpoint's policy as a pickle-free folder (safetensors + JSON + model card +
video) that :func:`load_policy_folder` loads in a fresh process to the same actions and values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors", reason="needs the export extra: pip install 'oakemu-rl[export]'")

from oakemu_services import cli  # noqa: E402
from oakemu_services import export as export_service  # noqa: E402

from oakemu_core.envs import env_spec  # noqa: E402
from oakemu_core.policy.export import load_policy_folder, read_policy_info  # noqa: E402
from oakemu_core.policy.models import build_model  # noqa: E402
from oakemu_core.policy.schemas import schema_for_env, schema_from_dict  # noqa: E402
from oakemu_core.run.checkpoint import save_checkpoint  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
CARTPOLE = "CartPole-v1"
OBSERVATIONS = np.random.default_rng(0).normal(0.0, 1.0, size=(100, 4)).astype(np.float32)
"""100 fixed observations; CartPole's own start states are all near 0, these reach both actions."""


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A CartPole checkpoint with observation normalisation whose statistics are not the defaults."""
    spec = env_spec(CARTPOLE)
    schema = schema_for_env(spec).to_dict()
    torch.manual_seed(11)
    model = build_model(
        spec.observation_layout, schema_from_dict(schema).distribution, normalize_observations=True
    )
    model.normalizers["obs_"].update(torch.randn(64, 4) * 3 + 1)
    path = tmp_path / "checkpoint_00000042.pt"
    save_checkpoint(
        path,
        {
            "model": model.state_dict(),
            "env": {"env_id": CARTPOLE, "schema": schema},
            "config": {
                "normalize_observations": True,
                "learning_rate": 1e-3,
                "num_actors": 1,
                "envs_per_actor": 8,
                "rollout_length": 32,
            },
            "ppo": {"policy_version": 42},
            "global_step": 10752,
        },
    )
    return path


def checkpoint_outputs(path: Path) -> tuple[list[int], list[float]]:
    from oakemu_core.run.checkpoint import load_checkpoint

    state = load_checkpoint(path)
    spec = env_spec(CARTPOLE)
    model = build_model(
        spec.observation_layout,
        schema_from_dict(state["env"]["schema"]).distribution,
        normalize_observations=True,
    )
    model.load_state_dict(state["model"])
    bundle = model.eval().act(OBSERVATIONS, greedy=True)
    return bundle.actions.tolist(), bundle.values.tolist()


FRESH_PROCESS = textwrap.dedent("""
    import json, pickle, sys
    import numpy as np, torch

    def refuse(*args, **kwargs):
        raise AssertionError("an exported policy must load without pickle")

    torch.load = pickle.load = pickle.loads = refuse
    import oakemu_core

    policy = oakemu_core.load_policy(sys.argv[1])
    observations = np.array(json.loads(sys.argv[2]), dtype=np.float32)
    bundle = policy.model.act(observations, greedy=True)
    assert (policy.act(observations) == bundle.actions).all() and policy.env_id == "CartPole-v1"
    print(json.dumps({"actions": bundle.actions.tolist(), "values": bundle.values.tolist()}))
""")


@pytest.mark.slow
def test_export_then_load_in_a_fresh_process_gives_the_checkpoints_actions(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "policy"
    assert cli.main(["export", str(checkpoint), str(folder), "--episodes", "2"]) == 0
    assert str(folder) in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "obs_normalization.json",
        "replay.mp4",
        "spaces.json",
    ]
    for (
        path
    ) in folder.iterdir():  # no pickle (protocol 2+ starts with 0x80) and no torch zip archive
        head = path.read_bytes()[:4]
        assert not head.startswith(b"\x80") and head != b"PK\x03\x04", path.name

    fresh = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(folder), json.dumps(OBSERVATIONS.tolist())],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert fresh.returncode == 0, fresh.stderr
    loaded = json.loads(fresh.stdout)
    actions, values = checkpoint_outputs(checkpoint)
    assert loaded["actions"] == actions and 0 < sum(actions) < len(actions)
    np.testing.assert_allclose(loaded["values"], values, rtol=1e-6)

    info, spaces = read_policy_info(folder)
    assert (info["env_id"], info["policy_version"], info["global_step"]) == (CARTPOLE, 42, 10752)
    assert spaces["observation_layout"] == {"": {"shape": [4], "dtype": "float32"}}
    stats = json.loads((folder / "obs_normalization.json").read_text())
    model = load_policy_folder(folder)
    np.testing.assert_allclose(stats[""]["mean"], model.normalizers["obs_"].mean.numpy(), rtol=1e-6)
    card = (folder / "README.md").read_text()
    evaluation = info["evaluation"]
    assert evaluation["episodes"] == 2 and card.startswith("---\nlibrary_name: oakemu-rl\n")
    assert (
        f"value: {evaluation['mean']:.2f} +/- {evaluation['std']:.2f}" in card
        and "replay.mp4" in card
    )


def test_export_refuses_a_folder_in_use_and_a_missing_checkpoint(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    assert cli.main(["export", str(checkpoint), str(tmp_path / "used"), "--no-video"]) == 2
    assert (
        "not empty" in capsys.readouterr().err
        and (tmp_path / "used" / "keep.txt").read_text() == "mine"
    )
    assert (
        cli.main(["export", str(tmp_path / "missing.pt"), str(tmp_path / "out"), "--no-video"]) == 2
    )
    assert not (tmp_path / "out").exists()


def test_push_to_hub_creates_the_repository_and_uploads_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="needs the export extra")
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs["repo_id"], kwargs))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    assert (
        export_service.push_to_hub(tmp_path, "me/ppo-cartpole")
        == "https://huggingface.co/me/ppo-cartpole"
    )
    assert [(name, repo) for name, repo, _ in calls] == [
        ("create_repo", "me/ppo-cartpole"),
        ("upload_folder", "me/ppo-cartpole"),
    ]
    assert calls[1][2]["folder_path"] == str(tmp_path) and calls[0][2]["exist_ok"] is True


def test_the_model_card_front_matter_is_yaml_for_any_env_id() -> None:
    import yaml

    from oakemu_core.policy.export import model_card

    info = {
        "env_id": "gameboy:roms/game: deluxe.gb",
        "evaluation": {"episodes": 3, "mean": 1.5, "std": 0.5, "greedy": True, "seed": 1},
        "global_step": 10,
        "policy_version": 1,
        "config": {},
    }
    spaces = {"observation_layout": {"screen": {"shape": [4, 72, 80], "dtype": "uint8"}}}
    front = yaml.safe_load(model_card(info, spaces, has_video=False).split("---\n")[1])
    assert front["tags"][-1] == info["env_id"]
    [result] = front["model-index"][0]["results"]
    assert (
        result["dataset"]["name"] == info["env_id"]
        and result["metrics"][0]["value"] == "1.50 +/- 0.50"
    )


def write_exported(state_path: Path, folder: Path) -> Path:
    """The policy folder of a checkpoint, written without an evaluation (what ``oakemu export`` writes
    after it)."""
    from oakemu_core.policy.export import write_policy_folder
    from oakemu_core.run.checkpoint import load_checkpoint

    state = load_checkpoint(state_path)
    env_id = state["env"]["env_id"]
    return write_policy_folder(
        folder,
        state["model"],
        env_id=env_id,
        observation_layout=env_spec(env_id).observation_layout,
        schema=state["env"]["schema"],
        config=state["config"],
        trained={"policy_version": 42, "global_step": 10752},
    )


def test_evaluate_takes_an_exported_folder_and_plays_the_checkpoints_episodes(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_exported(checkpoint, tmp_path / "policy")
    results = []
    for source in (checkpoint, folder):
        assert cli.main(["evaluate", str(source), "--episodes", "3", "--seed", "5", "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    from_checkpoint, from_folder = results
    assert from_folder["checkpoint"] == str(folder) and from_folder["env_id"] == CARTPOLE
    assert from_folder["returns"] == from_checkpoint["returns"] and from_folder["episodes"] == 3


def python_block(card: str) -> str:
    """The model card's code: its one fenced ``python`` block."""
    [block] = [part.split("```", 1)[0] for part in card.split("```python\n")[1:]]
    return block


@pytest.mark.parametrize("env_id", [CARTPOLE, "tests.spaces_envs:DictTarget-v0"])
def test_the_model_cards_code_runs_and_is_the_readmes_python_api(
    tmp_path: Path, env_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import oakemu_core

    spec = env_spec(env_id)
    schema = schema_for_env(spec).to_dict()
    model = build_model(spec.observation_layout, schema_from_dict(schema).distribution)
    path = tmp_path / "checkpoint_00000001.pt"
    save_checkpoint(
        path,
        {"model": model.state_dict(), "env": {"env_id": env_id, "schema": schema}, "config": {}},
    )
    folder = write_exported(path, tmp_path / "my-policy")
    code = python_block((folder / "README.md").read_text())
    readme = (REPO_ROOT / "README.md").read_text()
    for line in ("policy = oakemu_core.load_policy(", "action = policy.act(observation)"):
        assert line in code and line in readme, line
    monkeypatch.chdir(tmp_path)  # the card names the folder as exported
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    policy = oakemu_core.load_policy(folder)
    assert namespace["policy"].env_id == env_id
    assert np.array_equal(namespace["action"], policy.act(namespace["observation"]))
    assert np.shape(namespace["action"]) == spec.action_space.shape


def hub_unreachable_environment(tmp_path: Path) -> dict[str, str]:
    """The environment of a process whose Hugging Face Hub is a closed loopback port (no network is used)."""
    import socket

    with socket.socket() as sock:  # bound and closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        key: value for key, value in os.environ.items() if not key.startswith(("HF_", "OAKEMU_"))
    }
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{port}",
        HF_TOKEN="hf_not_a_real_token",
        HF_HOME=str(tmp_path / "hf"),
        PYTHONPATH=str(REPO_ROOT),
    )
    return env


def test_push_to_an_unreachable_hub_is_one_line_exit_1_and_keeps_the_exported_folder(
    checkpoint: Path, tmp_path: Path
) -> None:
    pytest.importorskip("huggingface_hub", reason="needs the export extra")
    folder = tmp_path / "policy"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oakemu_services.cli",
            "export",
            str(checkpoint),
            str(folder),
            "--episodes",
            "1",
            "--no-video",
            "--push-to-hub",
            "me/ppo-cartpole",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=hub_unreachable_environment(tmp_path),
        timeout=180,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("oakemu export: error: could not reach the Hugging Face Hub: ")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"the exported policy stays in {folder}" in result.stderr
    assert f"exported to {folder}" in result.stdout and (folder / "model.safetensors").is_file()


def test_push_to_hub_with_a_malformed_repository_id_is_refused_before_the_export(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("huggingface_hub", reason="needs the export extra")
    assert (
        cli.main(
            [
                "export",
                str(checkpoint),
                str(tmp_path / "policy"),
                "--no-video",
                "--push-to-hub",
                "me/not a name",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("oakemu export: error: --push-to-hub: ") and err.count("\n") == 1
    assert not (tmp_path / "policy").exists()


def test_export_prints_the_evaluation_return_and_the_files_it_wrote(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "policy"
    assert cli.main(["export", str(checkpoint), str(folder), "--episodes", "2", "--no-video"]) == 0
    out = capsys.readouterr().out
    evaluation = read_policy_info(folder)[0]["evaluation"]
    assert f"{checkpoint}: exported to {folder}\n" in out
    assert (
        f"evaluation return: {evaluation['mean']:.2f} +/- {evaluation['std']:.2f} over 2 episodes "
        f"(greedy actions, env seed {evaluation['seed']})\n"
    ) in out
    assert (
        "files: README.md, config.json, model.safetensors, obs_normalization.json, spaces.json\n"
        in out
    )


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_gets_the_umasks_mode(
    checkpoint: Path, tmp_path: Path, umask: int
) -> None:
    previous = os.umask(umask)
    try:
        folder = write_exported(checkpoint, tmp_path / "policy")
    finally:
        os.umask(previous)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in folder.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_load_policy_of_a_missing_path_names_every_kind_of_path_it_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import oakemu_core
    from oakemu_core.errors import CheckpointError

    missing = tmp_path / "cartpole-policy"
    with pytest.raises(CheckpointError) as raised:
        oakemu_core.load_policy(missing)
    assert str(raised.value) == f"no such checkpoint file or exported/run folder: {missing}"
    monkeypatch.chdir(tmp_path)
    assert cli.main(["evaluate", "cartpole-policy"]) == 2
    err = capsys.readouterr().err
    assert (
        "no such checkpoint file or exported/run folder: cartpole-policy" in err
        and err.count("\n") == 1
    )


def test_the_model_cards_code_says_it_takes_the_folders_path(tmp_path: Path) -> None:
    from oakemu_core.policy.export import usage_code

    code = usage_code("cartpole-policy", {"": {"shape": [4], "dtype": "float32"}})
    [line] = [line for line in code.splitlines() if "load_policy(" in line]
    assert line.startswith(
        'policy = oakemu_core.load_policy("cartpole-policy")  # the path of this folder'
    )
