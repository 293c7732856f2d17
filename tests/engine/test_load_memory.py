"""Loading never makes a full-precision copy: a child process loads the language model and the
vision tower of a 1.2 GB bf16 checkpoint (Qwen2.5-VL-3B's widths, three decoder layers and one
vision block) stored as bf16 and as int8, while this process samples its anonymous memory
(`RssAnon`: not the file-backed pages of the mapped checkpoint). The peak above the child's
baseline (everything imported, a tiny model loaded so the native kernel is built and libraries
are warm) stays below 1.15x the bytes of the weights it ends up holding; one float32 copy of
the model would be 2x (int8: 4x). The engine around the weights (a tokenizer of ~90 MB, the
K/V pool) is not weights: `bench/precision.py` reports the whole process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from stillcut.engine.anon_memory import PeakWatcher, rss_anon
from stillcut.engine.factory import build_checkpoint

MAX_RATIO = 1.15
# 151,936 x 2,048 tied embedding, three 77M-parameter layers, one vision block and the merger
SHAPE = {
    "text": {"num_hidden_layers": 3},
    "vision": {"depth": 1, "fullatt_block_indexes": [0]},
}
CHILD = """
import json, sys
from stillcut.engine.anon_memory import rss_anon
from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.quantization import WeightFormat, stored_bytes
from stillcut.vision.towers import load_vision_tower

def load(path, weight_format):
    model_class = load_model_config(path).family.language_model_class()
    return model_class.from_checkpoint(path, weight_format), load_vision_tower(path, weight_format)

path, tiny, quantization = sys.argv[1], sys.argv[2], sys.argv[3] or None
weight_format = WeightFormat(quantization=quantization)
warm = load(tiny, weight_format)
print(rss_anon(), flush=True)
model, tower = load(path, weight_format)
print(stored_bytes(model) + stored_bytes(tower), flush=True)
"""


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    """Written tensor by tensor in bf16 (never built in float32); removed afterwards."""
    folder = tmp_path_factory.mktemp("large") / "checkpoint"
    build_checkpoint(folder, "3b", **SHAPE)
    yield folder
    shutil.rmtree(folder)


@pytest.mark.skipif(rss_anon() is None, reason="RssAnon is read from Linux's /proc")
@pytest.mark.parametrize("quantization", ["", "int8"], ids=["bf16", "int8"])
def test_peak_anonymous_memory_stays_near_the_stored_weights(
    large_checkpoint, quantization, tiny_checkpoint
):
    arguments = [str(large_checkpoint), str(tiny_checkpoint), quantization]
    child = subprocess.Popen([sys.executable, "-c", CHILD, *arguments], stdout=subprocess.PIPE)
    with PeakWatcher(child.pid) as watcher:
        baseline = int(child.stdout.readline())
        watcher.peak = 0  # from here on
        weight_bytes = int(child.stdout.readline())
        assert child.wait(timeout=600) == 0
    assert weight_bytes > (1 << 30 if not quantization else 1 << 29)  # the model loaded
    ratio = (watcher.peak - baseline) / weight_bytes
    assert ratio < MAX_RATIO, f"peak {watcher.peak - baseline} B above baseline, {weight_bytes} B"
