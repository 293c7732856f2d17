"""Live-session options: the client's start message chooses EVS, frame rate and sampling; the
server's limits stay its own; every bad value is refused naming the field."""

import pytest

from stillcut.service.live_options import LiveLimits, LiveOptions


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(fps=0), r"fps=0 must be a finite number > 0"),
        (dict(fps=True), r"fps=True must be"),
        (dict(threshold=2.5), r"threshold=2.5 must be a number in \[0, 2\]"),
        (dict(max_per_tubelet=0), r"max_per_tubelet=0 must be an integer >= 1"),
        (dict(max_per_tubelet=2, floor=3), r"floor=3 must be <= max_per_tubelet=2"),
        (dict(max_tokens=0), r"max_tokens=0 must be"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(stop=3), r"stop=3 must be a string or a list of strings"),
        (dict(limits=LiveLimits), r"limits must be a LiveLimits"),
    ],
)
def test_options_are_validated_naming_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        LiveOptions(**options)


@pytest.mark.parametrize(
    ("name", "value"), [("max_frames", 0), ("max_frame_bytes", -1), ("max_frame_pixels", 1.5)]
)
def test_limits_are_validated_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"{name}={value} must be an integer >= 1"):
        LiveLimits(**{name: value})


def test_start_message_sets_client_options_but_never_limits():
    limits = LiveLimits(max_frames=10)
    options = LiveOptions.from_message(
        {"type": "start", "threshold": 0.3, "fps": 4, "stop": "END", "seed": 1}, limits
    )
    assert (options.threshold, options.fps, options.stop, options.seed) == (0.3, 4, ("END",), 1)
    assert options.limits == limits
    assert options.evs.key() == "evs:threshold:tau=0.3:cap=none:floor=0"
    with pytest.raises(ValueError, match=r"unknown start option\(s\) \['limits', 'tau'\]"):
        LiveOptions.from_message({"type": "start", "tau": 0.3, "limits": {}}, limits)
