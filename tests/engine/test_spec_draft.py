"""The draft-model proposer: exact outputs whatever the draft, and refusals at start.

A draft that is a copy of the target has every draft accepted; a copy with a perturbed head
has some accepted and some rejected, and an unrelated random draft none, with outputs equal to
decoding without speculation in every case (batched, with chunked prefill; an image prompt in
the batch gets no drafts). A draft whose tokenizer or preprocessing differs, or that is larger
than the target, is refused with a message that says what is allowed.
"""

import numpy as np
import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.layers import set_weight
from stillcut.engine.request import SamplingParams
from stillcut.engine.spec_decode.draft import DraftMismatch
from stillcut.vision.pipeline import ImageInput, VisionPipeline

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
WIDE = {"initializer_range": 0.2}  # a tiny Qwen whose greedy text varies


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
    return path, prompts, expected


def _assert_pool_whole(engine):
    for kv in (engine.scheduler.kv_cache, engine.speculator.proposer.kv_cache):
        kv.check_consistency()
        assert kv.num_free_blocks == len(kv.block_pool.blocks)


def test_a_copy_of_the_target_has_every_draft_accepted(target):
    path, prompts, expected = target
    engine = LLMEngine(path, _config(draft=path))
    outputs = engine.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outputs] == expected[:2]
    for output in outputs:
        assert output.metrics.num_accepted_tokens == output.metrics.num_draft_tokens > 0
    _assert_pool_whole(engine)


def test_a_perturbed_copy_and_an_unrelated_draft_give_exact_outputs(target):
    path, prompts, expected = target
    engine = LLMEngine(path, _config(draft=path))
    draft_model = engine.speculator.proposer.model
    noise = torch.randn(draft_model.lm_head.shape, generator=torch.Generator().manual_seed(0))
    set_weight(draft_model, "lm_head", draft_model.lm_head + 0.02 * noise)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert 0 < accepted < drafted, (drafted, accepted)
    assert outputs[2].metrics.num_draft_tokens == 0  # the image prompt: no draft embeddings
    _assert_pool_whole(engine)

    unrelated = cached_checkpoint("tiny", seed=1, family="qwen2_5_vl", text=WIDE)
    engine = LLMEngine(path, _config(draft=unrelated))
    outputs = engine.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outputs] == expected[:2]
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
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
    path, _, _ = target
    with pytest.raises(DraftMismatch, match=message):
        LLMEngine(path, _config(draft=cached_checkpoint("tiny", seed=2, **draft)))


def test_a_model_with_recurrent_layers_refuses_speculation():
    path = cached_checkpoint("tiny", family="nemotron_h_omni")
    config = EngineConfig(
        scheduler=SchedulerConfig(max_model_len=512),
        cache=CacheConfig(num_blocks=64),
        speculative=SpeculativeConfig(dynamic=False),
    )
    with pytest.raises(ValueError, match="recurrent layers"):
        LLMEngine(path, config)
