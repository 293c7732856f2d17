"""Gemma 3 prompts: image sequences expanded as transformers' Gemma3Processor expands them,
videos as frames (with timestamps for a template that prints them, 0-token frames kept as
markers), the errors a user can cause, the text config in both spellings, and detokenizing
Gemma's byte-fallback output."""

import json
import shutil

import pytest
import torch

from stillcut.engine.chat_template import ChatTemplate
from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.detokenizer import IncrementalDetokenizer, detokenize
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.models.gemma3.positions import gemma3_positions
from stillcut.engine.models.gemma3.text_config import gemma3_text_config
from stillcut.engine.models.gemma3.tokenizer import CHAT_TEMPLATE
from stillcut.engine.models.matmul import head_matrix
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.processor import PromptError, PromptProcessor

BOI, EOI, SOFT = 7, 8, 9
TOKENS_PER_IMAGE = 16


@pytest.fixture(scope="module")
def checkpoint():
    return cached_checkpoint("tiny", family="gemma3")


@pytest.fixture(scope="module")
def processor(checkpoint):
    return PromptProcessor.from_checkpoint(checkpoint)


def image(identifier: str = "image") -> MultiModalItem:
    return MultiModalItem(
        kind="image",
        embeds=torch.zeros(TOKENS_PER_IMAGE, 1),
        coords=_coords([TOKENS_PER_IMAGE]),
        grid_thw=(1, 4, 4),
        merge_size=1,
        identifier=identifier,
        bidirectional=True,
    )


def video(kept_per_frame: list[int]) -> MultiModalItem:
    """A video item as the pipeline makes it: frame f keeps its first `kept_per_frame[f]`."""
    return MultiModalItem(
        kind="video",
        embeds=torch.zeros(sum(kept_per_frame), 1),
        coords=_coords(kept_per_frame),
        grid_thw=(len(kept_per_frame), 4, 4),
        merge_size=1,
        timestamps=tuple(0.5 * f for f in range(len(kept_per_frame))),
        identifier="clip",
        bidirectional=True,
        kept_per_tubelet=tuple(kept_per_frame),
    )


def _coords(kept_per_frame: list[int]) -> torch.Tensor:
    rows = [(f, i // 4, i % 4) for f, n in enumerate(kept_per_frame) for i in range(n)]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def test_conversation_equals_gemma3_processor(processor, checkpoint):
    from PIL import Image
    from transformers import AutoProcessor

    pictures = [Image.new("RGB", (32, 32), colour) for colour in ("red", "blue")]
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": "You describe pictures."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Here:"},
                {"type": "image", "image": pictures[0]},
                {"type": "text", "text": " and\n\nthere"},
                {"type": "image", "image": pictures[1]},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Two squares."}]},
        {"role": "user", "content": [{"type": "text", "text": "Which colours?"}]},
    ]
    theirs = AutoProcessor.from_pretrained(checkpoint).apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    plain = [
        {**m, "content": [{k: v for k, v in p.items() if k != "image"} for p in m["content"]]}
        for m in conversation
    ]
    prompt = processor.build(plain, [image("red"), image("blue")])
    assert prompt.token_ids == theirs
    assert [tuple(p) for p in prompt.mm_positions] == [
        (i + 1, TOKENS_PER_IMAGE) for i, t in enumerate(theirs) if t == BOI
    ]


def test_a_video_is_its_frames_each_wrapped_in_image_markers(processor):
    prompt = processor.build_text("What moved?", [video([16, 0, 5])])
    frames = prompt.items
    assert [f.num_tokens for f in frames] == [16, 0, 5]
    assert [f.grid_thw for f in frames] == [(1, 4, 4)] * 3
    assert len({f.identifier for f in frames}) == 3
    assert all(bool((f.coords[:, 0] == 0).all()) for f in frames)
    ids = prompt.token_ids
    assert ids.count(BOI) == ids.count(EOI) == 3 and ids.count(SOFT) == 21
    for frame, place in zip(frames, prompt.mm_positions, strict=True):
        assert ids[place.offset - 1] == BOI and ids[place.end] == EOI
        assert ids[place.offset : place.end] == [SOFT] * frame.num_tokens


def test_positions_count_the_unpruned_frames(processor):
    prompt = processor.build_text("What moved?", [video([16, 0, 5])])
    ids = torch.tensor(prompt.token_ids)
    positions, next_position = gemma3_positions(
        ids, prompt.items, None, image_token_id=SOFT, boi_token_id=BOI
    )
    explicit, _ = gemma3_positions(
        ids, prompt.items, prompt.mm_positions, image_token_id=SOFT, boi_token_id=BOI
    )
    assert positions.tolist() == explicit.tolist()  # items follow their <start_of_image>
    dropped = 0
    for frame, place in zip(prompt.items, prompt.mm_positions, strict=True):
        start = place.offset + dropped  # where the unpruned frame starts
        kept = positions[0, place.offset : place.end].tolist()
        assert kept == list(range(start, start + frame.num_tokens))  # each keeps its first n
        assert positions[0, place.end] == start + TOKENS_PER_IMAGE  # its <end_of_image>
        dropped += TOKENS_PER_IMAGE - frame.num_tokens
    assert next_position == len(prompt.token_ids) + dropped == positions[0, -1] + 1
    with pytest.raises(ValueError, match="must sit on 16 image tokens"):
        gemma3_positions(ids, [image()], [(0, 16)], image_token_id=SOFT, boi_token_id=BOI)


def test_a_template_that_asks_for_timestamps_gets_each_frame_time(processor):
    printing = CHAT_TEMPLATE.replace(
        "{% if item['type'] == 'image' %}",
        "{% if item['type'] == 'image' %}{% if item['timestamp'] is defined %}"
        "{{ 'at %.1f s:' % item['timestamp'] }}{% endif %}",
    )
    template = ChatTemplate(printing, {"bos_token": "<bos>"})
    timed = PromptProcessor(processor.tokenizer, template, processor.special, processor.family)
    text = timed.tokenizer.decode(timed.build_text("Go.", [video([16, 16])]).token_ids)
    assert "at 0.0 s:" in text and "at 0.5 s:" in text
    # Gemma 3's own template prints no time, and an image has none to print
    assert "s:" not in processor.tokenizer.decode(
        processor.build_text("Go.", [video([16])]).token_ids
    )
    assert "s:" not in timed.tokenizer.decode(timed.build_text("Go.", [image()]).token_ids)


@pytest.mark.parametrize(
    ("content", "items", "message"),
    [
        ([{"type": "video"}], [image()], "media part 0 is 'video' but item 0 is 'image'"),
        ([{"type": "image"}], [], "1 media parts"),
        ([{"type": "text", "text": "a <start_of_image> b"}], [], "contains '<start_of_image>'"),
        ([{"type": "text", "text": "<image_soft_token>"}], [], "contains '<image_soft_token>'"),
    ],
)
def test_bad_prompts_are_rejected(processor, content, items, message):
    with pytest.raises(PromptError, match=message):
        processor.build([{"role": "user", "content": content}], items)


def test_live_sessions_need_a_video_token(processor):
    with pytest.raises(PromptError, match="not supported for 'gemma3'.*frames of images"):
        processor.ask_suffix("What now?")
    with pytest.raises(PromptError, match="not supported for 'gemma3'"):
        processor.vision_prefix([video([16])])
    assert processor.special.video_token_id is None
    assert processor.special.eos_token_ids == (1, 6)


def test_text_config_reads_both_spellings(checkpoint, tmp_path):
    from transformers import Gemma3TextConfig

    legacy = {
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
        "rope_theta": 500_000.0,
        "rope_local_base_freq": 20_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }
    ours = gemma3_text_config(_with_text(checkpoint, tmp_path / "legacy", legacy))
    theirs = Gemma3TextConfig(**legacy)  # transformers' reading of the same fields
    assert list(ours.layer_types) == theirs.layer_types
    for kind, rope in ours.rope.items():
        expected = theirs.rope_parameters[kind]
        assert (rope.theta, rope.factor) == (expected["rope_theta"], expected.get("factor", 1.0))
    assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope type 'yarn'"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
    ],
)
def test_unsupported_text_configs_fail_clearly(checkpoint, tmp_path, change, message):
    text = json.loads((checkpoint / "config.json").read_text())["text_config"]
    with pytest.raises(CheckpointError, match=message):
        gemma3_text_config(_with_text(checkpoint, tmp_path / "bad", {**text, **change}))


def _with_text(checkpoint, folder, text):
    folder.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "text_config": text}))
    return load_model_config(folder)


def test_soft_caps_from_the_config_are_applied(checkpoint, tmp_path):
    """transformers' Gemma3ForConditionalGeneration ignores both caps (no Gemma 3 release sets
    them), so there is no reference to equal: the final cap must be `cap * tanh(x / cap)` of
    the uncapped logits, and the attention cap must reach every layer."""
    from stillcut.engine.models.gemma3.model import Gemma3LanguageModel

    folder = tmp_path / "capped"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"] |= {"final_logit_softcapping": 0.3, "attn_logit_softcapping": 5.0}
    (folder / "config.json").write_text(json.dumps(config))
    capped = Gemma3LanguageModel.from_checkpoint(folder)
    assert all(layer.soft_cap == 5.0 for layer in capped.layers)
    hidden = torch.randn(3, capped.config.hidden_size, generator=torch.Generator().manual_seed(0))
    uncapped = (hidden @ head_matrix(capped.lm_head)).float()
    assert uncapped.abs().max() > 0.3
    torch.testing.assert_close(capped.compute_logits(hidden), 0.3 * torch.tanh(uncapped / 0.3))


def test_byte_fallback_output_detokenizes_without_error(processor):
    """A stray UTF-8 lead byte turns the byte before it into U+FFFD in Gemma's decoder, which
    breaks tokenizers' DecodeStream; the detokenizer restarts it and goes on."""
    tokenizer = processor.tokenizer
    plus, lead = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0x2B, 0xE2))
    are = tokenizer.token_to_id("are")
    detokenizer = IncrementalDetokenizer(tokenizer, [2, 5])
    deltas = [detokenizer.push(t) for t in (plus, lead, are, are)] + [detokenizer.flush()]
    assert detokenize(tokenizer, [plus, lead, are, are]) == "\ufffd\ufffdareare"
    # the "+" already shown stands; the text goes on, invalid bytes as U+FFFD
    assert "".join(deltas) == detokenizer.text
    assert detokenizer.text.startswith("+") and detokenizer.text.endswith("\ufffdareare")
