"""LLMEngine's outputs: why a request finished, and seeded sampling whatever shares the batch."""

from contextlib import contextmanager

import pytest

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams

BLOCK = 16


def _engine(path, num_blocks: int = 256, budget: int = 512) -> LLMEngine:
    return LLMEngine(
        path,
        EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=1024),
            cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK, held_share=0.0),
        ),
    )


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return _engine(tiny_checkpoint)


@contextmanager
def _always_says(engine: LLMEngine, token_id: int):
    """Make the model's greedy choice `token_id` at every step."""
    compute_logits = engine.model.compute_logits

    def forced(hidden):
        logits = compute_logits(hidden)
        logits[:, token_id] = logits.max() + 10.0
        return logits

    engine.model.compute_logits = forced
    try:
        yield
    finally:
        del engine.model.compute_logits


def test_finish_and_stop_reasons_follow_the_openai_convention(engine):
    """EOS (any of the checkpoint's eos ids) stops with stop_reason None; a stop token id or
    a stop string is the stop_reason; running out of tokens is "length"."""
    eos_ids = engine.eos_token_ids
    assert len(eos_ids) == 2  # <|im_end|>, and <|endoftext|> from generation_config.json
    prompt = [9, 8, 7]
    stop_id = 300
    text = engine.processor.tokenizer.decode([stop_id])
    cases = {
        (eos_ids[0], SamplingParams(max_tokens=4)): ("stop", None),
        (eos_ids[1], SamplingParams(max_tokens=4)): ("stop", None),
        (eos_ids[0], SamplingParams(max_tokens=4, ignore_eos=True)): ("length", None),
        (stop_id, SamplingParams(max_tokens=4, stop_token_ids=(stop_id,))): ("stop", stop_id),
        (stop_id, SamplingParams(max_tokens=4, stop=(text,))): ("stop", text),
        (stop_id, SamplingParams(max_tokens=2)): ("length", None),
    }
    for (token_id, params), expected in cases.items():
        with _always_says(engine, token_id):
            (output,) = engine.generate([prompt], params)
        assert (output.finish_reason, output.stop_reason) == expected, (token_id, params)
