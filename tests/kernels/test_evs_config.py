"""EVSConfig validation, cache keys and the kept-count formula."""

import dataclasses

import pytest
import torch

from stillcut.kernels.evs import EVSConfig, prune
from stillcut.kernels.evs.config import num_retained_tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "fast"}, r"mode='fast' is not one of \('rate', 'threshold'\)"),
        (
            {"mode": "rate", "rate": 0.5, "stage": "tower"},
            r"stage='tower' is not one of \('embeddings', 'pixels'\)",
        ),
        ({"mode": "rate"}, r"rate=None must be a number in \[0, 1\)"),
        ({"mode": "rate", "rate": 1.0}, r"rate=1.0 must be a number in \[0, 1\)"),
        ({"mode": "rate", "rate": -0.1}, r"rate=-0.1 must be a number in \[0, 1\)"),
        ({"mode": "rate", "rate": float("nan")}, r"rate=nan must be a number in \[0, 1\)"),
        ({"mode": "rate", "rate": True}, r"rate=True must be a number in \[0, 1\)"),
        ({"mode": "rate", "rate": 0.5, "threshold": 0.1}, r"threshold=0.1 is only used by"),
        ({"mode": "rate", "rate": 0.5, "max_per_tubelet": 4}, r"max_per_tubelet=4 is only"),
        ({"mode": "rate", "rate": 0.5, "floor": 1}, r"floor=1 is only used by mode='thr"),
        ({"mode": "threshold"}, r"threshold=None must be a number in \[0, 2\]"),
        ({"mode": "threshold", "threshold": 2.5}, r"threshold=2.5 must be a number in \[0, 2\]"),
        ({"mode": "threshold", "threshold": -0.01}, r"threshold=-0.01 must be a number in"),
        ({"mode": "threshold", "threshold": 0.1, "rate": 0.5}, r"rate=0.5 is only used by"),
        (
            {"mode": "threshold", "threshold": 0.1, "max_per_tubelet": 0},
            r"max_per_tubelet=0 must be an integer >= 1 or None",
        ),
        (
            {"mode": "threshold", "threshold": 0.1, "max_per_tubelet": 2.5},
            r"max_per_tubelet=2.5 must be an integer >= 1 or None",
        ),
        ({"mode": "threshold", "threshold": 0.1, "floor": -1}, r"floor=-1 must be an integer >= 0"),
        (
            {"mode": "threshold", "threshold": 0.1, "max_per_tubelet": 2, "floor": 3},
            r"floor=3 must be <= max_per_tubelet=2",
        ),
    ],
)
def test_invalid_config_names_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EVSConfig(**kwargs)


def test_valid_configs_at_range_edges():
    EVSConfig(mode="rate", rate=0.0)
    EVSConfig(mode="rate", rate=0.999)
    EVSConfig(mode="threshold", threshold=0.0)
    EVSConfig(mode="threshold", threshold=2.0, max_per_tubelet=3, floor=3)


def test_config_is_frozen():
    config = EVSConfig(mode="rate", rate=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rate = 0.1


def test_key_is_stable_and_distinguishes_settings():
    assert EVSConfig(mode="rate", rate=0.5).key() == "evs:rate:q=0.5"
    assert EVSConfig(mode="rate", rate=0).key() == EVSConfig(mode="rate", rate=0.0).key()
    threshold = EVSConfig(mode="threshold", threshold=0.1, max_per_tubelet=8, floor=2)
    assert threshold.key() == "evs:threshold:tau=0.1:cap=8:floor=2"
    keys = {
        EVSConfig(mode="rate", rate=0.5).key(),
        EVSConfig(mode="rate", rate=0.75).key(),
        EVSConfig(mode="threshold", threshold=0.5).key(),
        EVSConfig(mode="threshold", threshold=0.5, max_per_tubelet=4).key(),
        EVSConfig(mode="threshold", threshold=0.5, floor=1).key(),
    }
    assert len(keys) == 5


def test_the_pixel_stage_adds_itself_to_the_key_and_leaves_the_embeddings_key_alone():
    rate = EVSConfig(mode="rate", rate=0.5, stage="pixels")
    assert rate.key() == "evs:rate:q=0.5:stage=pixels" and rate.before_tower
    threshold = EVSConfig(mode="threshold", threshold=0.1, floor=2, stage="pixels")
    assert threshold.key() == "evs:threshold:tau=0.1:cap=none:floor=2:stage=pixels"
    embeddings = EVSConfig(mode="rate", rate=0.5, stage="embeddings")
    assert embeddings == EVSConfig(mode="rate", rate=0.5) and not embeddings.before_tower
    assert embeddings.key() == "evs:rate:q=0.5"


def test_settings_that_keep_every_token_say_so():
    assert EVSConfig(mode="rate", rate=0.0, stage="pixels").keeps_all
    assert EVSConfig(mode="threshold", threshold=0.0).keeps_all
    assert not EVSConfig(mode="threshold", threshold=0.0, max_per_tubelet=3).keeps_all
    assert not EVSConfig(mode="threshold", threshold=0.2, floor=16).keeps_all


def test_off_keeps_every_token():
    config = EVSConfig.off()
    assert config.is_off and not EVSConfig(mode="rate", rate=0.1).is_off
    result = prune(torch.randn(3 * 4, 8), (3, 2, 2), config)
    assert bool(result.mask.all())


def test_prune_rejects_bad_inputs():
    config = EVSConfig(mode="rate", rate=0.5)
    with pytest.raises(TypeError, match="config must be an EVSConfig"):
        prune(torch.randn(8, 4), (2, 2, 2), None)
    with pytest.raises(ValueError, match=r"grid=\(2, 0, 2\) must be 3 integers >= 1"):
        prune(torch.randn(8, 4), (2, 0, 2), config)
    with pytest.raises(ValueError, match=r"embeds has 8 tokens; grid=\(3, 2, 2\) needs 12"):
        prune(torch.randn(8, 4), (3, 2, 2), config)
    with pytest.raises(ValueError, match="embeds dtype torch.float64 is not one of"):
        prune(torch.randn(8, 4, dtype=torch.float64), (2, 2, 2), config)
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        prune(torch.randn(8, 4), (2, 2, 2), config, backend="cuda")


@pytest.mark.parametrize(
    ("num_tubelets", "tokens_per_tubelet", "rate", "expected"),
    [(2, 4, 0.75, 4), (48, 4, 0.5, 96), (4, 48, 0.5, 96), (20, 5, 0.9, 9)],
)
def test_retained_count_examples(num_tubelets, tokens_per_tubelet, rate, expected):
    assert num_retained_tokens(num_tubelets, tokens_per_tubelet, rate) == expected
    grid = (num_tubelets, 1, tokens_per_tubelet)
    embeds = torch.randn(num_tubelets * tokens_per_tubelet, 4)
    result = prune(embeds, grid, EVSConfig(mode="rate", rate=rate))
    assert result.num_kept_tokens == expected


def test_retained_count_sweep_matches_python_formula():
    generator = torch.Generator().manual_seed(1)
    rates = [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.6, 0.7, 0.9, 0.95, 0.999, 0.9999999]
    for num_tubelets in (1, 2, 3, 5, 7, 10):
        for h, w in ((1, 1), (1, 3), (2, 3), (4, 5)):
            embeds = torch.randn(num_tubelets * h * w, 6, generator=generator)
            for rate in rates:
                total = num_tubelets * h * w
                expected = max(h * w, int(total * (1 - rate)))
                result = prune(embeds, (num_tubelets, h, w), EVSConfig(mode="rate", rate=rate))
                assert result.num_kept_tokens == expected, (num_tubelets, h, w, rate)
                assert int(result.mask.sum()) == expected
