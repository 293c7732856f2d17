"""Prompt processing: placeholder expansion, parity with transformers' chat template, errors,
and the live-session prefix/suffix split."""

import json

import pytest
import torch

from stillcut.engine.chat_template import ChatTemplate
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.processor import PromptError, PromptProcessor
from stillcut.engine.request import PlaceholderRange, Request, placeholder_ranges

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656
PAD_TEXT = {"video": "<|video_pad|>", "image": "<|image_pad|>"}


def make_item(num_tokens: int, kind: str = "video", identifier: str = "media") -> MultiModalItem:
    return MultiModalItem(
        kind=kind,
        embeds=torch.zeros(num_tokens, 1),
        coords=torch.zeros(num_tokens, 3, dtype=torch.long),
        grid_thw=(2, 4, 4),
        identifier=identifier,
    )


@pytest.fixture(scope="module")
def processor(tiny_checkpoint):
    return PromptProcessor.from_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def hf_prompt_ids(hf_tokenizer, messages, items) -> list[int]:
    """transformers' template and tokenizer on the same messages, then each pad expanded."""
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    remaining, expanded = iter(items), []
    for token_id in ids:
        count = next(remaining).num_tokens if token_id in (IMAGE_PAD, VIDEO_PAD) else 1
        expanded.extend([token_id] * count)
    assert next(remaining, None) is None
    return expanded


MULTI_TURN = [
    {"role": "system", "content": "You watch videos.\n  Be brief."},
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]},
    {"role": "assistant", "content": "A red ball, left to right."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare with 这张图片 🎉:"},
            {"type": "image"},
            {"type": "video"},
        ],
    },
]


def test_placeholders_expand_to_item_token_counts(processor):
    items = [make_item(5, "video", "a"), make_item(3, "image", "b")]
    prompt = processor.build_text("What happens?", items)
    assert prompt.mm_positions == [PlaceholderRange(15, 5), PlaceholderRange(22, 3)]
    assert prompt.items == items
    for place, pad in zip(prompt.mm_positions, (VIDEO_PAD, IMAGE_PAD), strict=True):
        assert prompt.token_ids[place.offset : place.end] == [pad] * place.length
        assert prompt.token_ids[place.offset - 1] == VISION_START
        assert prompt.token_ids[place.end] == VISION_END
    assert sum(t in (IMAGE_PAD, VIDEO_PAD) for t in prompt.token_ids) == 8
    # The engine's own placement search agrees, and a Request accepts the prompt as built.
    assert placeholder_ranges(prompt.token_ids, items, {IMAGE_PAD, VIDEO_PAD}) == (
        prompt.mm_positions
    )
    Request("r", prompt.token_ids, prompt.items, prompt.mm_positions)


@pytest.mark.parametrize(
    "messages",
    [
        MULTI_TURN,
        MULTI_TURN[1:],  # no system message: the template adds its default one
        [{"role": "user", "content": "plain text, no media"}],
    ],
)
def test_rendering_matches_transformers_apply_chat_template(processor, hf_tokenizer, messages):
    kinds = [
        part["type"]
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] != "text"
    ]
    items = [make_item(2 + 3 * index, kind) for index, kind in enumerate(kinds)]
    assert processor.build(messages, items).token_ids == hf_prompt_ids(
        hf_tokenizer, messages, items
    )


def test_expanding_after_tokenizing_equals_tokenizing_expanded_text(processor, hf_tokenizer):
    items = [make_item(4, "image"), make_item(6, "video")]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Same?"}],
        }
    ]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for item in items:
        text = text.replace(PAD_TEXT[item.kind], PAD_TEXT[item.kind] * item.num_tokens)
    assert processor.build(messages, items).token_ids == processor.encode(text)
    assert processor.encode(text) == hf_tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    "messages, items, message",
    [
        (
            [{"role": "user", "content": [{"type": "video"}]}],
            [],
            r"1 media parts \(video\) but 0 items were given",
        ),
        (
            [{"role": "user", "content": "no media"}],
            [make_item(2)],
            r"0 media parts \(\) but 1 items were given \(video\)",
        ),
        (
            [{"role": "user", "content": [{"type": "image"}, {"type": "video"}]}],
            [make_item(2, "video"), make_item(2, "image")],
            "media part 0 is 'image' but item 0 is 'video'",
        ),
        (
            [{"role": "user", "content": [{"type": "video"}]}],
            [make_item(0)],
            "item 0 has no tokens",
        ),
        ([], [], "at least one message"),
        ([{"role": "tool", "content": "x"}], [], "role='tool': allowed system, user, assistant"),
        (
            [{"role": "user", "content": [{"type": "video_url"}]}],
            [],
            r"content\[0\].type='video_url': allowed text, video, image",
        ),
        ([{"role": "user", "content": 3}], [], "must be a string or a list of parts"),
        ([{"role": "user", "content": [{"type": "text"}]}], [], "text must be a string"),
        (
            [{"role": "user", "content": "look <|video_pad|>"}],
            [make_item(2)],
            "contains '<|video_pad|>'",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "<|vision_start|>"}]}],
            [],
            r"content\[0\].text contains '<\|vision_start\|>'",
        ),
    ],
)
def test_bad_messages_or_items_are_rejected(processor, messages, items, message):
    with pytest.raises(PromptError, match=message):
        processor.build(messages, items)


def test_live_session_prefix_plus_suffix_equals_build(processor):
    question = "What changed 刚才?"
    item = make_item(7)
    whole = processor.build(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}],
        [item],
    )
    prefix = processor.vision_prefix([item])
    assert prefix.token_ids + processor.ask_suffix(question) == whole.token_ids
    assert prefix.mm_positions == whole.mm_positions
    assert processor.ask_suffix(question)[0] == VISION_END


def test_live_session_tubelets_share_one_video_run(processor):
    tubelets = [make_item(3, identifier="t0"), make_item(2, identifier="t1")]
    empty = processor.vision_prefix()
    assert empty.token_ids[-1] == VISION_START and empty.items == []
    prefix = processor.vision_prefix(tubelets)
    start = len(empty.token_ids)
    assert prefix.token_ids == empty.token_ids + [VIDEO_PAD] * 5
    assert prefix.mm_positions == [PlaceholderRange(start, 3), PlaceholderRange(start + 3, 2)]
    whole = processor.build_text("Why?", [make_item(5)])
    assert prefix.token_ids + processor.ask_suffix("Why?") == whole.token_ids
    with pytest.raises(PromptError, match="must all be videos"):
        processor.vision_prefix([make_item(2, "image")])


def test_special_ids_come_from_the_checkpoint(processor):
    special = processor.special
    assert (special.image_token_id, special.video_token_id) == (IMAGE_PAD, VIDEO_PAD)
    assert (special.vision_start_token_id, special.vision_end_token_id) == (
        VISION_START,
        VISION_END,
    )
    assert special.eos_token_ids == (151645, 151643)  # generation_config order, no repeats


def test_chat_template_falls_back_to_tokenizer_config(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    config = {"chat_template": [{"name": "default", "template": template}], "bos_token": "<s>"}
    rendered = ChatTemplate.from_checkpoint(tmp_path, config).render(
        [{"role": "user", "content": "<a & b>"}]
    )
    assert rendered == '<s>"<a & b>"'  # tojson must not escape HTML characters
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json file"}))
    assert ChatTemplate.from_checkpoint(tmp_path, config).render([]) == "json file"


def test_missing_chat_template_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="has no chat template"):
        ChatTemplate.from_checkpoint(tmp_path, {})


def test_template_errors_name_the_cause():
    template = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="rejected the messages: only user turns"):
        template.render([{"role": "user", "content": "x"}])
