"""A long video costs no more memory than a short one: `stillcut narrate` (frames decoded as the
narration takes them) and `stillcut inspect` (decode, tower and EVS a window at a time) peak on
a long 720p clip within a margin of what they peak at on a short clip of the same frames, a
margin well under what holding the long clip's frames would add.

Memory is measured as the loading test measures it: the command runs in a child process while
this one samples the child's anonymous memory (`RssAnon`). Peaks of one command vary by tens of
MB from run to run (threads racing, the allocator's arenas), hence the margins."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from stillcut.engine.anon_memory import PeakWatcher, rss_anon
from stillcut.vision.synthetic import write_video

pytestmark = pytest.mark.skipif(rss_anon() is None, reason="RssAnon is read from Linux's /proc")

SOURCE_FPS = 8
WIDTH, HEIGHT = 1280, 720  # 2.76 MB a frame as RGB; 0.59 MB at the tiny model's 588x336
MB = 2**20


def _moving_square(num_frames: int) -> list[np.ndarray]:
    """A still ground of gradients with a square crossing it (EVS keeps the square's tokens)."""
    rows, columns = np.mgrid[:HEIGHT, :WIDTH]
    ground = np.stack([rows * 255 // HEIGHT, columns * 255 // WIDTH, (rows + columns) % 256], -1)
    ground = ground.astype(np.uint8)
    frames = []
    for k in range(num_frames):
        pixels = ground.copy()
        x = 24 * k % (WIDTH - 96)
        pixels[200:296, x : x + 96] = 255
        frames.append(pixels)
    return frames


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """`clip(seconds)`: a clip of that many seconds at `SOURCE_FPS` (made once)."""
    folder = tmp_path_factory.mktemp("long-video-memory")

    def make(seconds: int):
        path = folder / f"{seconds}s.mp4"
        if not path.exists():
            frames = _moving_square(seconds * SOURCE_FPS)
            write_video(path, frames, time_base=Fraction(1, SOURCE_FPS))
        return path

    return make


def _peaks(command: list[str], paths: list) -> tuple[list[str], list[int]]:
    """The stdout and the peak anonymous bytes of `stillcut COMMAND PATH` for each path, each
    in a child process of its own."""
    outs, peaks = [], []
    for path in paths:
        argv = [sys.executable, "-m", "stillcut.service.cli", command[0], str(path), *command[1:]]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with PeakWatcher(child.pid) as watcher:
            out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err
        outs.append(out)
        peaks.append(watcher.peak)
    return outs, peaks


def test_narrating_a_long_file_takes_no_more_memory_than_a_short_one(tiny_checkpoint, clip):
    """6 s and 36 s at 2 fps: the long clip's frames held whole would add 166 MB."""
    flags = ["--model", str(tiny_checkpoint), "--fps", "2", "--max-tokens-per-segment", "1"]
    outs, (short, long) = _peaks(["narrate", *flags], [clip(6), clip(36)])
    assert [len(out.splitlines()) for out in outs] == [6, 36]  # every 1 s tubelet spoken of
    assert long - short < 60 * MB, f"{(long - short) / MB:.0f} MB more for the long clip"


def test_inspecting_a_long_file_takes_no_more_memory_than_a_short_one(tiny_checkpoint, clip):
    """12 s and 72 s at 8 fps (3 and 18 windows of 32 frames): the long clip's frames held whole
    at the model's size would add 283 MB (and their float patches four times that); its dense
    embeddings, which the encoder cache holds, are 9 MB."""
    flags = ["--model", str(tiny_checkpoint), "--fps", "8", "--max-frames", "1000", "--no-evs"]
    outs, (short, long) = _peaks(["inspect", *flags, "--json"], [clip(12), clip(72)])
    assert [json.loads(out)["sampled"]["frames"] for out in outs] == [96, 576]
    assert long - short < 80 * MB, f"{(long - short) / MB:.0f} MB more for the long clip"
