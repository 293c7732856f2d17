"""Narrating a file streams it: frames are decoded as the narration takes them, so a long file
costs no more memory than a short one, and the segments are those of narrating the whole file
decoded up front (what narration did before it streamed).

Memory is measured as the loading test measures it: `stillcut narrate` runs in a child process
while this one samples the child's anonymous memory (`RssAnon`), on a short and a long clip of
the same frames; frames held whole would add 1.4 MB per second of the long clip. The duration
cap narration had (600 s) is gone: a longer file is narrated."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from stillcut.engine.anon_memory import PeakWatcher, rss_anon
from stillcut.service.api import VideoLLM
from stillcut.service.narrate_api import file_frames
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.synthetic import moving_texture, write_video

from .conftest import ENGINE_CONFIG, make_llm

SHORT_S, LONG_S = 10, 100
FPS = 2
WIDTH, HEIGHT = 640, 360  # 0.69 MB a frame as RGB
MAX_GROWTH_BYTES = 40 * 2**20  # the long clip's frames held whole: 125 MB more


def _moving_square(num_frames: int) -> list[np.ndarray]:
    """A still ground of gradients with a square crossing it (EVS keeps the square's tokens)."""
    rows, columns = np.mgrid[:HEIGHT, :WIDTH]
    ground = np.stack([rows * 255 // HEIGHT, columns * 255 // WIDTH, (rows + columns) % 256], -1)
    ground = ground.astype(np.uint8)
    frames = []
    for k in range(num_frames):
        pixels = ground.copy()
        x = 24 * k % (WIDTH - 48)
        pixels[100:148, x : x + 48] = 255
        frames.append(pixels)
    return frames


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("narrate-file")
    paths = {}
    for name, seconds in (("short", SHORT_S), ("long", LONG_S)):
        paths[name] = folder / f"{name}.mp4"
        frames = _moving_square(seconds * FPS)
        write_video(paths[name], frames, time_base=Fraction(1, FPS))
    return paths


@pytest.mark.parametrize("fps", [2.0, 5.0], ids=["each-frame", "frames-repeated"])
def test_a_streamed_file_narrates_as_the_whole_file_decoded_up_front(
    tiny_checkpoint, tmp_path, fps
):
    path = tmp_path / "clip.mp4"
    write_video(path, moving_texture(14, 112, 84, seed=11), time_base=Fraction(1, 4))
    # what narration decoded before it streamed: the whole file, at most 600 s
    whole = decode_video(path, DecodeConfig(fps=fps, max_frames=int(600 * fps), max_duration_s=600))
    streamed = list(file_frames(path, fps))
    assert [t for t, _ in streamed] == whole.timestamps
    assert all(np.array_equal(a, b) for (_, a), b in zip(streamed, whole.frames, strict=True))
    llm = make_llm(tiny_checkpoint)
    # sampled tokens (seeded): the texts tell the two apart if anything differs
    options = {"fps": fps, "max_tokens_per_segment": 4, "temperature": 1.0, "seed": 3}
    options["threshold"] = 0.05
    ours = list(llm.narrate(path, "Say what you see.", **options))
    reference = zip(whole.timestamps, whole.frames, strict=True)
    theirs = list(llm.narrate(iter(reference), "Say what you see.", **options))
    assert len(ours) == len(whole.timestamps) // 2 and any(s.text for s in ours)
    assert [(s.t, s.text, s.kept_tokens, s.prefill_tokens) for s in ours] == [
        (s.t, s.text, s.kept_tokens, s.prefill_tokens) for s in theirs
    ]


def _narrate_peak(checkpoint, path) -> tuple[int, int]:
    """(segments printed, peak anonymous bytes) of `stillcut narrate` on `path`."""
    argv = [sys.executable, "-m", "stillcut.service.cli", "narrate", str(path)]
    argv += ["--model", str(checkpoint), "--max-tokens-per-segment", "1"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakWatcher(child.pid) as watcher:
        out, err = child.communicate(timeout=600)
    assert child.returncode == 0, err
    return len(out.splitlines()), watcher.peak


@pytest.mark.skipif(rss_anon() is None, reason="RssAnon is read from Linux's /proc")
def test_narrating_a_long_file_takes_no_more_memory_than_a_short_one(tiny_checkpoint, clips):
    short_segments, short_peak = _narrate_peak(tiny_checkpoint, clips["short"])
    long_segments, long_peak = _narrate_peak(tiny_checkpoint, clips["long"])
    assert (short_segments, long_segments) == (SHORT_S * FPS // 2, LONG_S * FPS // 2)
    growth = long_peak - short_peak
    assert growth < MAX_GROWTH_BYTES, f"{growth / 2**20:.0f} MB more for a {LONG_S} s clip"


def test_a_file_longer_than_ten_minutes_is_narrated(tiny_checkpoint, tmp_path):
    """Past the 600 s narration had as a cap, and past the engine's visual-token limit (512
    here; 31 tubelets of up to 20 tokens): the narration rolls over instead of failing."""
    path = tmp_path / "long.mp4"  # 62 frames, one every 10 s: 620 s
    write_video(path, moving_texture(62, 112, 84, seed=12), time_base=Fraction(10))
    llm = VideoLLM(tiny_checkpoint, engine_config=ENGINE_CONFIG)  # the default decode caps
    segments = list(llm.narrate(path, fps=0.1, max_tokens_per_segment=1))
    assert [s.t for s in segments] == [(20.0 * k, 20.0 * k + 10) for k in range(31)]
    assert any(s.rolled_over for s in segments)
