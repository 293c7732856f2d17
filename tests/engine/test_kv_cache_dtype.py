"""A bfloat16 K/V pool: twice the blocks for the same bytes, and logits near the float32 pool's.

One engine per pool dtype on the same checkpoint and budget. K and V are rounded to bf16 when
written and widened when read (the torch path for prefill, the native step for decode), so the
prefill logits (the first token's logprobs) and the decode logits after it stay within 1e-2 of
the float32 pool's, while the pool holds twice the tokens.
"""

from __future__ import annotations

import pytest
import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams

BUDGET = 1 << 20
TOLERANCE = 1e-2
NUM_LOGPROBS = 20
PROMPT = list(range(1000, 1000 + 37))  # token ids: a few blocks of prefill


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    def engine(kv_cache_dtype: str) -> LLMEngine:
        config = EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=256),  # no cap
            cache=CacheConfig(kv_cache_memory=BUDGET, block_size=16),
            kv_cache_dtype=kv_cache_dtype,
        )
        return LLMEngine(tiny_checkpoint, config)

    return {name: engine(name) for name in ("float32", "bfloat16")}


def test_a_bfloat16_pool_holds_twice_the_blocks(engines):
    wide, narrow = engines["float32"].memory, engines["bfloat16"].memory
    assert (wide.kv_cache_dtype, narrow.kv_cache_dtype) == ("float32", "bfloat16")
    assert narrow.kv_blocks == 2 * wide.kv_blocks
    assert narrow.kv_cache_bytes == wide.kv_cache_bytes <= BUDGET
    assert {c.dtype for c in engines["bfloat16"].runner.kv_caches} == {torch.bfloat16}


def test_prefill_and_decode_logits_stay_near_the_float32_pool(engines):
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=NUM_LOGPROBS)
    outputs = {name: engine.generate([PROMPT], params)[0] for name, engine in engines.items()}
    wide, narrow = outputs["float32"], outputs["bfloat16"]
    assert narrow.token_ids == wide.token_ids
    differences = []
    for (wide_ids, wide_values, _), (narrow_ids, narrow_values, _) in zip(
        wide.logprobs, narrow.logprobs, strict=True
    ):
        # the same top tokens (ties aside), compared by id: [0] prefill, then each decode
        common = sorted(set(wide_ids[:10]) & set(narrow_ids))
        assert len(common) >= 8
        by_id = dict(zip(narrow_ids, narrow_values, strict=True))
        wide_by_id = dict(zip(wide_ids, wide_values, strict=True))
        differences.append(max(abs(wide_by_id[i] - by_id[i]) for i in common))
    assert len(differences) == 8
    assert max(differences) < TOLERANCE
    assert max(differences) > 0  # the pools really differ
