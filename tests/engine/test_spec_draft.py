"""The draft-model proposer: exact outputs whatever the draft, and refusals at start.

A draft that is a copy of the target has every draft accepted; a copy with a perturbed head
has some accepted and some rejected, and an unrelated random draft none, with outputs equal to
decoding without speculation in every case (batched, with chunked prefill; an image encoded
without the draft gets no drafts). On images and video encoded with the draft's tower too
(`VisionPipeline(draft_model=...)`), a copy of the target has every draft accepted (Qwen2.5-VL
with EVS on; Gemma 3's bidirectional images and frames, never split by the draft's steps), also
on items appended to a streaming request, and a smaller unrelated draft proposes, has some
drafts accepted and some rejected, and gives the tokens of decoding without speculation and of
transformers' `generate`. The same for Qwen3-VL, whose draft tower also gives the draft its own
DeepStack feature sets (`draft/deepstack.k`), kept by the same EVS mask. A draft whose
tokenizer or preprocessing differs, or that is larger than the target, is refused with a
message that says what is allowed.
"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.weights import set_weight
from stillcut.engine.multimodal import DRAFT
from stillcut.engine.request import RequestStatus, SamplingParams
from stillcut.engine.spec_decode.draft import DraftMismatch
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import ImageInput, VideoInput, VisionPipeline

from .reference import hf_greedy, qwen_hf_inputs

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
WIDE = {"initializer_range": 0.2}  # a tiny Qwen whose greedy text varies
QWEN3 = {"family": "qwen3_vl", "seed": 2, "text": WIDE}
# a smaller Qwen3-VL: narrower and shallower, its own tower with one DeepStack set
SMALL_QWEN3 = {
    "family": "qwen3_vl",
    "seed": 3,
    "text": {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2}
    | {"num_key_value_heads": 1, "head_dim": 12, "intermediate_size": 32},
    "vision": {"depth": 2, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32}
    | {"deepstack_visual_indexes": (0,)},
}
QWEN3_SIZE = (96, 128)  # frames Qwen3-VL's processors keep as they are


def _config(draft=None, max_num_batched_tokens=64) -> EngineConfig:
    speculative = None
    if draft is not None:
        speculative = SpeculativeConfig(
            method="draft", draft_model=str(draft), num_speculative_tokens=3, dynamic=False
        )
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_model_len=512),
        cache=CacheConfig(num_blocks=256),
        speculative=speculative,
    )


@pytest.fixture(scope="module")
def target():
    path = cached_checkpoint("tiny", seed=0, family="qwen2_5_vl", text=WIDE)
    base = LLMEngine(path, _config())
    texts = ["Write a story about a lighthouse.", "one two three four, one two three four, one"]
    prompts = [
        base.processor.build([{"role": "user", "content": [{"type": "text", "text": t}]}])
        for t in texts
    ]
    image = ImageInput(np.random.default_rng(0).integers(0, 256, (60, 90, 3), dtype=np.uint8))
    parts = [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    items = VisionPipeline(path).encode([image])
    prompts.append(base.processor.build([{"role": "user", "content": parts}], items))
    expected = [o.token_ids for o in base.generate(prompts, GREEDY)]
    return path, prompts, expected, base


def _assert_pool_whole(engine):
    for kv in (engine.scheduler.kv_cache, engine.speculator.proposer.kv_cache):
        kv.check_consistency()
        assert kv.num_free_blocks == len(kv.block_pool.blocks)


def test_a_copy_of_the_target_has_every_draft_accepted(target):
    path, prompts, expected, _ = target
    engine = LLMEngine(path, _config(draft=path))
    outputs = engine.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outputs] == expected[:2]
    for output in outputs:
        assert output.metrics.num_accepted_tokens == output.metrics.num_draft_tokens > 0
    _assert_pool_whole(engine)


def test_a_perturbed_copy_and_an_unrelated_draft_give_exact_outputs(target):
    path, prompts, expected, _ = target
    engine = LLMEngine(path, _config(draft=path))
    draft_model = engine.speculator.proposer.model
    noise = torch.randn(draft_model.lm_head.shape, generator=torch.Generator().manual_seed(0))
    set_weight(draft_model, "lm_head", draft_model.lm_head + 0.02 * noise)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert 0 < accepted < drafted, (drafted, accepted)
    assert outputs[2].metrics.num_draft_tokens == 0  # an image encoded without the draft
    _assert_pool_whole(engine)

    unrelated = cached_checkpoint("tiny", seed=1, family="qwen2_5_vl", text=WIDE)
    engine = LLMEngine(path, _config(draft=unrelated))
    outputs = engine.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outputs] == expected[:2]
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    _assert_pool_whole(engine)


def _media_prompts(engine, pipeline, specs: dict) -> dict:
    """name -> the prompt asking about one medium, encoded by `pipeline`."""
    prompts = {}
    for name, spec in specs.items():
        kind = "image" if isinstance(spec, ImageInput) else "video"
        parts = [{"type": kind}, {"type": "text", "text": "What happens? What happens?"}]
        (item,) = pipeline.encode([spec])
        prompts[name] = engine.processor.build([{"role": "user", "content": parts}], [item])
    return prompts


def _media(num_frames: int = 4, size: tuple[int, int] = (56, 84), image_size=(60, 90)):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (num_frames, *size, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (*image_size, 3), dtype=np.uint8)
    return {
        "video evs": VideoInput(frames, evs=EVSConfig(mode="rate", rate=0.5)),
        "video": VideoInput(frames),
        "image": ImageInput(image),
    }


def _assert_all_accepted(outputs):
    for output in outputs:
        assert output.metrics.num_accepted_tokens == output.metrics.num_draft_tokens > 0


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def media_target(request, target):
    """A family's target, its engine without speculation, how its media are drawn, and a
    smaller unrelated draft of the family (with a tower of its own)."""
    if request.param == "qwen2_5_vl":
        path, _, _, base = target
        return path, base, {}, request.getfixturevalue("small_draft_checkpoint")
    path = cached_checkpoint("tiny", **QWEN3)
    media = {"size": QWEN3_SIZE, "image_size": QWEN3_SIZE}
    return path, LLMEngine(path, _config()), media, cached_checkpoint("tiny", **SMALL_QWEN3)


def test_a_copy_of_the_target_accepts_every_draft_on_video_and_image(media_target):
    path, base, media, _ = media_target
    specs = _media(**media)
    del specs["video"]  # EVS on is the case where kept rows must line up
    prompts = _media_prompts(base, VisionPipeline(path, draft_model=path), specs)
    items = prompts["video evs"].items
    assert sum(i.num_tokens for i in items) < sum(i.num_dense_tokens for i in items)
    # the draft's own feature sets (Qwen3-VL's DeepStack), kept as the target's
    drafted = {f"{DRAFT}/{name}" for name in base.model.mm_feature_names}
    assert all(drafted <= set(item.features) for item in items)
    engine = LLMEngine(path, _config(draft=path))
    outputs = engine.generate(list(prompts.values()), GREEDY)
    expected = base.generate(list(prompts.values()), GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    _assert_all_accepted(outputs)
    _assert_pool_whole(engine)


def test_an_unrelated_smaller_draft_is_exact_on_video_and_image(media_target):
    from transformers import AutoModelForImageTextToText

    path, base, media, small = media_target
    specs = _media(**media)
    del specs["video evs"]  # the copy's test has it: here transformers' positions are the reference
    pipeline = VisionPipeline(path, draft_model=small)
    prompts = _media_prompts(base, pipeline, specs)
    features = prompts["image"].items[0].features
    assert {t.shape[1] for n, t in features.items() if n.startswith(DRAFT)} == {24}  # not 32
    engine = LLMEngine(path, _config(draft=small))
    outputs = dict(zip(prompts, engine.generate(list(prompts.values()), GREEDY), strict=True))
    expected = base.generate(list(prompts.values()), GREEDY)
    assert [o.token_ids for o in outputs.values()] == [o.token_ids for o in expected]
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    family = base.model_config.model_type
    for name in ("video", "image"):  # EVS off: transformers' own positions and embeddings
        inputs = qwen_hf_inputs(pipeline, prompts[name], [specs[name]], family)
        assert outputs[name].token_ids == hf_greedy(reference, inputs, GREEDY.max_tokens)
    assert all(o.metrics.num_draft_tokens > 0 for o in outputs.values())
    drafted = sum(o.metrics.num_draft_tokens for o in outputs.values())
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs.values())
    assert 0 < accepted < drafted, (drafted, accepted)
    _assert_pool_whole(engine)


def test_a_gemma3_copy_accepts_every_draft_on_bidirectional_images_and_frames():
    """An image and an EVS-pruned video (one image item per frame, each bidirectional), under
    a budget that splits the prompt (a mirror's step never ends inside an item)."""
    path = cached_checkpoint("tiny", family="gemma3")
    rng = np.random.default_rng(0)
    image = ImageInput(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8))
    frames = rng.integers(0, 256, (3, 60, 90, 3), dtype=np.uint8)
    video = VideoInput(frames, evs=EVSConfig(mode="rate", rate=0.5))
    items = VisionPipeline(path, draft_model=path).encode([image, video])
    parts = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}]
    parts.append({"type": "text", "text": "What happens?"})
    base = LLMEngine(path, _config())
    prompt = base.processor.build([{"role": "user", "content": parts}], items)
    assert len(prompt.items) == 4 and all(DRAFT in i.features for i in prompt.items)
    engine = LLMEngine(path, _config(draft=path, max_num_batched_tokens=24))
    step_ends = _record_step_ends(engine.speculator.proposer.runner)
    outputs = engine.generate([prompt], GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base.generate([prompt], GREEDY)]
    _assert_all_accepted(outputs)
    assert prompt.mm_positions[0].offset < 24 < prompt.mm_positions[0].end  # 24 would split
    assert not [e for e in step_ends for p in prompt.mm_positions if p.offset < e < p.end]
    _assert_pool_whole(engine)


def _record_step_ends(runner) -> list[int]:
    """Where each request's computed tokens end after each step `runner` executes."""
    ends, execute = [], runner.execute

    def recorded(step):
        starts = {c.request_id: c.num_computed_tokens for c in step.scheduled_cached}
        starts |= {n.request_id: n.num_computed_tokens for n in step.scheduled_new}
        ends.extend(starts[r] + n for r, n in step.num_scheduled_tokens.items())
        return execute(step)

    runner.execute = recorded
    return ends


def _narrate(engine, tubelets, params) -> tuple[str, list, list[int]]:
    """A streaming request that speaks a segment, then takes each tubelet and speaks again:
    its id, each segment's tokens, and the drafts proposed for it by each segment's end."""
    processor = engine.processor
    prompt = processor.build_text("Narrate what you see.")
    request_id = engine.add_request(prompt, params, streaming=True)
    segments, drafted = [], []
    for k, item in enumerate([None, *tubelets]):
        if item is not None:
            assert engine.scheduler.requests[request_id].status is RequestStatus.HELD
            engine.append_input(request_id, processor.narration_input(item, float(k)), [item])
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        segments.append(list(outputs[-1].token_ids))
        drafted.append(outputs[-1].metrics.num_draft_tokens)  # the request's metrics, so far
    return request_id, segments, drafted


def test_a_mirror_takes_the_items_appended_to_a_streaming_request(target):
    path, _, _, _ = target
    frames = np.random.default_rng(7).integers(0, 256, (2, 56, 84, 3), dtype=np.uint8)
    item = VisionPipeline(path, draft_model=path).video(frames, frames_fps=2.0)
    tubelets = [
        replace(
            item,
            identifier=f"t{k}",
            embeds=item.embeds * k,
            features={DRAFT: item.features[DRAFT] * k},
        )
        for k in (1, 2, 3)
    ]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    config = replace(_config(draft=path), cache=CacheConfig(num_blocks=256, held_share=0.5))
    engine = LLMEngine(path, config)
    request_id, segments, drafted = _narrate(engine, tubelets, params)
    base = LLMEngine(path, replace(config, speculative=None))
    assert segments == _narrate(base, tubelets, params)[1]
    # every segment after an append had drafts, and the copy's were all accepted
    assert all(after > before for before, after in zip(drafted, drafted[1:], strict=False))
    assert engine.scheduler.requests[request_id].num_accepted_tokens == drafted[-1]
    # the mirror's row was placed append by append exactly as the target's
    ours, theirs = (
        engine.speculator.proposer.runner.rows[request_id],
        engine.runner.rows[request_id],
    )
    assert ours.prompt_len == theirs.prompt_len
    assert torch.equal(ours.positions[:, : ours.prompt_len], theirs.positions[:, : ours.prompt_len])
    engine.abort(request_id)
    engine.step()
    _assert_pool_whole(engine)


@pytest.mark.parametrize(
    ("draft", "message"),
    [
        ({"family": "gemma3"}, "tokenizers differ"),
        ({"family": "qwen2_5_vl", "text": {**WIDE, "hidden_size": 64}}, "no larger than"),
        (
            {"family": "qwen2_5_vl", "text": WIDE, "processor": {"image_max_pixels": 200704}},
            "preprocessor_config.json differs",
        ),
    ],
)
def test_a_mismatched_draft_is_refused(target, draft, message):
    path, _, _, _ = target
    with pytest.raises(DraftMismatch, match=message):
        LLMEngine(path, _config(draft=cached_checkpoint("tiny", seed=2, **draft)))
