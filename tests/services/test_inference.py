"""The inference server's parts without sockets (:class:`oakemu_services.inference.ServedModels`), and
what refuses ``actor_inference = "central"`` before anything runs: an actor without a server, a server
without an address, an inference device that is not there."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from oakemu_services.inference import ServedModels
from oakemu_services.train import check_can_start

from oakemu_core.config import ConfigError, make_config
from oakemu_core.policy.distributions import Categorical
from oakemu_core.policy.models import ActorCritic
from oakemu_core.policy.numpy_inference import NumpyForward
from oakemu_core.policy.weights import weights_to_arrays


def model(seed: int) -> ActorCritic:
    torch.manual_seed(seed)
    return ActorCritic({"": ((4,), np.dtype(np.float32))}, Categorical(2)).eval()


def test_served_models_keep_the_newest_weights_and_reuse_the_oldest_model() -> None:
    """Up to ``keep`` weights are held; one more drops the least recently used, whose model (and its
    numpy pass) is reused with the new weights (no new one built); weights already held under a key stay as they are; weights that do not fit
    are refused with nothing dropped."""
    built: list[ActorCritic] = []

    def build() -> ActorCritic:
        built.append(model(99))
        return built[-1]

    served = ServedModels(build, keep=2)
    sources = {key: model(seed) for seed, key in enumerate([(1, 0), (1, 1), (2, 0)])}
    served.add((1, 0), weights_to_arrays(sources[(1, 0)]))
    served.add((1, 1), weights_to_arrays(sources[(1, 1)]))
    assert served.get((1, 0)) is not None  # now (1, 1) is the least recently used
    served.add((2, 0), weights_to_arrays(sources[(2, 0)]))
    assert served.keys() == [(1, 0), (2, 0)] and len(built) == 2 and served.newest == (2, 0)
    probe = torch.randn((3, 4), generator=torch.Generator().manual_seed(0))

    def head(key: tuple[int, int]) -> torch.Tensor:
        got = served.get(key)
        assert got is not None
        assert isinstance(got[1], NumpyForward)  # an MLP on the CPU: the actors' numpy pass
        return got[1](probe)[0]

    for key in ((1, 0), (2, 0)):
        with torch.no_grad():
            torch.testing.assert_close(head(key), sources[key](probe)[0], rtol=1e-5, atol=1e-5)
    served.add((2, 0), weights_to_arrays(model(5)))  # a second copy of held weights: ignored
    with torch.no_grad():
        torch.testing.assert_close(head((2, 0)), sources[(2, 0)](probe)[0], rtol=1e-5, atol=1e-5)
    wrong = {name: array[..., :1] for name, array in weights_to_arrays(model(6)).items()}
    with pytest.raises(ValueError, match="expected shape"):
        served.add((3, 0), wrong)
    assert served.keys() == [(1, 0), (2, 0)] and served.newest == (2, 0)


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OAKEMU_")}


def test_a_standalone_actor_with_central_inference_is_refused_in_one_line() -> None:
    """``oakemu actor --actor-inference central`` away from ``oakemu train`` has no server: one line,
    exit 2, before it tries to join anything."""
    result = subprocess.run(
        [sys.executable, "-m", "oakemu_services.cli", "actor", "--actor-inference", "central"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_child_env(),
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "oakemu actor: error: actor_inference: 'central'" in lines[0], lines
    assert "--actor-inference auto" in lines[0] and "Traceback" not in result.stderr


def test_a_server_without_an_address_exits_with_the_setup_status() -> None:
    """The server started outside ``oakemu train`` (no ``OAKEMU_INFERENCE_ADDRESS``) says so and exits
    with the status ``oakemu train`` does not restart (3)."""
    result = subprocess.run(
        [sys.executable, "-m", "oakemu_services.inference", "--env", "CartPole-v1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_child_env(),
        check=False,
    )
    assert result.returncode == 3, result.stderr
    assert "OAKEMU_INFERENCE_ADDRESS is not set" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_an_inference_device_that_is_not_there_is_refused_before_the_run() -> None:
    config = make_config(env_id="CartPole-v1", actor_inference="central", inference_device="cuda")
    with pytest.raises(ConfigError, match="inference_device: expected an available device"):
        check_can_start(config)
    check_can_start(config.model_copy(update={"actor_inference": "auto"}))  # only for central


def test_an_inference_device_is_cpu_cuda_or_auto() -> None:
    with pytest.raises(ConfigError, match="inference_device"):
        make_config(env_id="CartPole-v1", inference_device="mps")
    assert make_config(env_id="CartPole-v1", inference_device="cuda:1").inference_device == "cuda:1"
