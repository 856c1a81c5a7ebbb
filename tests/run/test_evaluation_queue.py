"""EvaluationQueue: the tester's waiting, pacing and video choices, without its process."""

from __future__ import annotations

import numpy as np

from oakemu_core.run.evaluation_queue import EvaluationJob, EvaluationQueue

WEIGHTS = {"w": np.zeros(2, np.float32)}


def job(version: int, *, keep: bool = False) -> EvaluationJob:
    return EvaluationJob(version, 100 * version, WEIGHTS, keep)


def test_a_newer_plain_submission_replaces_the_waiting_one_but_never_a_kept_one() -> None:
    queue = EvaluationQueue(videos=False, video_every=0, max_share=1.0)
    assert queue.submit(job(1, keep=True)) is False
    assert queue.submit(job(2)) is False
    assert queue.submit(job(3)) is True  # replaces 2
    assert [j.policy_version for j in queue.pending] == [1, 3]
    assert queue.busy and queue.unfinished


def test_pacing_holds_a_plain_job_back_for_the_busy_time_over_the_share() -> None:
    queue = EvaluationQueue(videos=False, video_every=0, max_share=0.25)
    queue.submit(job(1))
    message, wait_s = queue.next_message(now=10.0)
    assert message == ("evaluate", 1, 100, WEIGHTS, None) and wait_s is None
    assert queue.next_message(now=11.0) == (None, None)  # one runs: nothing more is handed out
    assert queue.finished(now=12.0).policy_version == 1  # busy 2 s -> the next starts at 18
    queue.submit(job(2))
    message, wait_s = queue.next_message(now=13.0)
    assert message is None and wait_s == 5.0
    assert queue.next_message(now=17.9)[0] is None
    assert queue.next_message(now=18.0)[0][1] == 2


def test_a_kept_job_and_a_drain_skip_the_pacing() -> None:
    queue = EvaluationQueue(videos=False, video_every=0, max_share=0.1)
    queue.submit(job(1))
    queue.next_message(now=0.0)
    queue.finished(now=1.0)  # the next plain one would wait until 10
    queue.submit(job(2))
    assert queue.submit(job(3, keep=True)) is True  # replaces the paced plain one
    assert queue.next_message(now=1.0)[0][1] == 3
    queue.finished(now=2.0)
    queue.submit(job(4))
    queue.start_drain()
    assert queue.next_message(now=2.0)[0][1] == 4
    queue.end_drain()
    assert not queue.draining


def test_videos_every_nth_hand_off_then_final_of_a_drain_then_the_final_video() -> None:
    queue = EvaluationQueue(videos=True, video_every=2, max_share=1.0)
    records = []
    for version in (1, 2, 3):
        queue.submit(job(version))
        records.append(queue.next_message(now=float(version))[0][4])
        queue.finished(now=float(version))
    assert records == ["update", None, "update"]
    queue.submit(job(4))
    queue.start_drain()
    assert queue.next_message(now=5.0)[0][4] == "final"
    assert queue.next_message(now=5.0) == (None, None)  # the final video waits for the report
    queue.finished(now=6.0)
    assert queue.unfinished and not queue.busy
    assert queue.next_message(now=6.0) == (("final_video",), None)
    assert queue.next_message(now=6.0) == (None, None)  # asked once
    queue.final_video_made()
    assert not queue.unfinished
