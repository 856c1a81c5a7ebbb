"""Tests for the PPO update and the re-evaluation of a recurrent policy (oakemu_core.algo.ppo,
oakemu_core.algo.reevaluation) against a hand-written reference that steps the model one row at a
time, as an actor does: the state restarts from the stored one at each sequence's first row, is
zeroed after a done, and is carried otherwise (CleanRL ``ppo_atari_lstm.py``'s loss, written out)."""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
import torch
from oakemu_services import cli

from oakemu_core.algo.learner import PPOLearner, RuntimeContext, ThreadSafeModel
from oakemu_core.algo.ppo import PPOUpdater
from oakemu_core.algo.settings import PPOSettings
from oakemu_core.policy.distributions import Categorical
from oakemu_core.policy.models import ActorCritic
from oakemu_core.policy.network import NetworkSpec
from oakemu_core.step_schema import build_schema
from oakemu_core.storage.buffer_ring import FullRollout
from oakemu_core.storage.rollout_buffer import RolloutBuffer

OBS_DIM, NUM_ACTIONS, T, N = 3, 3, 7, 4


def _model(seed: int, kind: str = "lstm") -> ActorCritic:
    torch.manual_seed(seed)
    network = NetworkSpec(recurrent=kind, recurrent_hidden=8, net_arch="16")
    return ActorCritic({"": ((OBS_DIM,), np.float32)}, Categorical(NUM_ACTIONS), network=network)


def _filled_buffer(acting: ActorCritic, seed: int = 0, version: int = 0) -> RolloutBuffer:
    """A full (7, 4) rollout acted by ``acting`` as an actor steps it (the state before each row
    stored, zeroed after a done), dones about one row in four, rows (2, 0), (5, 1) and (6, 3)
    untrainable; GAE computed."""
    schema = build_schema(
        {"": ((OBS_DIM,), np.float32)}, Categorical(NUM_ACTIONS), state_size=acting.state_size
    )
    buffer = RolloutBuffer(T, N, schema=schema)
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    state = acting.initial_state(N)
    for t in range(T):
        observations = rng.normal(size=(N, OBS_DIM)).astype(np.float32)
        bundle = acting.act(observations, state=state, generator=generator)
        dones = rng.random(N) < 0.25
        buffer.add(
            observations,
            bundle.actions,
            bundle.log_probs,
            bundle.values,
            rng.normal(size=N).astype(np.float32),
            dones,
            policy_state=bundle.policy_state,
            policy_version=version,
        )
        state = bundle.next_state * ~dones[:, None]
    untrainable = np.zeros((T, N), dtype=bool)
    untrainable[[2, 5, 6], [0, 1, 3]] = True
    buffer.mark_untrainable(untrainable)
    buffer.compute_gae(np.zeros(N, np.float32), buffer.dones[-1].copy(), 0.99, 0.95)
    return buffer


def _stepped(
    model: ActorCritic, buffer: RolloutBuffer, sequence_length: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy, values)``, each ``(T, N)`` with gradients: ``model`` stepped one row of
    every column at a time, from the stored state at rows ``0, L, 2L, ...`` (L = T when None), the
    state zeroed after a done."""
    length = T if sequence_length is None else sequence_length
    stored = torch.from_numpy(buffer.field("policy_state").copy())
    observations = torch.from_numpy(buffer.observations.copy())
    actions = torch.from_numpy(buffer.actions.copy())
    dones = torch.from_numpy(buffer.dones.copy())
    log_probs, entropy, values = [], [], []
    state = stored[0]
    for t in range(T):
        if t % length == 0:
            state = stored[t]
        else:
            state = state * ~dones[t - 1, :, None]
        head, value, state = model(observations[t], state)
        log_p = torch.log_softmax(head, -1)
        log_probs.append(log_p.gather(1, actions[t, :, None]).squeeze(1))
        entropy.append(-(log_p.exp() * log_p).sum(-1))
        values.append(value)
    return torch.stack(log_probs), torch.stack(entropy), torch.stack(values)


def _sequence_ids(buffer: RolloutBuffer, sequence_length: int | None) -> np.ndarray:
    """``(T, N)``: the index of each row's sequence among those with a trainable row (-1: none),
    sequences numbered column by column, each column's in time order."""
    length = T if sequence_length is None else sequence_length
    per_column = math.ceil(T / length)
    ids = np.arange(N)[None, :] * per_column + (np.arange(T) // length)[:, None]
    kept = np.unique(ids[buffer.trainable])
    return np.where(np.isin(ids, kept), np.searchsorted(kept, ids), -1)


def _reference_update(
    reference: ActorCritic,
    buffer: RolloutBuffer,
    *,
    sequence_length: int | None,
    epochs: int,
    num_minibatches: int,
    seed: int,
    lr: float,
    clip_coef: float = 0.2,
    ent_coef: float = 0.01,
    vf_coef: float = 0.5,
    max_grad_norm: float = 0.5,
) -> list[float]:
    """Hand-written PPO epochs on ``reference`` (plain SGD): sequences shuffled with the seeded
    generator and split, each minibatch's loss over its trainable rows (advantages normalised over
    them), computed from :func:`_stepped` outputs. Returns the policy loss of each minibatch."""
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    ids = _sequence_ids(buffer, sequence_length)
    trainable = torch.from_numpy(buffer.trainable.copy())
    old_log_probs = torch.from_numpy(buffer.log_probs.copy())
    advantages_all = torch.from_numpy(buffer.advantages.copy())
    returns = torch.from_numpy(buffer.returns.copy())
    rng = np.random.default_rng(seed)
    count = int(ids.max()) + 1
    policy_losses = []
    for _ in range(epochs):
        for chunk in np.array_split(rng.permutation(count), min(num_minibatches, count)):
            rows = torch.from_numpy(np.isin(ids, chunk)) & trainable
            log_probs, entropy, values = _stepped(reference, buffer, sequence_length)
            advantages = advantages_all[rows]
            advantages = (advantages - advantages.mean()) / (advantages.std(correction=0) + 1e-8)
            ratio = (log_probs[rows] - old_log_probs[rows]).exp()
            policy_loss = torch.max(
                -advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)
            ).mean()
            value_loss = 0.5 * ((values[rows] - returns[rows]) ** 2).mean()
            loss = policy_loss - ent_coef * entropy[rows].mean() + vf_coef * value_loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
            optimizer.step()
            policy_losses.append(policy_loss.item())
    return policy_losses


def _updater(model: ActorCritic, lr: float, **overrides) -> PPOUpdater:
    settings = dict(
        ppo_epochs=1,
        num_minibatches=1,
        clip_coef=0.2,
        clip_value_range=None,
        ent_coef=0.01,
        vf_coef=0.5,
        max_grad_norm=0.5,
        seed=3,
    )
    settings.update(overrides)
    return PPOUpdater(model, torch.optim.SGD(model.parameters(), lr=lr), device="cpu", **settings)


@pytest.mark.parametrize(
    ("kind", "sequence_length", "epochs", "num_minibatches"),
    [("lstm", None, 1, 1), ("lstm", 3, 2, 3), ("gru", 3, 2, 3), ("lstm", None, 2, 2)],
)
def test_a_recurrent_update_equals_a_hand_written_update_stepping_row_by_row(
    kind: str, sequence_length: int | None, epochs: int, num_minibatches: int
) -> None:
    """The rollout is acted by other weights, so its stored states are not those the trained weights
    compute: each sequence must start from the stored state at its first row (rows 0, 3, 6 with
    L = 3, padding after row 6) and carry the state it computes after that, reset after dones; the
    loss is over the trainable rows of the minibatch's sequences only. The weights after the update
    equal the hand-written SGD steps' and so do the policy losses."""
    acting, model = _model(0, kind), _model(1, kind)
    reference = copy.deepcopy(model)
    lr = 0.05
    with _filled_buffer(acting) as buffer:
        assert buffer.dones[:-1].any() and not buffer.trainable.all()
        stats = _updater(
            model,
            lr,
            sequence_length=sequence_length,
            ppo_epochs=epochs,
            num_minibatches=num_minibatches,
        ).step(buffer, current_policy_version=0)
        policy_losses = _reference_update(
            reference,
            buffer,
            sequence_length=sequence_length,
            epochs=epochs,
            num_minibatches=num_minibatches,
            seed=3,
            lr=lr,
        )
        trainable_rows = int(buffer.trainable.sum())
    assert stats.minibatches == len(policy_losses) == epochs * num_minibatches
    assert stats.trainable_rows == trainable_rows
    assert stats.policy_loss == pytest.approx(np.mean(policy_losses), abs=1e-5)
    moved, initial = 0.0, _model(1, kind).state_dict()
    for (name, expected), got in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-5, msg=name)
        moved = max(moved, float((got.detach() - initial[name]).abs().max()))
    assert moved > 1e-3  # the update did move the weights


def test_the_reference_tells_stored_states_from_recomputed_ones() -> None:
    """The check above can fail: started from the states the trained weights compute (whole
    columns) instead of the stored ones at rows 3 and 6, the reference ends elsewhere."""
    acting, model = _model(0), _model(1)
    reference = copy.deepcopy(model)
    with _filled_buffer(acting) as buffer:
        _updater(model, 0.05, sequence_length=3).step(buffer, current_policy_version=0)
        _reference_update(
            reference, buffer, sequence_length=None, epochs=1, num_minibatches=1, seed=3, lr=0.05
        )
    gaps = [
        float((got - expected).detach().abs().max())
        for expected, got in zip(reference.parameters(), model.parameters())
    ]
    assert max(gaps) > 1e-4


@pytest.mark.parametrize("sequence_length", [None, 3])
def test_reevaluation_equals_stepping_row_by_row(sequence_length: int | None) -> None:
    """Every row (untrainable ones too) re-evaluated by the current weights over the sequences the
    update trains on gives the log-probs and values of stepping them one row at a time; with few
    rows per forward pass (one sequence each) as with many."""
    acting, model = _model(0), _model(1)
    with _filled_buffer(acting) as buffer:
        updater = _updater(model, 0.0, sequence_length=sequence_length)
        with torch.no_grad():
            log_probs, _, values = _stepped(model, buffer, sequence_length)
        for chunk_rows in (1, 256):
            evaluation = updater.evaluate_rollout(buffer, chunk_rows=chunk_rows)
            np.testing.assert_allclose(evaluation.log_probs, log_probs.numpy(), atol=1e-5)
            np.testing.assert_allclose(evaluation.values, values.numpy(), atol=1e-5)
        # Not the acting weights' figures: the evaluation did run the current ones.
        assert np.abs(evaluation.values - buffer.values).max() > 1e-3


def test_the_decoupled_update_is_centred_on_the_proximal_policy_of_the_same_sequences() -> None:
    """Rows of an older version, re-evaluated (the proximal policy) then trained on with lr 0 and a
    clip range of 1e-5: the ratio to the proximal policy is 1 on every row (nothing clipped) when
    the re-evaluation ran over the same sequences as the update, but not when it ran over whole
    columns while the update starts every 3 rows from the stored (older) states."""
    acting, model = _model(0), _model(1)
    with torch.no_grad():
        model.actor.weight.mul_(20.0)  # a sharper policy: state differences show in the log-probs
    with _filled_buffer(acting, version=4) as buffer:
        for evaluated_length, expect_centred in ((3, True), (None, False)):
            proximal = _updater(model, 0.0, sequence_length=evaluated_length).evaluate_rollout(
                buffer
            )
            stats = _updater(model, 0.0, sequence_length=3, num_minibatches=2, clip_coef=1e-5).step(
                buffer, current_policy_version=5, proximal=proximal
            )
            assert (stats.clip_fraction == 0.0) == expect_centred, stats.clip_fraction
            assert stats.importance_weight_mean < 1.0  # the behaviour policy is another one


def test_target_kl_after_epoch_and_bfloat16_work_on_sequences() -> None:
    acting, model = _model(0), _model(1)
    with _filled_buffer(acting) as buffer:
        stopped = _updater(
            copy.deepcopy(model), 0.5, ppo_epochs=4, num_minibatches=2, target_kl=1e-9
        ).step(buffer, current_policy_version=0)
        assert (stopped.epochs_completed, stopped.minibatches, stopped.early_stopped) == (
            1,
            2,
            True,
        )
        epochs: list[int] = []
        _updater(copy.deepcopy(model), 0.05, ppo_epochs=3, num_minibatches=8).step(
            buffer,
            current_policy_version=0,
            after_epoch=lambda done, kl, nonfinite, sgd: epochs.append((done, sgd)),
        )
        # 4 columns of one whole sequence each: 4 minibatches per epoch, not 8.
        assert epochs == [(1, 4), (2, 8)]
        own = copy.deepcopy(acting)
        bf16 = _updater(own, 0.05, learner_precision="bfloat16", sequence_length=3).step(
            buffer, current_policy_version=0
        )
        assert bf16.first_minibatch_ratio_max_abs_dev < 1e-2
        assert math.isfinite(bf16.policy_loss) and bf16.nonfinite_minibatches == 0


def test_the_learner_reevaluates_a_recurrent_rollout_of_an_older_version_and_refuses_bc() -> None:
    acting, model = _model(0), _model(1)
    settings = PPOSettings(ppo_epochs=1, num_minibatches=2, sequence_length=3, max_policy_lag=5)
    learner = PPOLearner(
        RuntimeContext(settings),
        ThreadSafeModel(model, version=2),
        None,
        torch.optim.Adam(model.parameters(), lr=1e-3),
        None,
    )
    with _filled_buffer(acting, version=1) as buffer:
        rollout = FullRollout(0, buffer, np.zeros(N, np.float32), buffer.dones[-1].copy())
        prepared = learner.prepare(rollout)
        assert prepared.proximal is not None
        with torch.no_grad():
            _, _, values = _stepped(model, buffer, 3)
        np.testing.assert_allclose(buffer.values, values.numpy(), atol=1e-5)  # the critic's now
        stats = learner.update(prepared)
        assert stats is not None and stats.trainable_rows == int(buffer.trainable.sum())
    with pytest.raises(ValueError, match="bc_dataset: behaviour cloning is not available"):
        PPOLearner(
            RuntimeContext(settings),
            ThreadSafeModel(_model(2)),
            None,
            torch.optim.Adam(model.parameters()),
            None,
            bc_sampler=object(),
        )


def test_train_refuses_behaviour_cloning_for_a_recurrent_policy_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    for name in [name for name in os.environ if name.startswith("OAKEMU_")]:
        monkeypatch.delenv(name)
    runs = tmp_path / "runs"
    args = ["train", "--env-id", "CartPole-v1", "--runs-dir", str(runs), "--recurrent", "lstm"]
    assert cli.main([*args, "--bc-dataset", str(tmp_path / "demonstrations")]) == 2
    err = capsys.readouterr().err
    assert "bc_dataset" in err and "recurrent" in err and "Traceback" not in err
    assert err.count("\n") == 1 and not runs.exists()
