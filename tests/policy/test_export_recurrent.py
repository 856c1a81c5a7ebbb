"""An LSTM policy through a checkpoint, ``oakemu export`` and ``load_policy``: the exported folder rebuilds
the recurrent network, acts as the trained model does from the same states, and its model card's code
starts an episode with ``policy.reset()``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors", reason="needs the export extra: pip install 'oakemu-rl[export]'")

from oakemu_services import cli  # noqa: E402

import oakemu_core  # noqa: E402
from oakemu_core.envs import env_spec  # noqa: E402
from oakemu_core.policy.export import usage_code, write_policy_folder  # noqa: E402
from oakemu_core.policy.models import build_model  # noqa: E402
from oakemu_core.policy.network import NetworkSpec  # noqa: E402
from oakemu_core.policy.schemas import schema_for_env, schema_from_dict  # noqa: E402
from oakemu_core.run.checkpoint import save_checkpoint  # noqa: E402

CARTPOLE = "CartPole-v1"
OBSERVATIONS = np.random.default_rng(1).normal(0.0, 1.0, size=(12, 4)).astype(np.float32)
CONFIG = {"recurrent": "lstm", "recurrent_hidden": 16, "normalize_observations": False}


@pytest.fixture
def lstm_checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    spec = env_spec(CARTPOLE)
    network = NetworkSpec.from_config(CONFIG)
    schema = schema_for_env(spec, network).to_dict()
    torch.manual_seed(5)
    model = build_model(
        spec.observation_layout, schema_from_dict(schema).distribution, network=network
    )
    path = tmp_path / "checkpoint_00000003.pt"
    save_checkpoint(
        path,
        {
            "model": model.state_dict(),
            "env": {"env_id": CARTPOLE, "schema": schema},
            "config": dict(CONFIG),
            "ppo": {"policy_version": 3},
            "global_step": 768,
        },
    )
    return path, model.eval()


def sequence_actions(model, observations: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Greedy actions of one env over ``observations``, the state carried, and the final state."""
    state, actions = model.initial_state(1), []
    for observation in observations:
        bundle = model.act(observation[None], greedy=True, state=state)
        actions.append(int(bundle.actions[0]))
        state = bundle.next_state
    return actions, state


def test_an_lstm_policy_round_trips_through_export_and_load_policy(
    lstm_checkpoint: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    path, model = lstm_checkpoint
    folder = write_policy_folder(
        tmp_path / "lstm-policy",
        model.state_dict(),
        env_id=CARTPOLE,
        observation_layout=env_spec(CARTPOLE).observation_layout,
        schema=schema_for_env(env_spec(CARTPOLE), model.network).to_dict(),
        config=dict(CONFIG),
        trained={"policy_version": 3, "global_step": 768},
    )
    expected, state = sequence_actions(model, OBSERVATIONS)
    assert len(set(expected)) == 2  # both actions: the comparison can fail
    for source in (path, folder):
        policy = oakemu_core.load_policy(source)
        assert policy.recurrent and policy.model.network.recurrent == "lstm"
        assert [int(policy.act(observation)) for observation in OBSERVATIONS] == expected
        np.testing.assert_allclose(policy.state, state, atol=1e-6)
        policy.reset()
        assert int(policy.act(OBSERVATIONS[0])) == expected[0]

    card = (folder / "README.md").read_text()
    [code] = [part.split("```", 1)[0] for part in card.split("```python\n")[1:]]
    assert "policy.reset()" in code
    namespace: dict = {}
    exec(
        compile(code.replace('"lstm-policy"', json.dumps(str(folder))), "README.md", "exec"),
        namespace,
    )
    assert namespace["policy"].recurrent and namespace["policy"].state is not None
    assert "policy.reset()" not in usage_code("ff", {"": {"shape": [4], "dtype": "float32"}})


def test_oakemu_evaluate_plays_an_lstm_checkpoint(
    lstm_checkpoint: tuple[Path, torch.nn.Module], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = lstm_checkpoint
    runs = []
    for _ in range(2):
        assert cli.main(["evaluate", str(path), "--episodes", "2", "--seed", "3", "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["episodes"] == 2 and runs[0]["returns"] == runs[1]["returns"]
