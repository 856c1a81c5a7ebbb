"""Tests for oakemu_core.run.metrics: episode window statistics, JSON-lines and TensorBoard output."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from oakemu_core.run.metrics import EpisodeWindow, MetricsLogger, episode_scalars, update_scalars

CLEANRL_NAMES = [
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/learning_rate",
    "charts/SPS",
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/approx_kl",
    "losses/clipfrac",
    "losses/explained_variance",
]


def test_episode_window_keeps_the_last_maxlen_episodes() -> None:
    window = EpisodeWindow(maxlen=3)
    assert window.count == 0 and math.isnan(window.mean) and episode_scalars(window) == {}
    window.add(np.array([1.0, 2.0], np.float32), np.array([10, 20]))
    window.add(3.0, 30)
    window.add([4.0], [40])
    assert window.count == 3 and window.total_episodes == 4
    assert window.returns() == [2.0, 3.0, 4.0]
    assert (window.mean, window.min, window.max) == (3.0, 2.0, 4.0)
    assert window.mean_length == 30.0
    assert window.std == pytest.approx(np.sqrt(2 / 3))
    assert episode_scalars(window) == {
        "charts/episodic_return": 3.0,
        "charts/episodic_length": 30.0,
    }
    with pytest.raises(ValueError, match="returns/lengths"):
        window.add([1.0, 2.0], [1])
    with pytest.raises(ValueError, match="maxlen"):
        EpisodeWindow(0)


def _stats(**overrides) -> SimpleNamespace:
    fields = dict(
        policy_loss=-0.01,
        value_loss=0.5,
        entropy=1.3,
        approx_kl=0.002,
        clip_fraction=0.1,
        explained_variance=0.25,
        learning_rate=2.5e-4,
        first_minibatch_ratio_max_abs_dev=1e-7,
        epochs_completed=4,
        update_seconds=0.2,
        nonfinite_minibatches=1,
        importance_weight_mean=0.9,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_update_scalars_maps_stats_to_cleanrl_names() -> None:
    scalars = update_scalars(_stats())
    assert scalars["losses/clipfrac"] == 0.1
    assert scalars["charts/learning_rate"] == 2.5e-4
    assert scalars["losses/explained_variance"] == 0.25
    assert scalars["losses/policy_loss"] == -0.01
    assert scalars["diagnostics/first_minibatch_ratio_max_abs_dev"] == 1e-7
    assert scalars["diagnostics/nonfinite_minibatches"] == 1.0
    assert scalars["diagnostics/importance_weight_mean"] == 0.9
    assert {n for n in CLEANRL_NAMES if n.startswith("losses/")} <= set(scalars)


def test_logger_writes_jsonl_and_tensorboard_events(tmp_path: Path) -> None:
    window = EpisodeWindow()
    window.add([5.0, 7.0], [100, 120])
    with MetricsLogger(tmp_path) as logger:
        scalars = {
            **update_scalars(_stats(explained_variance=float("nan"))),
            **episode_scalars(window),
            "charts/SPS": 1234.0,
        }
        logger.log(1024, scalars)
        logger.log(2048, {"charts/SPS": np.float32(900.0)})
        with pytest.raises(TypeError, match="charts/bad"):
            logger.log(3000, {"charts/bad": "fast"})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)  # strict JSON: NaN became null
    assert first["global_step"] == 1024 and second["global_step"] == 2048
    assert set(CLEANRL_NAMES) <= set(first)
    assert first["charts/episodic_return"] == 6.0
    assert first["losses/explained_variance"] is None
    assert second["charts/SPS"] == 900.0

    events = list(tmp_path.glob("events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert set(CLEANRL_NAMES) <= tags
    sps = [(e.step, e.value) for e in accumulator.Scalars("charts/SPS")]
    assert sps == [(1024, 1234.0), (2048, 900.0)]
    # One event per log() call, holding all of its scalars (cheaper than an event per scalar).
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    scalar_events = [
        event for event in EventFileLoader(str(events[0])).Load() if event.HasField("summary")
    ]
    assert [(event.step, len(event.summary.value)) for event in scalar_events] == [
        (1024, len(scalars)),
        (2048, 1),
    ]


def test_logger_appends_on_resume_and_refuses_after_close(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"charts/SPS": 1.0})
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="close"):
        logger.log(2, {"charts/SPS": 2.0})
    with MetricsLogger(tmp_path) as resumed:
        resumed.log(2, {"charts/SPS": 2.0})
    steps = [
        json.loads(line)["global_step"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2]


def test_step_rate_meter_over_its_window() -> None:
    from oakemu_core.run.metrics import StepRateMeter

    meter = StepRateMeter(window=3)
    assert meter.rate == 0.0
    meter.sample(10.0, 0)
    assert meter.rate == 0.0  # one sample spans no time
    meter.sample(12.0, 100)
    assert meter.rate == 50.0
    meter.sample(14.0, 500)
    meter.sample(15.0, 600)  # the window drops (10, 0): (600 - 100) / (15 - 12)
    assert meter.rate == pytest.approx(500 / 3)
