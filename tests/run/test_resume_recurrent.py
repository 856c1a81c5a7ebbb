"""A resume that changes a recurrent policy's core is refused naming the network, not the spaces."""

from __future__ import annotations

import pytest

from oakemu_core.envs import env_spec
from oakemu_core.policy.models import build_model
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.policy.schemas import schema_for_env
from oakemu_core.run.run_folder import ResumeMismatchError, check_resume_compatible


def _checkpoint(network: NetworkSpec) -> tuple[dict, object, object]:
    spec = env_spec("CartPole-v1")
    schema = schema_for_env(spec, network)
    model = build_model(spec.observation_layout, schema.distribution, network=network)
    state = {
        "env": {"env_id": "CartPole-v1", "schema": schema.to_dict()},
        "model": model.state_dict(),
        "config": network.to_dict(),
    }
    return state, schema, model


@pytest.mark.parametrize(
    "requested",
    [
        NetworkSpec(recurrent="gru", recurrent_hidden=32),
        NetworkSpec(recurrent="lstm", recurrent_hidden=64),
        NetworkSpec(),
    ],
    ids=["gru", "hidden", "feed-forward"],
)
def test_a_resume_with_another_recurrent_core_names_the_networks(requested: NetworkSpec) -> None:
    saved = NetworkSpec(recurrent="lstm", recurrent_hidden=32)
    state, _, _ = _checkpoint(saved)
    _, schema, model = _checkpoint(requested)
    with pytest.raises(ResumeMismatchError) as caught:
        check_resume_compatible(
            state, env_id="CartPole-v1", schema=schema, model=model, network=requested
        )
    message = str(caught.value)
    assert "\n" not in message
    assert f"network [{saved.describe()}] vs requested [{requested.describe()}]" in message
    assert "spaces" not in message  # the observations and actions are the same


def test_a_resume_with_the_same_recurrent_core_is_accepted() -> None:
    network = NetworkSpec(recurrent="gru", recurrent_hidden=16)
    state, schema, model = _checkpoint(network)
    check_resume_compatible(
        state, env_id="CartPole-v1", schema=schema, model=model, network=network
    )
