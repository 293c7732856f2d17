"""Qwen3-VL with EVS: pruned tubelets keep their timestamps, positions and DeepStack rows.

transformers cannot place a pruned video (`get_rope_index` wants whole grids), so the reference
is a greedy loop over its language model (`qwen3_reference.pruned_greedy`): the unpruned
prompt's positions from `get_rope_index`, selected for the kept tokens, and the tower's
embeddings and DeepStack features (`get_video_features`) of exactly those tokens. Checked: each
tubelet's placeholder run holds its kept tokens, the pruned prompt is the unpruned one with
the pruned tokens removed (a tubelet EVS empties keeps `<t seconds><|vision_start|>
<|vision_end|>`), its positions are the unpruned prompt's selected, the greedy tokens and
first logits equal the reference's, and the DeepStack features of the kept tokens matter.
"""

from dataclasses import replace

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import build_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import VisionPipeline

from .qwen3_reference import engine_answer, hand_pixels, pruned_greedy, random_frames

FPS = 2.0
MAX_TOKENS = 8
QUESTION = "What happens?"


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def setup(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    folder = tmp_path_factory.mktemp(request.param) / "checkpoint"
    folder = build_checkpoint(folder, seed=2, family=request.param)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048),
        cache=CacheConfig(num_blocks=128, block_size=16),
    )
    reference = AutoModelForImageTextToText.from_pretrained(folder).eval()
    return LLMEngine(folder, config), VisionPipeline(folder), reference


def _case(setup, frames, evs):
    """The pruned prompt and item, and the reference's view of it: the unpruned prompt's ids
    and types, the kept mask over them, and the kept tokens' embeddings and DeepStack sets."""
    engine, pipeline, reference = setup
    item = pipeline.video(frames, evs=evs, frames_fps=FPS)
    prompt = engine.processor.build_text(QUESTION, [item])
    dense = engine.processor.build_text(QUESTION, [pipeline.video(frames, frames_fps=FPS)])
    num_tubelets, height, width = item.llm_grid
    coords = item.coords
    dense_index = (coords[:, 0] * height + coords[:, 1]) * width + coords[:, 2]
    assert bool((dense_index.diff() > 0).all())  # kept tokens in the dense order
    kept = torch.ones(len(dense.token_ids), dtype=torch.bool)
    for tubelet, place in enumerate(dense.mm_positions):
        kept[place.offset : place.end] = False
        rows = dense_index[coords[:, 0] == tubelet] - tubelet * height * width
        kept[place.offset + rows] = True
    ids = torch.tensor(dense.token_ids)
    types = 2 * (ids == engine.processor.special.video_token_id).int()
    patches, grid = hand_pixels(frames)
    with torch.inference_mode():
        tower = reference.model.get_video_features(
            pixel_values_videos=patches, video_grid_thw=torch.tensor([grid])
        )
    embeds = tower.pooler_output[0][dense_index]
    deepstack = [sets[0][dense_index] for sets in tower.deepstack_features]
    return item, prompt, (ids, types, torch.tensor([grid]), kept, embeds, deepstack)


def _check_prompt(setup, item, prompt, view) -> None:
    engine = setup[0]
    ids, types, grid, kept, _, _ = view
    kept_per_tubelet = torch.bincount(item.coords[:, 0], minlength=item.llm_grid[0]).tolist()
    assert [place.length for place in prompt.mm_positions] == kept_per_tubelet
    assert prompt.token_ids == ids[kept].tolist()
    placements = [(place.offset, place.length) for place in prompt.mm_positions]
    positions, _ = engine.model.prompt_positions(
        torch.tensor(prompt.token_ids), prompt.items, placements
    )
    dense_positions, _ = setup[2].model.get_rope_index(
        ids[None], mm_token_type_ids=types[None], video_grid_thw=grid
    )
    assert torch.equal(positions, dense_positions[:, 0, kept])


def _check_answer(setup, prompt, view) -> None:
    ids, types, grid, kept, embeds, deepstack = view
    output, logits = engine_answer(setup[0], prompt, MAX_TOKENS)
    tokens, expected = pruned_greedy(
        setup[2], ids, types, grid, kept, embeds, deepstack, MAX_TOKENS
    )
    assert output.token_ids == tokens
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_a_rate_pruned_video_equals_the_reference(setup):
    frames = random_frames(6, 128, 160, seed=4)
    item, prompt, view = _case(setup, frames, EVSConfig(mode="rate", rate=0.5))
    assert item.num_tokens < item.num_dense_tokens
    _check_prompt(setup, item, prompt, view)
    _check_answer(setup, prompt, view)


def test_a_tubelet_evs_empties_keeps_its_timestamp_and_positions(setup):
    frames = random_frames(6, 128, 160, seed=5)
    frames[2:4] = frames[0:2]  # the second tubelet repeats the first: nothing in it moved
    item, prompt, view = _case(setup, frames, EVSConfig(mode="threshold", threshold=0.01))
    assert item.kept_per_tubelet[1] == 0 < min(item.kept_per_tubelet[0], item.kept_per_tubelet[2])
    text = setup[0].processor.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    assert "<1.2 seconds><|vision_start|><|vision_end|><2.2 seconds>" in text
    _check_prompt(setup, item, prompt, view)
    _check_answer(setup, prompt, view)


def test_the_kept_tokens_deepstack_features_move_the_first_logits(setup):
    engine = setup[0]
    frames = random_frames(6, 128, 160, seed=4)
    item, prompt, view = _case(setup, frames, EVSConfig(mode="rate", rate=0.5))
    zeroed_item = replace(
        item,
        identifier=item.identifier + "/zeros",  # its K/V differ: not the cached prefix
        features={name: torch.zeros_like(f) for name, f in item.features.items()},
    )
    zeroed_prompt = engine.processor.build_text(QUESTION, [zeroed_item])
    _, logits = engine_answer(engine, prompt, 1)
    _, zeroed_logits = engine_answer(engine, zeroed_prompt, 1)
    assert (logits - zeroed_logits).abs().max() > 1e-3
    ids, types, grid, kept, embeds, deepstack = view
    zeros = [torch.zeros_like(f) for f in deepstack]
    _, expected = pruned_greedy(setup[2], ids, types, grid, kept, embeds, zeros, 1)
    torch.testing.assert_close(zeroed_logits, expected, atol=1e-4, rtol=1e-4)
