"""Nemotron 3 Nano Omni: the engine's greedy tokens equal transformers' `generate`.

A tiny random checkpoint with every layer kind (Mamba2, MoE with grouped top-2 routing,
attention, MLP), the offline-trained tokenizer and a ChatML template: text only, one image, a
real clip decoded by PyAV with the checkpoint's own EVS rate and with EVS off, and all of them
at once under a small token budget, so prefill chunks split the Mamba2 layers' scans and carry
their state across steps. The reference prompts come from transformers' own processor code
(its video processor, and the tubelet labels its processor writes); with EVS on, transformers
prunes inside its forward pass with `compute_retention_mask`, and our prompt holds exactly the
tokens it keeps.
"""

import types

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.pipeline import VideoInput, VisionPipeline

NUM_NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
DECODE = DecodeConfig(fps=2.0, max_frames=8)
CASES = ("text", "image", "video with the checkpoint's EVS", "video without EVS")


@pytest.fixture(scope="module")
def setup(samples_dir):
    from transformers import AutoTokenizer, NemotronH_Omni_Reasoning_V3

    path = cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")
    engine = LLMEngine(path, _config(max_num_batched_tokens=4096))
    pipeline = VisionPipeline(path, decode_config=DECODE)
    reference = NemotronH_Omni_Reasoning_V3.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    clip = samples_dir / "moving_object.mp4"
    return types.SimpleNamespace(
        engine=engine, pipeline=pipeline, reference=reference, tokenizer=tokenizer, clip=clip
    )


def _config(max_num_batched_tokens: int, num_blocks: int = 256) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048
        ),
        cache=CacheConfig(num_blocks=num_blocks, block_size=16, held_share=0.0),
    )


def _case(setup, name: str):
    """Message parts, the encoded items and the transformers inputs of one case."""
    image = torch.Generator().manual_seed(3)
    pixels = torch.randint(0, 256, (60, 90, 3), generator=image, dtype=torch.uint8).numpy()
    if name == "text":
        return [{"type": "text", "text": "Write a story about a lighthouse."}], [], {}
    if name == "image":
        item = setup.pipeline.image(pixels)
        parts = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]
        return parts, [item], _hf_image(setup, pixels)
    rate = setup.engine.model_config.native_evs_rate if "checkpoint" in name else 0.0
    assert rate == 0.0 or rate == 0.5
    evs = EVSConfig(mode="rate", rate=rate) if rate else None
    item = setup.pipeline.encode([VideoInput(setup.clip, evs=evs)])[0]
    parts = [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    return parts, [item], _hf_video(setup)


def _hf_image(setup, pixels) -> dict:
    from stillcut.vision.siglip import image_patches

    prepared = setup.pipeline.media.prepare_image(pixels)  # checked against its rules elsewhere
    rows, cols = prepared.grid_thw[1:]
    replacement = f"<img>{'<image>' * (rows * cols // 4)}</img>"
    return {
        "replacements": [("<image>", replacement)],
        "pixel_values": image_patches(prepared.pixel_values, 16)[0],
        "image_grid_hw": torch.tensor([[rows, cols]]),
    }


def _hf_video(setup) -> dict:
    """transformers' video processor on the decoded frames, and its processor's prompt text."""
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3Processor as Processor,
    )
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3VideoProcessor as VideoProcessor,
    )
    from transformers.video_utils import VideoMetadata

    decoded = decode_video(setup.clip, DECODE)
    metadata = VideoMetadata(
        total_num_frames=144, fps=decoded.source_fps, frames_indices=decoded.source_indices
    )
    processor = VideoProcessor.from_pretrained(setup.engine.path)
    frames = torch.from_numpy(decoded.frames).permute(0, 3, 1, 2)
    inputs = processor(
        videos=[frames],
        video_metadata=[metadata],
        return_metadata=True,
        do_convert_rgb=False,
        do_sample_frames=False,
        return_tensors="pt",
    )
    # The processor's own label code; its image processor (which needs torchvision) unused.
    writer = types.SimpleNamespace(
        image_start_token="<img>",
        image_token="<image>",
        image_end_token="</img>",
        video_processor=processor,
        video_temporal_patch_dim=2,
    )
    replacement = Processor.replace_video_token(writer, inputs, 0)
    return {
        "replacements": [("<video>", replacement)],
        "pixel_values_videos": inputs["pixel_values_videos"],
    }


def _hf_prompt(setup, parts, hf) -> list[int]:
    text = setup.engine.processor.chat_template.render([{"role": "user", "content": parts}])
    for marker, replacement in hf.get("replacements", ()):
        text = text.replace(marker, replacement, 1)
    return setup.tokenizer(text, add_special_tokens=False)["input_ids"]


def _hf_greedy(setup, input_ids, hf, pruning_rate: float) -> list[int]:
    reference = setup.reference
    reference.video_pruning_rate = pruning_rate
    media = {k: v for k, v in hf.items() if k != "replacements"}
    with torch.inference_mode():
        out = reference.generate(
            input_ids=torch.tensor([input_ids]),
            **media,
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, -NUM_NEW_TOKENS:].tolist()


def _assert_all_free(engine):
    """Every block back in the pool and, after the step that drops finished rows, every
    recurrent state slot (runner row) free."""
    assert not engine.has_unfinished_requests()
    engine.step()  # rows of requests that finished in the last step are dropped at the next
    kv = engine.scheduler.kv_cache
    kv.check_consistency()
    assert kv.num_free_blocks == kv.num_blocks
    runner = engine.runner
    assert not runner.rows and sorted(runner.free_rows) == list(range(len(runner.token_ids)))


@pytest.mark.parametrize("name", CASES)
def test_greedy_equals_transformers_generate(setup, name):
    parts, items, hf = _case(setup, name)
    prompt = setup.engine.processor.build([{"role": "user", "content": parts}], items)
    expected_ids = _hf_prompt(setup, parts, hf)
    rate = 0.5 if "checkpoint" in name else 0.0
    if rate:
        from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
            compute_retention_mask,
        )

        with torch.inference_mode():
            features = setup.reference.get_video_features(hf["pixel_values_videos"])
        (embeds,) = features.pooler_output
        kept = compute_retention_mask(embeds, hf["pixel_values_videos"].shape[1], rate).tolist()
        image_id = setup.engine.processor.special.image_token_id
        placeholders = iter(kept)
        expected_ids = [t for t in expected_ids if t != image_id or next(placeholders)]
    assert prompt.token_ids == expected_ids
    (ours,) = setup.engine.generate([prompt], GREEDY)
    assert ours.token_ids == _hf_greedy(setup, _hf_prompt(setup, parts, hf), hf, rate)
    _assert_all_free(setup.engine)


def test_all_at_once_in_small_chunks_equals_one_at_a_time(setup):
    engine = setup.engine
    prompts = []
    for name in CASES:
        parts, items, _ = _case(setup, name)
        prompts.append(engine.processor.build([{"role": "user", "content": parts}], items))
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    # 13 tokens a step: chunks end mid-Mamba2-chunk, mid-tubelet and mid-block
    small = LLMEngine(engine.path, _config(max_num_batched_tokens=13))
    together = small.generate(prompts * 2, GREEDY)
    assert [o.token_ids for o in together] == alone * 2
    _assert_all_free(small)


def test_preemption_recomputes_the_same_tokens_and_frees_everything(setup):
    engine = setup.engine
    parts, items, _ = _case(setup, "video without EVS")
    video = engine.processor.build([{"role": "user", "content": parts}], items)
    text = engine.processor.build([{"role": "user", "content": "Count the birds on the wire."}])
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in (video, text)]
    # The video grows from 15 to 16 blocks of 16 tokens, the text from 2 to 3: in 18 blocks
    # both start, and the newer is preempted while decoding once both have grown.
    tight = LLMEngine(engine.path, _config(max_num_batched_tokens=256, num_blocks=18))
    num_generated = []  # of each preempted request, when it was preempted
    original = tight.scheduler._preempt
    tight.scheduler._preempt = lambda request: (
        num_generated.append(len(request.output_token_ids)),
        original(request),
    )
    together = tight.generate([video, text, video], GREEDY)
    # recomputing generated tokens reruns them as a prompt chunk: their dt stays unclamped
    assert max(num_generated, default=0) > 0, "the budget was meant to preempt a decoding request"
    assert [o.token_ids for o in together] == [alone[0], alone[1], alone[0]]
    _assert_all_free(tight)


def test_aborted_requests_free_their_blocks_and_state_slots(setup):
    engine = setup.engine
    prompt = engine.processor.build([{"role": "user", "content": "Describe the weather."}])
    ids = [engine.add_request(prompt, GREEDY) for _ in range(3)]
    engine.step()  # all three prefilled: rows taken, Mamba2 states written
    engine.step()
    assert len(engine.runner.rows) == 3
    engine.abort(ids[0])
    engine.step()
    for request_id in ids[1:]:
        engine.abort(request_id)
    _assert_all_free(engine)
