"""The long-video summary's prompts, which the demo model is trained on.

They live with the summarizer (`stillcut.vision.summary.prompts`); the demo's task, trainer
and tokenizer read them from here.
"""

from stillcut.vision.summary.prompts import (
    AGGREGATION_INSTRUCTION,
    CAPTION_LINE,
    CHUNK_INSTRUCTION,
    CHUNK_TIMES,
    TimedCaption,
    aggregation_messages,
    chunk_caption_messages,
)

__all__ = [
    "AGGREGATION_INSTRUCTION",
    "CAPTION_LINE",
    "CHUNK_INSTRUCTION",
    "CHUNK_TIMES",
    "TimedCaption",
    "aggregation_messages",
    "chunk_caption_messages",
]
