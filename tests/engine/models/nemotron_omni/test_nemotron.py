"""Nemotron 3 Nano Omni: the engine's greedy tokens equal transformers' `generate`.

A tiny random checkpoint with every layer kind (Mamba2, MoE with grouped top-2 routing,
attention, MLP), the offline-trained tokenizer and a ChatML template: text only, one image, a
real clip decoded by PyAV with the checkpoint's own EVS rate and with EVS off, and all of them
at once under a small token budget, so prefill chunks split the Mamba2 layers' scans and carry
their state across steps. The reference prompts come from transformers' own processor code
(its video processor, and the tubelet labels its processor writes); with EVS on, transformers
prunes inside its forward pass with `compute_retention_mask`, and our prompt holds exactly the
tokens it keeps. Decode steps run natively (`kernels/cpu`) where the kernel builds; with
`STILLCUT_REQUIRE_NATIVE_DECODE` set (as CI sets it) a decode step the kernel declines fails the
parity test instead of quietly running the torch layers.
"""

import os
import types

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.decode import DecodeConfig
from stillcut.vision.pipeline import VideoInput, VisionPipeline

from .nemotron_reference import NemotronReference

NUM_NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
DECODE = DecodeConfig(fps=2.0, max_frames=8)
CASES = ("text", "image", "video with the checkpoint's EVS", "video without EVS")


@pytest.fixture(scope="module")
def setup(samples_dir):
    path = cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")
    return types.SimpleNamespace(
        engine=LLMEngine(path, _config(max_num_batched_tokens=4096)),
        pipeline=VisionPipeline(path, decode_config=DECODE),
        reference=NemotronReference(path),
        clip=samples_dir / "moving_object.mp4",
    )


def _config(
    max_num_batched_tokens: int, num_blocks: int = 256, prefix_caching: bool = True
) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048
        ),
        cache=CacheConfig(
            num_blocks=num_blocks,
            block_size=16,
            held_share=0.0,
            enable_prefix_caching=prefix_caching,
        ),
    )


def _case(setup, name: str):
    """Message parts, the encoded items, transformers' media inputs and its pruning rate."""
    if name == "text":
        return [{"type": "text", "text": "Write a story about a lighthouse."}], [], None, 0.0
    if name == "image":
        generator = torch.Generator().manual_seed(3)
        pixels = torch.randint(0, 256, (60, 90, 3), generator=generator, dtype=torch.uint8)
        item = setup.pipeline.image(pixels.numpy())
        prepared = setup.pipeline.media.prepare_image(pixels.numpy())  # checked elsewhere
        media = setup.reference.image(prepared.pixel_values, prepared.grid_thw[1:])
        parts = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]
        return parts, [item], media, 0.0
    rate = setup.engine.model_config.native_evs_rate if "checkpoint" in name else 0.0
    evs = EVSConfig(mode="rate", rate=rate) if rate else None
    item = setup.pipeline.encode([VideoInput(setup.clip, evs=evs)])[0]
    parts = [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    return parts, [item], setup.reference.video(setup.clip, DECODE), rate


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
def test_greedy_equals_transformers_generate(setup, name, native_steps):
    parts, items, media, rate = _case(setup, name)
    messages = [{"role": "user", "content": parts}]
    prompt = setup.engine.processor.build(messages, items)
    expected_ids = setup.reference.prompt_ids(messages, media)
    if rate:
        assert rate == 0.5  # the checkpoint's own `video_pruning_rate`
        kept = iter(setup.reference.retention(media, rate))
        image_id = setup.engine.processor.special.image_token_id
        pruned = [t for t in expected_ids if t != image_id or next(kept)]
        assert prompt.token_ids == pruned
    else:
        assert prompt.token_ids == expected_ids
    (ours,) = setup.engine.generate([prompt], GREEDY)
    assert ours.token_ids == setup.reference.greedy(expected_ids, media, rate, NUM_NEW_TOKENS)
    _assert_all_free(setup.engine)
    if os.environ.get("STILLCUT_REQUIRE_NATIVE_DECODE"):  # every token after the first
        assert native_steps == [1] * (NUM_NEW_TOKENS - 1), "a decode step ran the torch layers"


def test_all_at_once_in_small_chunks_equals_one_at_a_time(setup):
    engine = setup.engine
    prompts = []
    for name in CASES:
        parts, items, _, _ = _case(setup, name)
        prompts.append(engine.processor.build([{"role": "user", "content": parts}], items))
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    # 23 tokens a step: chunks end mid-Mamba2-chunk (16), mid-tubelet and mid-block (16); with
    # prefix caching on they would end on blocks (the hybrid prefix tests cover those)
    small = LLMEngine(engine.path, _config(max_num_batched_tokens=23, prefix_caching=False))
    together = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == alone
    _assert_all_free(small)


def test_preemption_recomputes_the_same_tokens_and_frees_everything(setup):
    engine = setup.engine
    parts, items, _, _ = _case(setup, "video without EVS")
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


def test_states_and_their_snapshots_fit_the_budget(setup):
    budget = 4 * 2**20
    sized = LLMEngine(
        setup.engine.path,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=2048),
            cache=CacheConfig(kv_cache_memory=budget, mamba_snapshot_interval=4),
        ),
    )
    runner = sized.runner
    num_blocks = sized.scheduler.kv_cache.num_blocks
    num_snapshots = sized.scheduler.kv_cache.snapshots.num_slots
    num_rows = len(runner.token_ids)  # running and live requests' rows
    state_bytes = sum(t[0].numel() * 4 for s in runner.recurrent_states.values() for t in s)
    block_bytes = sum(t.numel() * 4 for t in runner.kv_caches) // num_blocks
    assert all(len(t) == num_snapshots for s in runner.state_snapshots.values() for t in s)
    # one state per runner row first, then one snapshot per 4 blocks of what is left
    unit = 4 * block_bytes + state_bytes
    assert num_snapshots == (budget - num_rows * state_bytes) // unit > 0
    assert num_blocks >= 4 * num_snapshots
    assert (
        runner.num_kv_bytes == (num_rows + num_snapshots) * state_bytes + num_blocks * block_bytes
    )
    assert budget - block_bytes < runner.num_kv_bytes <= budget
