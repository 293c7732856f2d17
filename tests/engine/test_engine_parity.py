"""The engine's greedy tokens equal transformers' for the same prompts.

Random tiny checkpoints of both Qwen families: text only, one video, two videos and an image in
one prompt, and all of them submitted at once with a small token budget so chunked prefill and
batching kick in. With EVS on, transformers' `generate` would recompute positions itself, so
the reference is a greedy loop over its `forward` fed our pruned embeddings and positions.
"""

import numpy as np
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline

from .reference import hf_greedy, qwen_hf_inputs

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
FAMILIES = ("qwen2_5_vl", "qwen2_vl")


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    from transformers import AutoModelForImageTextToText

    # a wide initialisation makes the greedy tokens vary (the default repeats one token, which
    # no difference in positions or embeddings would change)
    path = cached_checkpoint("tiny", seed=1, family=request.param, text={"initializer_range": 0.2})
    engine = LLMEngine(path, _config(max_num_batched_tokens=4096))
    pipeline = VisionPipeline(path)
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return engine, pipeline, reference


def _config(max_num_batched_tokens: int) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=4096
        ),
        cache=CacheConfig(num_blocks=1024, block_size=16),
    )


def _media(seed: int):
    rng = np.random.default_rng(seed)
    video_a = VideoInput(rng.integers(0, 256, (4, 56, 84, 3), dtype=np.uint8), frames_fps=2.0)
    video_b = VideoInput(rng.integers(0, 256, (3, 84, 56, 3), dtype=np.uint8), frames_fps=1.0)
    image = ImageInput(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8))
    return video_a, video_b, image


def _cases(pipeline):
    """Each case: message parts, the encoded items, and the inputs they came from."""
    video_a, video_b, image = _media(0)
    (a,) = pipeline.encode([video_a])
    b, img = pipeline.encode([video_b, image])
    return {
        "text": ([{"type": "text", "text": "Write a story about a lighthouse."}], [], []),
        "one video": (
            [{"type": "video"}, {"type": "text", "text": "What happens?"}],
            [a],
            [video_a],
        ),
        "two videos and an image": (
            [
                {"type": "text", "text": "First:"},
                {"type": "video"},
                {"type": "text", "text": "then"},
                {"type": "image"},
                {"type": "video"},
                {"type": "text", "text": "Compare them."},
            ],
            [a, img, b],
            [video_a, image, video_b],
        ),
    }


@pytest.mark.parametrize("case", ["text", "one video", "two videos and an image"])
def test_greedy_equals_transformers_generate(setup, case):
    engine, pipeline, reference = setup
    parts, items, specs = _cases(pipeline)[case]
    prompt = engine.processor.build([{"role": "user", "content": parts}], items)
    (ours,) = engine.generate([prompt], GREEDY)
    inputs = qwen_hf_inputs(pipeline, prompt, specs, engine.model_config.model_type)
    assert ours.token_ids == hf_greedy(reference, inputs, NUM_NEW_TOKENS)
    _assert_pool_whole(engine)


def test_everything_at_once_with_chunked_prefill_equals_one_at_a_time(setup):
    engine, pipeline, _ = setup
    prompts = [
        engine.processor.build([{"role": "user", "content": parts}], items)
        for parts, items, _ in _cases(pipeline).values()
    ]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    small = LLMEngine(engine.path, _config(max_num_batched_tokens=48))
    together = small.generate(prompts * 2, GREEDY)
    assert [o.token_ids for o in together] == alone * 2
    _assert_pool_whole(small)


def test_evs_pruned_video_equals_a_greedy_loop_over_transformers_forward(setup):
    engine, pipeline, reference = setup
    video_a, _, _ = _media(0)
    item = pipeline.video(video_a.source, evs=EVSConfig(mode="rate", rate=0.5), frames_fps=2.0)
    assert item.num_tokens < item.num_dense_tokens
    parts = [{"type": "video"}, {"type": "text", "text": "Describe it."}]
    prompt = engine.processor.build([{"role": "user", "content": parts}], [item])
    (ours,) = engine.generate([prompt], GREEDY)

    positions, next_position = engine.model.prompt_positions(
        torch.tensor(prompt.token_ids), prompt.items
    )
    embeds = reference.get_input_embeddings()(torch.tensor([prompt.token_ids]))
    video_mask = torch.tensor(prompt.token_ids) == engine.processor.special.video_token_id
    embeds[0, video_mask] = item.embeds
    assert ours.token_ids == _hf_greedy_loop(reference, embeds, positions, next_position)


def _hf_greedy_loop(reference, embeds, positions, next_position) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache(config=reference.config)
    tokens = []
    position_ids = positions[:, None, :]  # [3, 1, N]
    with torch.inference_mode():
        for step in range(NUM_NEW_TOKENS):
            out = reference(
                inputs_embeds=embeds,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            embeds = reference.get_input_embeddings()(torch.tensor([[token]]))
            position_ids = torch.full((3, 1, 1), next_position + step)
    return tokens


def _assert_pool_whole(engine):
    """Every block is back in the pool with ref count zero."""
    kv = engine.scheduler.kv_cache
    assert not engine.has_unfinished_requests()
    kv.check_consistency()
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert kv.num_free_blocks == len(kv.block_pool.blocks)
