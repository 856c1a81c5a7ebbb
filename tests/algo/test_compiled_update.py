"""Tests for oakemu_core.algo.compiled_update and ``compile_update``: a compiled update trains the
weights the eager update trains (CPU, inductor), signatures past the limit and a failing compile run
eagerly with one log line each, recurrent policies train eagerly, unknown modes are refused."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pydantic
import pytest
import torch

import oakemu_core.algo.compiled_update as compiled_update
from oakemu_core.algo.compiled_update import LossBatch, LossConstants, MinibatchLoss
from oakemu_core.algo.flat_parameters import FlatAdam
from oakemu_core.algo.ppo import PPOUpdater
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.policy.distributions import Categorical
from oakemu_core.policy.models import ActorCritic, build_model
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.rollout_buffer import RolloutBuffer
from tests.algo.test_ppo import OBS_DIM, N, T, _fill_schema_buffer

PARAMETER_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
"""Compiled and eager weights after 16 Adam steps: equal to float32 rounding of fused kernels that
sum in another order (measured: at most 6e-7 apart), far from the change one step makes (1e-3)."""
LOSS_TOLERANCE = {"rel": 1e-4, "abs": 1e-6}

LAYOUT = {"": ((OBS_DIM,), np.float32)}
DISTRIBUTION = Categorical(5, masked=True)


def _masked_model(seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    return build_model(LAYOUT, DISTRIBUTION)


def _updater(model: ActorCritic, mode: str, **overrides) -> PPOUpdater:
    """The production optimizer (fused FlatAdam over the trained parameters) and PPO settings with
    every loss term on (entropy, value clipping, gradient clip)."""
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    settings = dict(
        device="cpu",
        ppo_epochs=2,
        num_minibatches=4,
        clip_coef=0.2,
        clip_value_range=0.2,
        ent_coef=0.01,
        vf_coef=0.5,
        max_grad_norm=0.5,
        seed=0,
        compile_update=mode,
    )
    settings.update(overrides)
    return PPOUpdater(model, FlatAdam(trained, lr=1e-2, eps=1e-5, fused=True), **settings)


def _assert_same_update(eager_stats, compiled_stats) -> None:
    for name in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction"):
        assert getattr(compiled_stats, name) == pytest.approx(
            getattr(eager_stats, name), **LOSS_TOLERANCE
        ), name
    assert compiled_stats.minibatches == eager_stats.minibatches


@pytest.mark.slow
@pytest.mark.parametrize(
    ("device", "mode"),
    [
        pytest.param("cpu", "default", id="cpu-default"),
        pytest.param(
            "cuda",
            "reduce-overhead",
            id="cuda-reduce-overhead",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ),
    ],
)
def test_a_compiled_update_trains_the_weights_the_eager_update_trains(
    device: str, mode: str
) -> None:
    """Same seed, same rows (masked actions, three rows out of training so that minibatches hold 16
    or 15 rows), two updates of 2 epochs x 4 minibatches: a plain one, then one with the decoupled
    objective. The compiled updater (inductor on the CPU; CUDA graphs on a GPU) ends with the eager
    updater's weights and losses within float32 rounding, through 4 signatures, each run compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _masked_model()
    eager = _updater(copy.deepcopy(model), "none", device=device)
    compiled = _updater(copy.deepcopy(model), mode, device=device)
    schema = build_schema(LAYOUT, DISTRIBUTION)
    with RolloutBuffer(T, N, schema=schema, seed=0) as buffer:
        _fill_schema_buffer(buffer, model, np.random.default_rng(0), masked=True)
        trainable = buffer.trainable.copy()
        trainable[:3, 0] = False
        buffer.mark_untrainable(~trainable)
        first = [u.step(buffer, current_policy_version=0) for u in (eager, compiled)]
        _assert_same_update(*first)
        assert first[1].first_minibatch_ratio_max_abs_dev < 1e-5
        # The decoupled objective: each updater's own weights are the proximal policy.
        second = [
            u.step(buffer, current_policy_version=1, proximal=u.evaluate_rollout(buffer))
            for u in (eager, compiled)
        ]
        _assert_same_update(*second)
    for (name, expected), actual in zip(
        eager.model.named_parameters(), compiled.model.parameters()
    ):
        torch.testing.assert_close(actual, expected, **PARAMETER_TOLERANCE, msg=name)
    moved = max(
        float((after.detach().cpu() - before.detach()).abs().max())
        for before, after in zip(model.parameters(), compiled.model.parameters())
    )
    assert moved > 1e-3  # the updates did move the weights: the agreement is not trivial
    loss = compiled.minibatch_loss
    assert loss.compiled and loss.eager_signatures == 0
    assert loss.signatures == {
        (16, True, False),
        (15, True, False),
        (16, True, True),
        (15, True, True),
    }
    # One graph per signature at most (dynamo may also generalise a shape): bounded recompiles.
    assert 1 <= counters["stats"]["unique_graphs"] <= len(loss.signatures)


class _FakeCompile:
    """Stands in for ``torch.compile``: records the modes asked for and the calls of the compiled
    function, which runs the function eagerly (or raises ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.modes: list[str] = []
        self.calls = 0
        self.error = error

    def __call__(self, function, *, mode: str):
        self.modes.append(mode)

        def compiled(*args, **kwargs):
            self.calls += 1
            if self.error is not None:
                raise self.error
            return function(*args, **kwargs)

        return compiled


def _loss_inputs(rows: int) -> tuple[torch.Tensor, None, LossBatch]:
    generator = torch.Generator().manual_seed(rows)
    observations = torch.randn(rows, OBS_DIM, generator=generator)
    batch = LossBatch(
        actions=torch.randint(0, 5, (rows,), generator=generator),
        advantages=torch.randn(rows, generator=generator),
        old_log_probs=torch.full((rows,), -1.6),
        behaviour_log_probs=None,
        old_values=torch.zeros(rows),
        returns=torch.randn(rows, generator=generator),
        kl_reference={},
    )
    return observations, None, batch


CONSTANTS = LossConstants(0.2, None, 0.01, 0.5, 1.0)


def test_signatures_past_the_limit_run_eagerly_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With room for 2 signatures, minibatches of 4 and 5 rows run compiled (again when they come
    back); 6 and 7 rows run eagerly, said in one warning; every result is the eager function's."""
    fake = _FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    monkeypatch.setattr(compiled_update, "MAX_COMPILED_SIGNATURES", 2)
    model = _masked_model()
    loss = MinibatchLoss(model, CONSTANTS, mode="reduce-overhead")
    reference = MinibatchLoss(model, CONSTANTS)
    assert fake.modes == ["reduce-overhead"]
    with caplog.at_level(logging.WARNING, logger="oakemu.learner"):
        for rows, compiled_calls in ((4, 1), (5, 2), (6, 2), (7, 2), (4, 3), (6, 3)):
            inputs = _loss_inputs(rows)
            terms = loss(*inputs)
            assert fake.calls == compiled_calls, rows
            torch.testing.assert_close(terms["loss"], reference(*inputs)["loss"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "minibatches of 6 rows" in warnings[0], warnings
    assert loss.compiled and loss.eager_signatures == 3
    assert loss.signatures == {(4, False, False), (5, False, False)}


def test_a_failing_compile_is_logged_once_and_the_update_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler error at the first minibatch: one warning naming it, the eager result, and the
    compiled function is not tried again."""
    fake = _FakeCompile(RuntimeError("no C++ compiler found\nsecond line"))
    monkeypatch.setattr(torch, "compile", fake)
    model = _masked_model()
    loss = MinibatchLoss(model, CONSTANTS, mode="default")
    with caplog.at_level(logging.WARNING, logger="oakemu.learner"):
        for rows in (4, 4, 5):
            inputs = _loss_inputs(rows)
            torch.testing.assert_close(
                loss(*inputs)["loss"], MinibatchLoss(model, CONSTANTS)(*inputs)["loss"]
            )
    assert fake.calls == 1 and not loss.compiled
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "compile_update default: torch.compile failed (RuntimeError: no C++ compiler found); "
        "the update runs eagerly"
    ]


def test_a_recurrent_policy_updates_eagerly_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """compile_update on a recurrent policy: one warning, nothing compiled, the update runs."""
    fake = _FakeCompile()
    monkeypatch.setattr(torch, "compile", fake)
    torch.manual_seed(0)
    model = build_model(
        LAYOUT, DISTRIBUTION, network=NetworkSpec(recurrent="lstm", recurrent_hidden=8)
    )
    with caplog.at_level(logging.WARNING, logger="oakemu.learner"):
        updater = _updater(model, "reduce-overhead")
    assert updater.recurrent and not updater.minibatch_loss.compiled and fake.modes == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "compile_update reduce-overhead: a recurrent policy's update runs eagerly (its sequences "
        "are not compiled)"
    ]


def test_compile_update_refuses_an_unknown_mode() -> None:
    assert PPOSettings().compile_update == "none"  # off by default
    with pytest.raises(pydantic.ValidationError, match="compile_update"):
        PPOSettings(compile_update="max-autotune")
    with pytest.raises(ValueError, match="expected one of"):
        MinibatchLoss(_masked_model(), CONSTANTS, mode="fast")
