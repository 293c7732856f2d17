"""The trained demo's tokenizer: a small byte-level BPE in Qwen2.5's shape, trained offline.

The real Qwen2.5 tokenizer alone is 18.7 MB, far more than the demo model, which only ever
says the task's templated sentences. So a BPE is trained on the task's prompts and answers,
narration segments, chunk captions and summaries, and the chat template's own words, inside
Qwen2's pipeline (NFC, Qwen2's split regex, byte level, so any text still encodes), with the 22
Qwen2.5 added tokens right after its vocabulary and Qwen2.5-VL's chat template
(`qwen_tokenizer.write_qwen_style_files`). The prompt processor and transformers take it as a
Qwen2.5-VL tokenizer; only the ids differ. Training is deterministic and takes well under a
second.
"""

from __future__ import annotations

import json
from pathlib import Path

from stillcut.demo.captions import ScenePart, chunk_caption, summary
from stillcut.demo.chunk_prompts import (
    TimedCaption,
    aggregation_messages,
    chunk_caption_messages,
)
from stillcut.demo.narration import num_tubelets, segment
from stillcut.demo.questions import PROMPTS, QUESTION_TYPES, answer
from stillcut.demo.scenes import NARRATION_MIX, sample_scene
from stillcut.engine.factory.qwen_tokenizer import (
    ADDED_TOKENS,
    qwen_style_pipeline,
    write_qwen_style_files,
)
from stillcut.engine.processor import DEFAULT_NARRATE_PROMPT

NUM_BYTE_TOKENS = 256
VOCAB_SIZE = 512  # the byte alphabet plus learned pieces, before the added tokens
NUM_CORPUS_SCENES = 400
# What the template and the processor put around every prompt.
TEMPLATE_TEXT = ("system", "user", "assistant", "You are a helpful assistant.")


def corpus() -> list[str]:
    """The training text: template words, every prompt, answers about many scenes, their
    narrations, and chunk prompts, captions and summaries over pairs of them."""
    scenes = [sample_scene(seed) for seed in range(NUM_CORPUS_SCENES)]
    narrated = [sample_scene(seed, mix=NARRATION_MIX) for seed in range(NUM_CORPUS_SCENES)]
    answers = [answer(scene, kind) for scene in scenes for kind in QUESTION_TYPES]
    segments = [segment(s, i) for s in narrated for i in range(num_tubelets(s))]
    texts = [*TEMPLATE_TEXT, *(p for prompts in PROMPTS.values() for p in prompts), *answers]
    texts += [DEFAULT_NARRATE_PROMPT, *(f"<{t:.1f}s>" for t in range(60)), *segments]
    for first, second in zip(scenes[0::2], narrated[1::2], strict=True):
        captions = [
            TimedCaption(0.0, 4.0, chunk_caption([ScenePart(first, 0.0, 4.0)])),
            TimedCaption(
                4.0, 8.0, chunk_caption([ScenePart(first, 4.0, 6.0), ScenePart(second, 0.0, 2.0)])
            ),
        ]
        texts += [summary([c.text for c in captions])]
        texts += [m["content"] for m in aggregation_messages(captions)]
    texts += [p["text"] for p in chunk_caption_messages(12.0, 16.0)[0]["content"] if "text" in p]
    return texts


def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The learned byte-level vocabulary (ids 0..) and its merges."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    trainer_tokenizer = qwen_style_pipeline(Tokenizer(BPE()))
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trainer_tokenizer.train_from_iterator(corpus(), trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    assert len(model["vocab"]) >= NUM_BYTE_TOKENS, "every byte has its own token"
    return model["vocab"], [tuple(merge) for merge in model["merges"]]


def special_token_ids(num_learned: int) -> dict[str, int]:
    """The id of every added token when the vocabulary has `num_learned` entries."""
    return {text: num_learned + offset for offset, (text, _) in enumerate(ADDED_TOKENS)}


def write_tokenizer_files(folder: Path) -> dict[str, int]:
    """Train the tokenizer, write its files into `folder`, and return the added tokens' ids."""
    vocab, merges = vocab_and_merges()
    write_qwen_style_files(folder, vocab, merges)
    return special_token_ids(len(vocab))
