"""Cache groups: KV-pool sizing from attention and recurrent layers, and the runner's caches."""

import pytest
import torch

from stillcut.engine.cache_groups import (
    AttentionGroup,
    RecurrentGroup,
    check_cache_groups,
    num_blocks_for_budget,
)
from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.models.qwen2_vl.model import Qwen2LanguageModel
from stillcut.engine.runner import ModelRunner

# one block: 2 (k, v) * 2 layers * 16 tokens * 4 heads * 8 dims * 2 bytes = 4096 bytes
ATTENTION = AttentionGroup((0, 2), num_kv_heads=4, head_dim=8)
# one request: 2 layers * (3 * 5 + 2 * 4 * 8) floats * 2 bytes = 316 bytes
RECURRENT = RecurrentGroup((1, 3), state_shapes=((3, 5), (2, 4, 8)))


def test_blocks_for_a_budget_count_every_attention_layer():
    assert num_blocks_for_budget(10 * 4096 + 4095, [ATTENTION], block_size=16, dtype_bytes=2) == 10
    with pytest.raises(ValueError, match="holds no KV block: one block needs 4096 bytes"):
        num_blocks_for_budget(4095, [ATTENTION], block_size=16, dtype_bytes=2)


def test_recurrent_state_is_taken_from_the_budget_first():
    groups = [ATTENTION, RECURRENT]
    budget = 10 * 4096 + 8 * 316
    assert num_blocks_for_budget(budget, groups, block_size=16, dtype_bytes=2) == 10
    assert (
        num_blocks_for_budget(budget, groups, block_size=16, dtype_bytes=2, num_state_slots=8) == 10
    )
    assert (
        num_blocks_for_budget(budget, groups, block_size=16, dtype_bytes=2, num_state_slots=9) == 9
    )
    with pytest.raises(ValueError, match="after 3160 bytes of recurrent state in 10 slots"):
        num_blocks_for_budget(3160 + 4095, groups, block_size=16, dtype_bytes=2, num_state_slots=10)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([ATTENTION, AttentionGroup((2,), 1, 8)], "each of the 4 layers belongs to at most one"),
        ([AttentionGroup((0, 4), 1, 8)], "each of the 4 layers"),
        ([RECURRENT], "at least one attention cache group"),
    ],
)
def test_groups_must_partition_the_layers(groups, message):
    with pytest.raises(ValueError, match=message):
        check_cache_groups(groups, num_layers=4)


def test_groups_refuse_bad_shapes():
    with pytest.raises(ValueError, match="distinct, ascending"):
        AttentionGroup((1, 0), 1, 8)
    with pytest.raises(ValueError, match="sliding_window=0"):
        AttentionGroup((0,), 1, 8, sliding_window=0)
    with pytest.raises(ValueError, match="non-empty positive shapes"):
        RecurrentGroup((0,), ((0, 4),))


def test_the_runner_allocates_paged_kv_per_attention_layer_and_state_per_row():
    folder = cached_checkpoint("tiny")
    (group,) = load_model_config(folder).cache_groups
    assert group.layer_ids == (0, 1) and (group.num_kv_heads, group.head_dim) == (2, 8)
    model = Qwen2LanguageModel.from_checkpoint(folder)
    # the tiny model has two attention layers; give one to a recurrent group to see both kinds
    groups = [AttentionGroup((0,), 2, 8), RecurrentGroup((1,), ((3, 5), (4,)))]
    runner = ModelRunner(
        model, groups, num_blocks=6, block_size=16, max_num_reqs=3,
        max_num_batched_tokens=32, max_model_len=64,
    )  # fmt: skip
    assert [tuple(c.shape) for c in runner.kv_caches] == [(2, 6, 16, 2, 8)]
    assert [tuple(t.shape) for t in runner.recurrent_states[1]] == [(3, 3, 5), (3, 4)]
    assert runner.num_kv_bytes == 4 * (2 * 6 * 16 * 2 * 8 + 3 * 15 + 3 * 4)
    assert all(t.dtype == torch.float32 for t in runner.recurrent_states[1])
