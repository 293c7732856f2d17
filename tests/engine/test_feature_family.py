"""A family whose tower hands the language model extra feature sets, registered from a test.

The family is one folder (`toy_deepstack/`, copied into the test's tmp dir and put on the path)
and one `register` call; no stillcut file knows it. Its tower gives two DeepStack-like feature
sets beside the embeddings and its language model adds them at the visual positions after its
first two layers. Its greedy answers equal a plain full-sequence reference of the same weights
(transformers' Qwen2.5-VL plus the sums) for a video question (EVS on: the feature sets are
pruned by the embeddings' mask), a chat question, a second question on the cached video (a
prefix hit ending inside the video), prefill chunks that split the video and a tubelet appended
to a running request; so do the first sampled token's logits, which each feature set moves.
"""

import importlib
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.families import FAMILIES
from stillcut.engine.processor import Prompt
from stillcut.engine.request import PlaceholderRange, SamplingParams
from stillcut.kernels.evs import EVSConfig, prune
from stillcut.vision.pipeline import VisionPipeline

FAMILY_FOLDER = Path(__file__).parent / "toy_deepstack"
BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
EVS = EVSConfig(mode="rate", rate=0.5)


def _config(max_num_batched_tokens: int = 512, prefix_caching: bool = True) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048
        ),
        cache=CacheConfig(num_blocks=256, block_size=BLOCK, enable_prefix_caching=prefix_caching),
    )


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """The family's package (imported from the tmp dir) and its tiny checkpoint, registered
    for this module's tests only."""
    root = tmp_path_factory.mktemp("family")
    shutil.copytree(FAMILY_FOLDER, root / "src" / "toy_deepstack")
    sys.path.insert(0, str(root / "src"))
    try:
        package = importlib.import_module("toy_deepstack")
        checkpoint = importlib.import_module("toy_deepstack.checkpoint")
        folder = checkpoint.build_checkpoint(root / "checkpoint", seed=3)
        with FAMILIES.registered(package.ENTRY):
            yield package, folder
    finally:
        sys.path.remove(str(root / "src"))
        for name in [n for n in sys.modules if n.split(".")[0] == "toy_deepstack"]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def setup(family):
    package, folder = family
    reference = importlib.import_module("toy_deepstack.reference").Reference(folder)
    return package, folder, VisionPipeline(folder), LLMEngine(folder, _config()), reference


@pytest.fixture(scope="module")
def video(setup):
    """Frames of a video spanning several KV blocks once pruned, and its item."""
    _, _, pipeline, _, _ = setup
    frames = np.random.default_rng(5).integers(0, 256, (8, 112, 168, 3), dtype=np.uint8)
    return frames, pipeline.video(frames, evs=EVS, frames_fps=2.0)


def _ask(engine: LLMEngine, question: str, item):
    """A user message: a lead-in, the video, the question (the lead-in places the video so that
    a hit rounded down to a block boundary ends inside it)."""
    parts = [{"type": "text", "text": "Watch this:"}, {"type": "video"}]
    parts.append({"type": "text", "text": question})
    return engine.processor.build([{"role": "user", "content": parts}], [item])


def _expected(setup, prompt, frames=None, max_tokens: int = GREEDY.max_tokens):
    """The reference's greedy answer to `prompt` (its video from `frames`), and its logits
    of the first sampled token with the features as computed and zeroed (see `_zeroed`)."""
    _, _, pipeline, engine, reference = setup
    ids = torch.tensor(prompt.token_ids)
    positions, next_position = engine.model.prompt_positions(ids, prompt.items)
    visual = torch.zeros(len(ids), dtype=torch.bool)
    hidden = engine.model.config.hidden_size
    embeds = torch.zeros(0, hidden)
    if frames is not None:
        (item,), (place,) = prompt.items, prompt.mm_positions
        visual[place.offset : place.end] = True
        prepared = pipeline.media.prepare_video(frames, 2.0)
        dense = reference.video_embeddings(prepared.patches, prepared.grid_thw)
        embeds = dense[prune(dense, item.llm_grid, EVS).kept_index]  # [kept, hidden]
    features = reference.deepstack(embeds)
    answer = reference.greedy(
        prompt.token_ids, positions, next_position, visual, embeds, features, max_tokens
    )
    logits = reference.logits(prompt.token_ids, positions, visual, embeds, features)[-1]
    zero_logits = [
        reference.logits(prompt.token_ids, positions, visual, embeds, zeroed)[-1]
        for zeroed in _zeroed(features)
    ]
    return answer, logits, zero_logits


def _zeroed(features: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The feature sets with all of them zero, then with each one alone zero."""
    zeros = [torch.zeros_like(f) for f in features]
    alone = [[*features[:k], zeros[k], *features[k + 1 :]] for k in range(len(features))]
    return [zeros, *alone]


def _first_logits(engine: LLMEngine, prompt) -> tuple[list[int], torch.Tensor]:
    """The engine's greedy answer to `prompt` and the logits it sampled the first token from."""
    seen = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    try:
        (output,) = engine.generate([prompt], GREEDY)
    finally:
        del engine.model.compute_logits
    return output, seen[0][-1]


def test_the_tower_gives_feature_sets_pruned_by_the_embeddings_mask(setup, video):
    package, folder, pipeline, _, reference = setup
    frames, item = video
    assert sorted(item.features) == sorted(package.FEATURES)
    assert item.num_tokens < item.num_dense_tokens  # EVS pruned
    for name, expected in zip(package.FEATURES, reference.deepstack(item.embeds), strict=True):
        torch.testing.assert_close(item.features[name], expected, atol=1e-5, rtol=1e-5)
    # the encoder cache holds them before EVS: another pruning setting prunes them again
    again = pipeline.video(frames, evs=EVSConfig(mode="rate", rate=0.25), frames_fps=2.0)
    assert again.stats["cache_hit"] and again.num_tokens > item.num_tokens
    for name, expected in zip(package.FEATURES, reference.deepstack(again.embeds), strict=True):
        torch.testing.assert_close(again.features[name], expected, atol=1e-5, rtol=1e-5)


def test_video_and_chat_answers_equal_the_reference(setup, video):
    _, _, _, engine, _ = setup
    frames, item = video
    prompt = engine.processor.build_text("What happens in this video?", [item])
    output, logits = _first_logits(engine, prompt)
    answer, expected_logits, zero_logits = _expected(setup, prompt, frames)
    assert output.token_ids == answer
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)
    # the features matter, each of them: without it the first step's logits are far from these
    for other in zero_logits:
        assert (expected_logits - other).abs().max() > 1e-3
    zero_logits = zero_logits[0]  # all of them zero
    zeroed = replace(
        item,
        identifier=item.identifier + "/zeros",  # its K/V differ: not the cached prefix
        features={name: torch.zeros_like(f) for name, f in item.features.items()},
    )
    zeroed_prompt = engine.processor.build_text("What happens in this video?", [zeroed])
    _, engine_zero_logits = _first_logits(engine, zeroed_prompt)
    torch.testing.assert_close(engine_zero_logits, zero_logits, atol=1e-4, rtol=1e-4)
    assert (logits - engine_zero_logits).abs().max() > 1e-3

    chat = engine.processor.build([{"role": "user", "content": "Who are you, and why?"}])
    (output,) = engine.generate([chat], GREEDY)
    assert output.token_ids == _expected(setup, chat)[0]


def test_a_second_question_resumes_inside_the_cached_video(setup, video):
    _, _, _, engine, _ = setup
    frames, item = video
    engine.generate([_ask(engine, "What happens in this video?", item)], GREEDY)
    prompt = _ask(engine, "Which colours do you see?", item)
    output, logits = _first_logits(engine, prompt)
    (place,) = prompt.mm_positions
    cached = output.metrics.num_cached_tokens
    assert cached >= BLOCK and place.offset < cached < place.end  # a hit ending inside the item
    answer, expected_logits, _ = _expected(setup, prompt, frames)
    assert output.token_ids == answer
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_prefill_chunks_that_split_the_video_leave_the_answer_unchanged(setup, video):
    _, folder, _, engine, _ = setup
    frames, item = video
    prompt = engine.processor.build_text("What happens in this video?", [item])
    chunked = LLMEngine(folder, _config(max_num_batched_tokens=BLOCK, prefix_caching=False))
    (place,) = prompt.mm_positions
    assert place.length > 2 * BLOCK  # the video is split over at least three chunks
    output, logits = _first_logits(chunked, prompt)
    answer, expected_logits, _ = _expected(setup, prompt, frames)
    assert output.token_ids == answer
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=1e-4)


def test_a_tubelet_appended_to_a_running_request_brings_its_features(setup):
    """Streaming input: the appended video's features reach the step that computes it."""
    _, _, pipeline, engine, _ = setup
    frames = np.random.default_rng(6).integers(0, 256, (2, 112, 168, 3), dtype=np.uint8)
    item = pipeline.video(frames, frames_fps=2.0)
    segment = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = engine.processor.build_text("Narrate what you see.")
    request_id = engine.add_request(prompt, segment, streaming=True)
    _run_segment(engine, request_id)
    sequence = [*prompt.token_ids, *engine.scheduler.requests[request_id].output_token_ids]
    special = engine.processor.special
    text = engine.processor.encode("<0.0s>")
    pads = [special.video_token_id] * item.num_tokens
    place = PlaceholderRange(len(sequence) + len(text) + 1, item.num_tokens)
    sequence += [*text, special.vision_start_token_id, *pads, special.vision_end_token_id]
    seen = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    try:
        engine.append_input(request_id, sequence[-(len(text) + item.num_tokens + 2) :], [item])
        outputs = _run_segment(engine, request_id)
    finally:
        del engine.model.compute_logits
        engine.abort(request_id)
        engine.step()
    whole = Prompt(sequence, [item], [place])
    answer, expected_logits, _ = _expected(setup, whole, frames, segment.max_tokens)
    assert list(outputs[-1].token_ids) == answer
    torch.testing.assert_close(seen[0][-1], expected_logits, atol=1e-4, rtol=1e-4)


def _run_segment(engine: LLMEngine, request_id: str) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_an_item_without_the_consumed_features_is_refused_at_admission(setup, video):
    _, _, _, engine, _ = setup
    _, item = video
    plain = replace(item, features={})
    prompt = engine.processor.build_text("What happens in this video?", [plain])
    with pytest.raises(
        ValueError, match=r"lacks the feature sets \['deepstack.0', 'deepstack.1'\]"
    ):
        engine.add_request(prompt, GREEDY)
    assert not engine.has_unfinished_requests()
