"""Fixtures of the pipeline tests: a pipeline on the tiny checkpoint, its tower passes counted."""

import pytest

from stillcut.vision.pipeline import VisionPipeline


class TowerPasses(list):
    """The grids of each tower pass, in order; `kept` the kept masks each pass was given (None:
    every token of every input)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list = []


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    return VisionPipeline(tiny_checkpoint, cache_bytes=64 << 20)


@pytest.fixture
def counting(pipeline, monkeypatch):
    """Count tower passes, the videos each encodes and the tokens it keeps; the cache starts
    empty."""
    passes = TowerPasses()
    encode = pipeline.tower.encode

    def counted(patches_list, grids, kept=None):
        passes.append(list(grids))
        passes.kept.append(kept)
        return encode(patches_list, grids, kept)

    monkeypatch.setattr(pipeline.tower, "encode", counted)
    pipeline.cache.clear()
    return passes
