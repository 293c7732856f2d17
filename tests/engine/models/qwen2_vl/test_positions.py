"""M-RoPE positions: parity with transformers' `get_rope_index`, invariance under EVS pruning."""

import functools
import itertools
import random

import pytest
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from stillcut.engine.models.qwen2_vl.positions import MRopeSpec, mrope_positions
from stillcut.engine.multimodal import MultiModalItem, dense_coords

IMAGE_PAD, VIDEO_PAD = 151655, 151656
MM_TYPE = {"image": 1, "video": 2}  # transformers' mm_token_type_ids
TEXT_CONFIG = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
}
VISION_CONFIG = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2}

# (kind, pre-merge grid_thw, second_per_grid_ts); grids are non-square, t odd, some t >> h, w
PROMPTS = [
    [("video", (3, 4, 6), 1.0)],
    [("image", (1, 4, 6), 1.0), ("video", (5, 6, 4), 0.5), ("video", (1, 2, 2), 2 / 3)],
    [("video", (7, 2, 4), 2 / 3), ("image", (1, 8, 2), 1.0), ("video", (5, 10, 6), 0.6)],
    [("image", (1, 2, 6), 1.0), ("video", (9, 4, 2), 2 / 3), ("image", (2, 6, 6), 1.0)],
]
FAMILIES = [("qwen2_5_vl", 2), ("qwen2_5_vl", 25), ("qwen2_vl", None)]


@functools.cache
def hf_model(family: str, tokens_per_second: int | None) -> torch.nn.Module:
    if family == "qwen2_vl":
        config = Qwen2VLConfig(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG)
        return Qwen2VLForConditionalGeneration(config).model
    vision = {**VISION_CONFIG, "out_hidden_size": 16, "tokens_per_second": tokens_per_second}
    config = Qwen2_5_VLConfig(text_config=TEXT_CONFIG, vision_config=vision)
    return Qwen2_5_VLForConditionalGeneration(config).model


def make_item(kind: str, grid_thw: tuple[int, int, int], seconds: float, keep=None):
    """An item with dense coords, or only those where `keep` ([num_dense] bool) is set."""
    coords = dense_coords(grid_thw[0], grid_thw[1] // 2, grid_thw[2] // 2)  # [num_dense, 3]
    if keep is not None:
        coords = coords[keep]
    return MultiModalItem(
        kind=kind,
        embeds=torch.zeros(coords.shape[0], 1),
        coords=coords,
        grid_thw=grid_thw,
        second_per_grid_ts=seconds,
    )


def build_prompt(items: list[MultiModalItem], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [num_tokens] and mm types [num_tokens]: random text between items, sometimes
    none before the first or after the last, and none between an image and a video."""
    rng = random.Random(seed)
    ids, types = [], []
    for index, item in enumerate(items):
        same_kind_before = index > 0 and items[index - 1].kind == item.kind
        num_text = rng.randint(1 if same_kind_before else 0, 4)
        ids += [rng.randrange(1000) for _ in range(num_text)]
        types += [0] * num_text
        ids += [IMAGE_PAD if item.kind == "image" else VIDEO_PAD] * item.num_tokens
        types += [MM_TYPE[item.kind]] * item.num_tokens
    num_tail = rng.randint(0, 3)
    return torch.tensor(ids + [7] * num_tail), torch.tensor(types + [0] * num_tail)


def hf_rope_index(model, ids, types, items) -> tuple[torch.Tensor, int]:
    def grids(kind):
        found = [item.grid_thw for item in items if item.kind == kind]
        return torch.tensor(found) if found else None

    seconds = [item.second_per_grid_ts for item in items if item.kind == "video"]
    kwargs = {"image_grid_thw": grids("image"), "video_grid_thw": grids("video")}
    if isinstance(model.config, Qwen2_5_VLConfig):
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)  # float32, as the processor gives
    positions, delta = model.get_rope_index(ids[None], types[None].int(), **kwargs)
    return positions[:, 0], int(delta)


def spec_for(tokens_per_second, text_after_vision="spatial_extent") -> MRopeSpec:
    return MRopeSpec(IMAGE_PAD, VIDEO_PAD, tokens_per_second, text_after_vision)


def legacy_positions(positions: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
    """Re-offset each text run / item so it starts after the maximum so far (transformers < 5.3)."""
    out, next_start, begin = positions.clone(), 0, 0
    for _, group in itertools.groupby(types.tolist()):
        stop = begin + len(list(group))
        segment = positions[:, begin:stop]
        out[:, begin:stop] = segment - segment.min() + next_start
        next_start, begin = int(out[:, begin:stop].max()) + 1, stop
    return out


@pytest.mark.parametrize("family,tokens_per_second", FAMILIES)
@pytest.mark.parametrize("prompt_index", range(len(PROMPTS)))
def test_dense_positions_match_transformers(family, tokens_per_second, prompt_index):
    model = hf_model(family, tokens_per_second)
    items = [make_item(*entry) for entry in PROMPTS[prompt_index]]
    ids, types = build_prompt(items, seed=prompt_index)
    expected, expected_delta = hf_rope_index(model, ids, types, items)

    result = mrope_positions(ids, items, spec_for(tokens_per_second))
    assert torch.equal(result.positions, expected)
    assert result.delta == expected_delta
    assert result.next_position == int(expected.max()) + 1


@pytest.mark.parametrize("family,tokens_per_second", FAMILIES)
def test_grid_max_continues_after_dense_maximum(family, tokens_per_second):
    model = hf_model(family, tokens_per_second)
    items = [make_item(*entry) for entry in PROMPTS[2]]
    ids, types = build_prompt(items, seed=2)
    hf_positions, _ = hf_rope_index(model, ids, types, items)
    expected = legacy_positions(hf_positions, types)
    assert not torch.equal(expected, hf_positions)  # the prompt must tell the two rules apart

    result = mrope_positions(ids.tolist(), items, spec_for(tokens_per_second, "grid_max"))
    assert torch.equal(result.positions, expected)
    assert result.next_position == int(expected.max()) + 1


def test_temporal_positions_round_in_float32_like_transformers():
    # int(3 * 2/3 * 25) is 49 in float64 arithmetic but 50 in transformers' float32
    for seconds, expected in [(2 / 3, [0, 16, 33, 50]), (0.6, [0, 15, 30, 45])]:
        item = make_item("video", (4, 2, 2), seconds)
        positions = mrope_positions([VIDEO_PAD] * 4, [item], spec_for(25)).positions
        assert positions[0].tolist() == expected


def random_keep(item: MultiModalItem, rng: torch.Generator, drop_all_later: bool) -> torch.Tensor:
    """EVS-like retention: the first tubelet always kept, later tokens kept at random."""
    first = dense_coords(*item.llm_grid)[:, 0] == 0  # [num_dense]
    if drop_all_later:
        return first
    return first | (torch.rand(first.shape[0], generator=rng) < 0.5)


@pytest.mark.parametrize("text_after_vision", ["spatial_extent", "grid_max"])
@pytest.mark.parametrize("tokens_per_second", [2, 25, None])
@pytest.mark.parametrize("prompt_index", range(len(PROMPTS)))
def test_pruning_keeps_unpruned_positions(text_after_vision, tokens_per_second, prompt_index):
    spec = spec_for(tokens_per_second, text_after_vision)
    entries = PROMPTS[prompt_index]
    dense_items = [make_item(*entry) for entry in entries]
    dense_ids, _ = build_prompt(dense_items, seed=prompt_index)
    dense = mrope_positions(dense_ids, dense_items, spec)

    rng = torch.Generator().manual_seed(prompt_index)
    first_video = next(index for index, (kind, *_) in enumerate(entries) if kind == "video")
    keeps = [
        random_keep(item, rng, drop_all_later=index == first_video)
        if item.kind == "video"
        else torch.ones(item.num_tokens, dtype=torch.bool)
        for index, item in enumerate(dense_items)
    ]
    pruned_items = [make_item(*e, keep=k) for e, k in zip(entries, keeps, strict=True)]
    keep_token = torch.ones_like(dense_ids, dtype=torch.bool)  # [num_dense_tokens]
    placeholder = (dense_ids == IMAGE_PAD) | (dense_ids == VIDEO_PAD)
    keep_token[placeholder] = torch.cat(keeps)
    assert not bool(keep_token.all())  # something was pruned

    pruned = mrope_positions(dense_ids[keep_token], pruned_items, spec)
    assert torch.equal(pruned.positions, dense.positions[:, keep_token])
    assert pruned.next_position == dense.next_position
    assert pruned.delta == dense.delta + int((~keep_token).sum())


def test_positions_after_prompt_follow_delta():
    items = [make_item("video", (5, 4, 2), 1.0)]
    result = mrope_positions([3, 4] + [VIDEO_PAD] * 10, items, spec_for(25))
    # starts at 2; the last of 5 tubelets at 25 tokens/s sits at 2 + 100, so decode starts at 103
    assert result.next_position == 103
    assert result.delta == 103 - 12


def test_text_only_prompt_counts_up():
    result = mrope_positions([5, 6, 7], [], spec_for(2))
    assert result.positions.tolist() == [[0, 1, 2]] * 3
    assert result.next_position == 3 and result.delta == 0


def test_placeholder_count_mismatch_names_item_and_counts():
    items = [make_item("image", (1, 2, 2), 1.0), make_item("video", (3, 4, 4), 1.0)]
    ids = [1, IMAGE_PAD, 2] + [VIDEO_PAD] * 10 + [3]
    with pytest.raises(ValueError, match=r"placeholder run 1 has 10 tokens but its items have 12"):
        mrope_positions(ids, items, spec_for(2))


@pytest.mark.parametrize(
    "ids,match",
    [
        ([1, IMAGE_PAD, 2], "placeholder runs for 1 items but 2 items were given"),
        ([IMAGE_PAD, 1, VIDEO_PAD, 2, VIDEO_PAD], "placeholder run 2 has 1 tokens but its items"),
        (
            [VIDEO_PAD, 1, IMAGE_PAD],
            r"item 0 \(image\) must sit on 1 tokens of its placeholder 151655 from index 0",
        ),
    ],
)
def test_runs_must_match_items_in_order(ids, match):
    items = [make_item("image", (1, 2, 2), 1.0), make_item("video", (1, 2, 2), 1.0)]
    with pytest.raises(ValueError, match=match):
        mrope_positions(ids, items, spec_for(2))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"image_token_id": -1}, "image_token_id"),
        ({"video_token_id": IMAGE_PAD}, "video_token_id must differ"),
        ({"tokens_per_second": 0}, "tokens_per_second"),
        ({"text_after_vision": "dense"}, "text_after_vision"),
    ],
)
def test_spec_rejects_invalid_fields(kwargs, field):
    values = {"image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD, **kwargs}
    with pytest.raises(ValueError, match=field):
        MRopeSpec(**values)


def test_dense_coords_are_row_major():
    coords = dense_coords(2, 2, 3)
    assert coords.shape == (12, 3) and coords.dtype == torch.long
    assert coords[:4].tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0]]
    assert coords[6].tolist() == [1, 0, 0]


@pytest.mark.parametrize("text_after_vision", ["spatial_extent", "grid_max"])
def test_stream_tubelets_in_one_run_equal_one_video(text_after_vision):
    """A live stream's tubelets are separate items whose placements touch; with each tubelet's
    grid spanning the stream so far (an empty last tubelet still counts), they must get the
    positions of one video holding the same kept tokens."""
    spec = spec_for(2, text_after_vision)
    t, h, w = 5, 4, 6  # pre-merge h, w; 2 x 3 merged tokens per tubelet
    keep = torch.rand(t * 6, generator=torch.Generator().manual_seed(3)) < 0.5
    keep[:6] = True  # the first tubelet is kept whole
    keep[-6:] = False  # the last one is fully pruned
    whole = make_item("video", (t, h, w), 0.5, keep)
    tubelets = []
    for k in range(t):
        coords = whole.coords[whole.coords[:, 0] == k]
        tubelets.append(
            MultiModalItem(
                kind="video",
                embeds=torch.zeros(coords.shape[0], 1),
                coords=coords,
                grid_thw=(k + 1, h, w),  # the logical video's grid up to this tubelet
                second_per_grid_ts=0.5,
            )
        )
    ids = [1, 2] + [VIDEO_PAD] * whole.num_tokens + [3, 4, 5]
    offsets = [2 + sum(item.num_tokens for item in tubelets[:k]) for k in range(t)]
    placements = [(o, item.num_tokens) for o, item in zip(offsets, tubelets, strict=True)]
    expected = mrope_positions(ids, [whole], spec)
    streamed = mrope_positions(ids, tubelets, spec, placements)
    assert torch.equal(streamed.positions, expected.positions)
    assert streamed.next_position == expected.next_position
