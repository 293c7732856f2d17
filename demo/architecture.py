"""The trained demo's shape: a Qwen2.5-VL small enough to train from scratch on two CPU cores.

The preprocessor configs pin the pixel budget to one size, 224x168, so every 4:3 input is
resized to exactly what training saw (a 12x16-patch, 6x8-token grid per tubelet: a task shape
spans two to three patches); other aspect ratios get about as many pixels. All vision blocks
attend over the whole frame: it is only 192 patches. The language model's rotary base is
10^4 rather than Qwen's 10^6: its prompts are a few hundred tokens long, and at 10^4 the
slowest pairs stay nearly still across the whole prompt, for attention by content from an
answer back to the video. Its M-RoPE frequencies are re-spread (`rope_parameters`) so that
each of the time, height and width axes has fast pairs as well as slow ones: a departure, a
still scene and a cut are told apart by looking back at the same place a tubelet earlier,
and a plain Qwen2.5-VL layout at this size gives the width axis no frequency fast enough to
find that place.
`write_skeleton` writes everything but the weights: config, tokenizer, preprocessor and
generation configs, so the trainer can read them back through stillcut's own loaders.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stillcut.demo import tokenizer
from stillcut.demo.tasks import summary_hints
from stillcut.engine.models.qwen2_vl.checkpoint import (
    ProcessorSpec,
    family_vision,
    mrope_section,
    preprocessor_configs,
)

FAMILY = "qwen2_5_vl"
INPUT_WIDTH, INPUT_HEIGHT = 224, 168
INPUT_PIXELS = INPUT_WIDTH * INPUT_HEIGHT
VOCAB_MULTIPLE = 64  # embedding rows are padded to a multiple of this
TEXT: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 384,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}
ROPE_THETA = 1e4
# Radians per position of the leading rotary frequencies of the t, h and w runs
LEADING = ((1.0, 0.3, 0.08, 0.02), (1.0, 0.5, 0.25), (1.0, 0.5, 0.25))
VISION: dict[str, Any] = {
    "depth": 4,
    "hidden_size": 64,
    "num_heads": 2,
    "intermediate_size": 160,
    "fullatt_block_indexes": (0, 1, 2, 3),
}
PROCESSOR = ProcessorSpec(
    image_min_pixels=INPUT_PIXELS,
    image_max_pixels=INPUT_PIXELS,
    video_min_pixels=INPUT_PIXELS,
    video_max_pixels=INPUT_PIXELS,
)


def hf_config(special_ids: dict[str, int], metadata: dict[str, Any]) -> Any:
    """The transformers `Qwen2_5_VLConfig`, token ids from the demo tokenizer, `metadata`
    stored as `stillcut_demo` (what trained it), and the chunk lengths the model was trained
    to caption and summarise as `stillcut_summary` (a long-video summary keeps to them)."""
    from transformers import Qwen2_5_VLConfig

    num_tokens = max(special_ids.values()) + 1
    vocab_size = -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    text = {
        **TEXT,
        "vocab_size": vocab_size,
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": special_ids["<|im_end|>"],
        "max_window_layers": TEXT["num_hidden_layers"],
        "rope_parameters": rope_parameters(head_dim),
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=family_vision(FAMILY, VISION, TEXT["hidden_size"]),
        tie_word_embeddings=True,
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
        stillcut_demo=metadata,
        stillcut_summary=summary_hints(),
    )


def rope_parameters(head_dim: int) -> dict[str, Any]:
    """M-RoPE whose three axes each get fast and slow frequencies.

    Qwen2.5-VL gives the (t, h, w) axes contiguous runs of the rotary frequencies, fastest
    first. At this size that leaves the time axis only fast ones (at least 0.18 radian per
    position, so an answer cannot prefer early video to late: the angle wraps within a clip)
    and the width axis only the slowest (at most 0.003 radian per token, too slow to tell a
    token's place from its neighbour's). LongRoPE's per-frequency divisors (a fixed table:
    the same factors at every length, no scaling) set the leading frequencies of each run to
    `LEADING` radians per position; the rest of each run keeps its own, for attention by content.
    """
    section = mrope_section(head_dim)
    base = [ROPE_THETA ** (-2 * j / head_dim) for j in range(head_dim // 2)]
    target, start = list(base), 0
    for size, leading in zip(section, LEADING, strict=True):
        if len(leading) > size:
            raise ValueError(f"{leading}: more leading frequencies than the section's {size}")
        target[start : start + len(leading)] = leading
        start += size
    factors = [b / t for b, t in zip(base, target, strict=True)]
    return {
        "rope_type": "longrope",
        "rope_theta": ROPE_THETA,
        "mrope_section": section,
        "short_factor": factors,
        "long_factor": factors,
        "original_max_position_embeddings": TEXT["max_position_embeddings"],
        "factor": 1.0,
        "attention_factor": 1.0,
    }


def generation_ids(special_ids: dict[str, int]) -> dict[str, Any]:
    """generation_config.json's ids: stop at `<|im_end|>` or `<|endoftext|>`, as Qwen does."""
    end, eos = special_ids["<|endoftext|>"], special_ids["<|im_end|>"]
    return {"bos_token_id": end, "eos_token_id": [eos, end], "pad_token_id": end}


def write_skeleton(folder: Path, metadata: dict[str, Any]) -> Any:
    """Write all files but the weights into `folder`; return the transformers config."""
    from transformers import GenerationConfig

    special_ids = tokenizer.write_tokenizer_files(folder)
    config = hf_config(special_ids, metadata)
    config.save_pretrained(folder)
    GenerationConfig(**generation_ids(special_ids)).save_pretrained(folder)
    vision = family_vision(FAMILY, VISION, TEXT["hidden_size"])
    for name, contents in preprocessor_configs(FAMILY, vision, PROCESSOR).items():
        (folder / name).write_text(json.dumps(contents, indent=2, sort_keys=True) + "\n")
    return config
