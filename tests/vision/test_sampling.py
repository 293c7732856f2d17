"""The sampling rule on its own: sample times, and which frame each time gets."""

import random

import pytest

from stillcut.vision.decode_config import DecodeConfig
from stillcut.vision.sampling import FrameSelector, plan_samples, predict_picks


def test_plan_steps_at_fps_inside_the_range():
    plan = plan_samples(start=1.0, duration=2.0, fps=2.0, max_frames=64)
    assert plan.times == (1.0, 1.5, 2.0, 2.5)  # 3.0 is the range's end: excluded
    assert plan.sample_fps == 2.0


def test_plan_rounds_a_partial_interval_up():
    assert plan_samples(0.0, 1.01, fps=2.0, max_frames=64).times == (0.0, 0.5, 1.0)


def test_plan_gives_one_sample_for_a_range_shorter_than_an_interval():
    plan = plan_samples(0.0, 0.1, fps=2.0, max_frames=64)
    assert plan.times == (0.0,) and plan.sample_fps == 2.0
    assert plan_samples(0.0, 0.0, fps=2.0, max_frames=64).times == (0.0,)


def test_plan_spreads_max_frames_over_a_long_range():
    plan = plan_samples(start=2.0, duration=10.0, fps=2.0, max_frames=4)
    assert plan.times == (2.0, 4.5, 7.0, 9.5)
    assert plan.sample_fps == pytest.approx(0.4)


def test_plan_at_exactly_max_frames_is_not_capped():
    plan = plan_samples(0.0, 32.0, fps=2.0, max_frames=64)
    assert len(plan.times) == 64 and plan.sample_fps == 2.0


def _select(frame_times, sample_times):
    """The selector's choice per sample time, frames named by their index."""
    picks = predict_picks([(t, i) for i, t in enumerate(frame_times)], sample_times)
    return [pick.item for pick in picks for _ in range(pick.num_samples)]


def _oracle(frame_times, sample_times):
    """The rule by brute force: the last frame at or before each time, else the first."""
    chosen = []
    for t in sample_times:
        at_or_before = [i for i, ft in enumerate(frame_times) if ft <= t]
        chosen.append(max(at_or_before, key=lambda i: frame_times[i]) if at_or_before else 0)
    return chosen


def test_selector_picks_last_frame_at_or_before_each_time():
    frame_times = [0.0, 0.04, 0.09, 0.3, 0.31, 0.32, 0.9, 1.0, 1.5, 1.99]
    sample_times = [k / 10 for k in range(21)]
    assert _select(frame_times, sample_times) == [
        0, 2, 2, 3, 5, 5, 5, 5, 5, 6, 7, 7, 7, 7, 7, 8, 8, 8, 8, 8, 9
    ]  # fmt: skip


def test_selector_matches_brute_force_on_random_variable_rate_streams():
    rng = random.Random(0)
    for _ in range(200):
        frame_times = sorted(rng.uniform(0, 5) for _ in range(rng.randint(1, 30)))
        sample_times = sorted(rng.uniform(-1, 6) for _ in range(rng.randint(1, 10)))
        assert _select(frame_times, sample_times) == _oracle(frame_times, sample_times)


def test_selector_gives_times_before_the_first_frame_to_the_first_frame():
    assert _select([0.5, 0.7], [0.0, 0.25, 0.6, 0.8]) == [0, 0, 0, 1]


def test_selector_emits_each_frame_once_with_a_count():
    selector = FrameSelector([0.0, 0.1, 0.2, 0.3])
    assert selector.push(0.0, "a") is None
    pick = selector.push(0.35, "b")
    assert (pick.item, pick.time, pick.num_samples) == ("a", 0.0, 4)
    assert selector.done and selector.finish() is None


def test_selector_without_frames_picks_nothing():
    assert FrameSelector([0.0, 1.0]).finish() is None


@pytest.mark.parametrize(("duration", "num_frames"), [(10.0, 4), (1.0, 5), (0.0, 3)])
def test_num_frames_takes_exactly_that_many_evenly(duration, num_frames):
    plan = plan_samples(2.0, duration, fps=2.0, max_frames=64, num_frames=num_frames)
    assert len(plan.times) == num_frames
    assert plan.times == pytest.approx([2.0 + k * duration / num_frames for k in range(num_frames)])


def test_num_frames_is_checked_and_raises_max_frames():
    assert DecodeConfig().with_sampling(None, None, 100).max_frames == 100
    with pytest.raises(ValueError, match=r"num_frames must be an integer in \[1, max_frames=8\]"):
        DecodeConfig(max_frames=8, num_frames=9)
