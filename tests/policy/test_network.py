"""Configurable networks: NetworkSpec, MLP sizes and activations, shared torsos, the IMPALA ResNet, a
recurrent core against torch's own cells, a user's encoder, and the architecture's record in resumes and
exported folders."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from oakemu_core.policy.distributions import Categorical
from oakemu_core.policy.encoders import UserEncoderError
from oakemu_core.policy.models import build_model
from oakemu_core.policy.network import NetworkSettings, NetworkSpec, parse_net_arch

VECTOR = {"": ((4,), np.float32)}
FRAMES = {"": ((4, 84, 84), np.uint8)}
USER = "tests.policy.user_encoders"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", None),
        ("none", ((), ())),
        ("64,64", ((64, 64), (64, 64))),
        ("pi=32 vf=16,16", ((32,), (16, 16))),
        ("pi=32;vf=", ((32,), ())),
        ("[256]", ((256,), (256,))),
    ],
)
def test_net_arch_forms(text: str, expected: object) -> None:
    assert parse_net_arch(text) == expected


@pytest.mark.parametrize("text", ["64,x", "pi=0", "qf=64", "64,,64", "-3"])
def test_a_malformed_net_arch_is_one_line_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match="net_arch: expected 'auto', 'none'") as caught:
        parse_net_arch(text)
    assert "\n" not in str(caught.value)


def test_the_spec_travels_as_plain_values_and_from_settings() -> None:
    spec = NetworkSpec(
        net_arch="pi=32 vf=16",
        activation="relu",
        cnn="impala",
        impala_channels=(8, 16),
        recurrent="gru",
        recurrent_hidden=24,
    )
    assert NetworkSpec.from_dict(spec.to_dict()) == spec
    settings = NetworkSettings(
        net_arch="pi=32 vf=16",
        activation="relu",
        cnn="impala",
        impala_channels="8,16",
        recurrent="gru",
        recurrent_hidden=24,
    )
    assert settings.network == spec
    assert NetworkSpec.from_config({"recurrent": "lstm", "unrelated": 1}).state_size == 2 * 256
    assert NetworkSpec(recurrent="lstm", shared_core=True).state_size == 256
    assert NetworkSpec(recurrent="gru", recurrent_hidden=8).state_size == 2 * 8
    assert NetworkSpec.from_config({}) == NetworkSpec()
    with pytest.raises(ValueError, match="unknown keys"):
        NetworkSpec.from_dict({"recurent": "lstm"})
    with pytest.raises(ValueError, match="recurrent: expected one of none, lstm, gru"):
        NetworkSpec(recurrent="rnn")


def _linear_shapes(module: nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in module.modules() if isinstance(m, nn.Linear)]


def test_net_arch_sizes_the_actor_and_critic_torsos_and_the_activation_is_used() -> None:
    model = build_model(
        VECTOR, Categorical(2), network=NetworkSpec(net_arch="pi=32 vf=16,8", activation="relu")
    )
    assert _linear_shapes(model.actor_torso) == [(4, 32)]
    assert _linear_shapes(model.critic_torso) == [(4, 16), (16, 8)]
    assert (model.actor.in_features, model.critic.in_features) == (32, 8)
    assert any(isinstance(m, nn.ReLU) for m in model.actor_torso.modules())
    assert not any(isinstance(m, nn.Tanh) for m in model.modules())
    default = build_model(VECTOR, Categorical(2))
    assert (
        _linear_shapes(default.actor_torso)
        == _linear_shapes(default.critic_torso)
        == [(4, 64), (64, 64)]
    )
    assert default.separate_mlps


def test_a_shared_torso_is_one_set_of_parameters_for_both_heads() -> None:
    model = build_model(VECTOR, Categorical(2), network=NetworkSpec(shared_torso=True))
    separate = build_model(VECTOR, Categorical(2))
    assert model.actor_torso is model.critic_torso
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in separate.parameters()) - (4 * 64 + 64 + 64 * 64 + 64)
    assert not model.separate_mlps  # the numpy actor backend's two-torso pass does not apply


def test_the_impala_resnet_has_its_stages_and_feature_size() -> None:
    model = build_model(FRAMES, Categorical(4), network=NetworkSpec(cnn="impala"))
    encoder = model.encoders["obs_"]
    convs = [m for m in encoder.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 3 * (1 + 2 * 2)  # per stage: one conv and two residual blocks of two
    assert [c.out_channels for c in convs[::5]] == [16, 32, 32]
    side = 84
    for _ in range(3):
        side = math.ceil(side / 2)  # 3x3 max-pool, stride 2, padding 1
    assert _linear_shapes(encoder) == [(32 * side * side, 256)]
    head, values = model(torch.zeros((2, 4, 84, 84), dtype=torch.uint8))
    assert head.shape == (2, 4) and values.shape == (2,)
    narrow = build_model(
        FRAMES, Categorical(4), network=NetworkSpec(cnn="impala", impala_channels=(8, 8))
    )
    assert _linear_shapes(narrow.encoders["obs_"]) == [(8 * 21 * 21, 256)]
    small = build_model(
        {"": ((3, 10, 10), np.uint8)}, Categorical(4), network=NetworkSpec(cnn="impala")
    )
    assert len([m for m in small.modules() if isinstance(m, nn.Conv2d)]) == 2  # the small CNN stays


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_recurrent_core_matches_torchs_cells_step_by_step(kind: str, shared: bool) -> None:
    torch.manual_seed(3)
    network = NetworkSpec(recurrent=kind, recurrent_hidden=8, net_arch="none", shared_core=shared)
    model = build_model(VECTOR, Categorical(2), network=network)
    cells = []
    for core in (model.core, model.critic_core if not shared else model.core):
        cell = (nn.LSTMCell if kind == "lstm" else nn.GRUCell)(4, 8)
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(cell, name).data.copy_(getattr(core.rnn, name + "_l0").data)
        cells.append(cell)
    observations = np.random.default_rng(0).normal(size=(5, 3, 4)).astype(np.float32)
    dones = np.array([[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 1], [0, 0, 0]], dtype=bool)
    state = model.initial_state(3)
    assert state.shape == (3, (2 if kind == "lstm" else 1) * 8 * (1 if shared else 2))
    hidden = [(torch.zeros(3, 8), torch.zeros(3, 8)) for _ in cells]  # (h, c) per core
    for t in range(5):
        bundle = model.act(observations[t], state=state)
        x = torch.from_numpy(observations[t])
        with torch.no_grad():
            parts = []
            for index, cell in enumerate(cells):
                h, c = hidden[index]
                h, c = cell(x, (h, c)) if kind == "lstm" else (cell(x, h), c)
                hidden[index] = (h, c)
                parts.append(torch.cat([h, c], dim=1) if kind == "lstm" else h)
            expected_state = parts[0] if shared else torch.cat(parts, dim=1)
            expected_values = model.critic(hidden[1][0]).squeeze(
                -1
            )  # the critic's core (or the one)
        np.testing.assert_allclose(bundle.next_state, expected_state.numpy(), atol=1e-6)
        np.testing.assert_allclose(bundle.values, expected_values.numpy(), atol=1e-6)
        np.testing.assert_array_equal(bundle.policy_state, state)
        state = bundle.next_state.copy()
        state[dones[t]] = 0.0
        keep = torch.from_numpy(~dones[t]).unsqueeze(1)
        hidden = [(h * keep, c * keep) for h, c in hidden]


def test_a_sequence_from_a_stored_state_equals_stepping_with_resets() -> None:
    torch.manual_seed(4)
    model = build_model(
        VECTOR, Categorical(2), network=NetworkSpec(recurrent="lstm", recurrent_hidden=16)
    )
    rng = np.random.default_rng(1)
    observations = rng.normal(size=(7, 4, 4)).astype(np.float32)
    dones = rng.random((7, 4)) < 0.3
    start = rng.normal(size=(4, model.state_size)).astype(
        np.float32
    )  # a segment may start mid-episode
    state, values = start, []
    for t in range(7):
        bundle = model.act(observations[t], state=state)
        values.append(bundle.values)
        state = bundle.next_state.copy()
        state[dones[t]] = 0.0
    resets = np.zeros((7, 4), dtype=bool)
    resets[1:] = dones[:-1]
    with torch.no_grad():
        _, sequence_values, final = model(
            torch.from_numpy(observations.reshape(28, 4)),
            torch.from_numpy(start),
            torch.from_numpy(resets),
        )
    np.testing.assert_allclose(sequence_values.numpy().reshape(7, 4), np.stack(values), atol=1e-5)
    last = final.numpy().copy()
    last[dones[-1]] = 0.0
    np.testing.assert_allclose(last, state, atol=1e-5)


def test_a_recurrent_policy_needs_its_state_and_a_feed_forward_one_refuses_it() -> None:
    recurrent = build_model(
        VECTOR, Categorical(2), network=NetworkSpec(recurrent="gru", recurrent_hidden=8)
    )
    observations = np.zeros((2, 4), np.float32)
    with pytest.raises(
        ValueError, match=r"this policy is recurrent; pass state=, \(2, 16\) float32"
    ):
        recurrent.act(observations)
    with pytest.raises(ValueError, match=r"expected shape \(2, 16\) float32"):
        recurrent.act(observations, state=np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="feed-forward"):
        build_model(VECTOR, Categorical(2)).act(observations, state=np.zeros((2, 8), np.float32))


def test_a_users_encoder_feeds_the_heads() -> None:
    model = build_model(
        VECTOR, Categorical(3), network=NetworkSpec(policy_module=f"{USER}:TwoLayerEncoder")
    )
    assert (
        model.encoder_features == 32 and model.actor.in_features == 32
    )  # net_arch auto: none after it
    bundle = model.act(np.ones((5, 4), np.float32))
    assert bundle.actions.shape == (5,)
    with_core = build_model(
        VECTOR,
        Categorical(3),
        network=NetworkSpec(
            policy_module=f"{USER}:TwoLayerEncoder", recurrent="lstm", recurrent_hidden=8
        ),
    )
    assert with_core.core.rnn.input_size == 32


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("Missing", "cannot import it"),
        ("NoWidth", "expected an nn.Module with an int attribute out_features"),
        ("WrongWidth", r"expected features of shape \(2, 16\) on a probe batch"),
        ("FailsInForward", r"its forward failed on a probe batch \(RuntimeError: boom\)"),
    ],
)
def test_a_users_encoder_that_does_not_fit_is_one_line(name: str, message: str) -> None:
    with pytest.raises(UserEncoderError, match=message) as caught:
        build_model(VECTOR, Categorical(2), network=NetworkSpec(policy_module=f"{USER}:{name}"))
    assert "\n" not in str(caught.value) and f"{USER}:{name}" in str(caught.value)


def test_train_refuses_a_users_encoder_that_does_not_fit_before_starting() -> None:
    from oakemu_services.train import check_can_start

    from oakemu_core.config import OakEmuConfig
    from oakemu_core.errors import ConfigError

    config = OakEmuConfig(env_id="CartPole-v1", policy_module=f"{USER}:WrongWidth")
    with pytest.raises(ConfigError, match="policy_module"):
        check_can_start(config)
    check_can_start(config.model_copy(update={"policy_module": f"{USER}:TwoLayerEncoder"}))


def test_a_resume_with_another_network_is_refused_in_one_line() -> None:
    from oakemu_core.run.run_folder import ResumeMismatchError, check_resume_compatible

    state = {"config": {"recurrent": "none", "net_arch": "auto"}}
    check_resume_compatible(state, env_id="CartPole-v1", schema={}, network=NetworkSpec())
    with pytest.raises(
        ResumeMismatchError, match=r"network \[default\] vs requested \[recurrent=lstm\]"
    ):
        check_resume_compatible(
            state, env_id="CartPole-v1", schema={}, network=NetworkSpec(recurrent="lstm")
        )


def test_an_exported_folder_rebuilds_its_network(tmp_path: Path) -> None:
    from oakemu_core.envs import env_spec
    from oakemu_core.policy.export import load_policy_folder, write_policy_folder
    from oakemu_core.policy.schemas import schema_for_env

    spec = env_spec("CartPole-v1")
    network = NetworkSpec(net_arch="pi=32 vf=16,16", activation="elu")
    schema = schema_for_env(spec, network)
    torch.manual_seed(5)
    model = build_model(spec.observation_layout, schema.distribution, network=network)
    write_policy_folder(
        tmp_path / "policy",
        model.state_dict(),
        env_id="CartPole-v1",
        observation_layout=spec.observation_layout,
        schema=schema.to_dict(),
        config={"net_arch": "pi=32 vf=16,16", "activation": "elu"},
        trained={"policy_version": 1, "global_step": 10},
    )
    loaded = load_policy_folder(tmp_path / "policy")
    assert loaded.network == network
    observations = np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32)
    np.testing.assert_array_equal(
        loaded.act(observations, greedy=True).values,
        model.eval().act(observations, greedy=True).values,
    )


@torch.no_grad()
def test_without_orthogonal_init_every_layer_has_pytorchs_default_initialisation() -> None:
    torch.manual_seed(6)
    network = NetworkSpec(recurrent="lstm", recurrent_hidden=8, ortho_init=False)
    model = build_model(VECTOR, Categorical(2), network=network)
    default = build_model(
        VECTOR, Categorical(2), network=NetworkSpec(recurrent="lstm", recurrent_hidden=8)
    )
    # CleanRL's policy head: orthogonal with gain 0.01; PyTorch's: uniform within 1 / sqrt(fan_in)
    head, reference = float(model.actor.weight.abs().max()), float(default.actor.weight.abs().max())
    assert reference < 0.02 < head <= 1 / math.sqrt(64)
    assert float(model.actor.bias.abs().max()) > 0.0 == float(default.actor.bias.abs().max())
    assert float(model.core.rnn.weight_hh_l0.abs().max()) <= 1 / math.sqrt(8)
    assert float(model.core.rnn.bias_ih_l0.abs().max()) > 0.0  # CleanRL's biases are zeros
