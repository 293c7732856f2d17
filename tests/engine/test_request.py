"""Engine configs, sampling parameters and requests: validation and placeholder placement."""

import pytest
import torch

from stillcut.engine.config import CacheConfig, SchedulerConfig
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.outputs import Snapshot
from stillcut.engine.request import (
    PlaceholderRange,
    Request,
    RequestStatus,
    SamplingParams,
    placeholder_ranges,
)

IMAGE_PAD, VIDEO_PAD = 151655, 151656


def make_item(num_tokens: int, identifier: str = "media", kind: str = "video") -> MultiModalItem:
    return MultiModalItem(
        kind=kind,
        embeds=torch.zeros(num_tokens, 1),
        coords=torch.zeros(num_tokens, 3, dtype=torch.long),
        grid_thw=(1, 2, 2),
        identifier=identifier,
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, r"max_tokens=0 must be in \[1, 2147483647\]"),
        ("max_tokens", 2**63, r"max_tokens=9223372036854775808 must be in \[1, "),
        ("max_tokens", 2.5, "max_tokens=2.5 must be an int"),
        ("temperature", -0.1, r"temperature=-0.1 must be in \[0, 100\]"),
        ("temperature", float("nan"), r"temperature=nan must be in \[0, 100\]"),
        ("temperature", 1e308, r"temperature=1e\+308 must be in \[0, 100\]"),
        ("top_p", 0.0, r"top_p=0.0 must be in \(0, 1\]"),
        ("top_k", -1, r"top_k=-1 must be in \[0, 2147483647\] \(0 = off\)"),
        ("top_k", 2**63, r"top_k=9223372036854775808 must be in \[0, 2147483647\]"),
        ("min_p", 1.5, r"min_p=1.5 must be in \[0.0, 1.0\]"),
        ("seed", -3, r"seed=-3 must be in \[0, 2\*\*64 - 1\]"),
        ("repetition_penalty", 0.0, r"repetition_penalty=0.0 must be in \[0.01, 100\]"),
        ("repetition_penalty", 1e-300, r"repetition_penalty=1e-300 must be in \[0.01, 100\]"),
        ("presence_penalty", 2.5, r"presence_penalty=2.5 must be in \[-2.0, 2.0\]"),
        ("frequency_penalty", -3.0, r"frequency_penalty=-3.0 must be in \[-2.0, 2.0\]"),
        ("stop", ("ok", ""), "stop=.* must hold non-empty strings only"),
        ("stop_token_ids", (3, -1), r"stop_token_ids=\(3, -1\) must hold ints in \[0, "),
        ("stop_token_ids", (2**64,), r"stop_token_ids=\(18446744073709551616,\) must hold"),
        ("logprobs", 21, r"logprobs=21 must be in \[0, 20\]"),
    ],
)
def test_sampling_params_reject_out_of_range_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_sampling_params_store_tuples():
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])
    assert params.stop == ("a", "b") and params.stop_token_ids == (1, 2)
    assert SamplingParams(stop="end").stop == ("end",)
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2)))


@pytest.mark.parametrize(
    "config, kwargs, message",
    [
        (CacheConfig, {"block_size": 12}, r"block_size=12 must be a power of two in \[1, 1024\]"),
        (CacheConfig, {"num_blocks": 0}, "num_blocks=0 must be >= 1 or None"),
        (CacheConfig, {"num_blocks": 4, "kv_cache_memory": 8}, "set at most one of"),
        (CacheConfig, {"memory_fraction": 0.0}, r"memory_fraction=0.0 must be in \(0, 1\]"),
        (CacheConfig, {"held_share": 1.5}, r"held_share=1.5 must be in \[0, 1\]"),
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs=0 must be >= 1"),
        (SchedulerConfig, {"max_visual_tokens_per_request": -1}, "must be >= 0"),
        (
            SchedulerConfig,
            {"max_prefill_tokens_per_request": 0},
            r"max_prefill_tokens_per_request=0 must be None or in \[1, max_num_batched_tokens=",
        ),
        (
            SchedulerConfig,
            {"max_prefill_tokens_per_request": 4096},
            r"max_prefill_tokens_per_request=4096 must be None or in \[1, ",
        ),
        (
            SchedulerConfig,
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 100},
            "max_num_batched_tokens=100 must be >= max_model_len=32768 when",
        ),
    ],
)
def test_configs_reject_out_of_range_fields(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(**kwargs)


def test_placeholder_ranges_split_one_run_between_consecutive_items():
    tokens = [1, VIDEO_PAD, VIDEO_PAD, VIDEO_PAD, VIDEO_PAD, VIDEO_PAD, 2, IMAGE_PAD, IMAGE_PAD, 3]
    items = [make_item(2, "t0"), make_item(3, "t1"), make_item(2, "img", "image")]
    ranges = placeholder_ranges(tokens, items, {IMAGE_PAD, VIDEO_PAD})
    assert ranges == [(1, 2), (3, 3), (7, 2)]
    with pytest.raises(ValueError, match="item 1 needs 4 consecutive placeholder tokens"):
        placeholder_ranges(tokens, [make_item(2), make_item(4)], {VIDEO_PAD, IMAGE_PAD})
    with pytest.raises(ValueError, match="placeholder tokens after index 6 but no item"):
        placeholder_ranges(tokens, items[:2], {IMAGE_PAD, VIDEO_PAD})


def test_request_validates_its_placements():
    tokens = [1, VIDEO_PAD, VIDEO_PAD, 2]
    request = Request("r", tokens, [make_item(2)], [PlaceholderRange(1, 2)])
    assert request.status is RequestStatus.WAITING and request.num_visual_tokens == 2
    with pytest.raises(ValueError, match="1 mm_items but 0 mm_positions"):
        Request("r", tokens, [make_item(2)], [])
    with pytest.raises(ValueError, match=r"mm_positions\[0\].length=3 must equal"):
        Request("r", tokens, [make_item(2)], [PlaceholderRange(1, 3)])
    with pytest.raises(ValueError, match=r"mm_positions\[0\]=\(3, 2\) must lie in \[0, 4\]"):
        Request("r", tokens, [make_item(2)], [PlaceholderRange(3, 2)])
    with pytest.raises(ValueError, match="mm item 0 has no identifier"):
        Request("r", tokens, [make_item(2, identifier="")], [PlaceholderRange(1, 2)])
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty"):
        Request("r", [])


def test_append_input_shifts_placements_and_is_all_or_nothing():
    request = Request("r", [1, VIDEO_PAD, VIDEO_PAD], [make_item(2, "t0")], [(1, 2)], hold=True)
    with pytest.raises(ValueError, match=r"mm_positions\[0\]=\(4, 2\) must lie in \[3, 5\]"):
        request.append_input([VIDEO_PAD, VIDEO_PAD], [make_item(2, "t1")], [(1, 2)])
    assert request.num_prompt_tokens == 3 and len(request.mm_items) == 1
    assert request.append_input([VIDEO_PAD, VIDEO_PAD, 7], [make_item(2, "t1")], [(0, 2)]) == 3
    assert request.mm_positions == [(1, 2), (3, 2)] and request.num_visual_tokens == 4
    assert request.all_token_ids == [1, VIDEO_PAD, VIDEO_PAD, VIDEO_PAD, VIDEO_PAD, 7]


def test_append_input_turns_the_output_so_far_into_prompt():
    request = Request("r", [1, 2], streaming=True)
    request.output_token_ids.extend([3, 4])
    shown = Snapshot(request.output_token_ids)
    assert request.append_input([VIDEO_PAD, 9], [make_item(1, "t0")], [(0, 1)]) == 4
    assert request.prompt_token_ids == [1, 2, 3, 4, VIDEO_PAD, 9]
    assert request.output_token_ids == [] and shown == [3, 4]  # earlier outputs stay as shown
    assert request.mm_positions == [(4, 1)]


def test_token_ids_between_reads_across_prompt_and_output():
    request = Request("r", [1, 2, 3])
    request.output_token_ids.extend([4, 5])
    for start in range(6):
        for end in range(start, 6):
            assert request.token_ids_between(start, end) == request.all_token_ids[start:end]
