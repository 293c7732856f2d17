"""`--reasoning-parser think`: a leading `<think>...</think>` goes to `reasoning_content`.

Reasoning models open a thinking block, close it with `</think>` and then answer. Their chat
templates either leave the opening `<think>` to the model or write it into the prompt (then
the output starts inside the block); `ThinkSplitter.for_prompt` tells which from the prompt's
last tokens. Text inside the block is reasoning, text after `</think>` is content; an output
that never closes the block is all reasoning. The tags themselves are dropped. Streamed
deltas split the same way, holding back a possible partial tag until the next delta shows
what it is, so streaming and a whole completion give the same two texts.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("think",)
_PROMPT_TAIL_TOKENS = 8  # enough to see the template's `<think>` after the assistant header


class ThinkSplitter:
    """Splits one request's output text into (reasoning, content) deltas."""

    def __init__(self, in_reasoning: bool) -> None:
        self._in_reasoning = in_reasoning
        self._at_start = True  # a `<think>` opens the block only as the output's first text
        self._held = ""

    @classmethod
    def for_prompt(cls, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> ThinkSplitter:
        """A splitter that starts inside the block when the prompt leaves one open."""
        tail = tokenizer.decode(
            list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False
        )
        return cls(tail.rfind(THINK_START) > tail.rfind(THINK_END))

    def push(self, delta: str) -> tuple[str, str]:
        """The reasoning and content text of the next output delta."""
        text, self._held = self._held + delta, ""
        reasoning, content = [], []
        while text:
            if self._at_start and not self._in_reasoning:
                stripped = text.lstrip()
                if THINK_START.startswith(stripped) and len(stripped) < len(THINK_START):
                    self._held = text  # maybe the start of `<think>`: wait for more
                    break
                self._at_start = False
                if stripped.startswith(THINK_START):
                    self._in_reasoning, text = True, stripped[len(THINK_START) :]
                continue
            self._at_start = False
            if not self._in_reasoning:
                content.append(text)
                break
            end = text.find(THINK_END)
            if end >= 0:
                reasoning.append(text[:end])
                self._in_reasoning, text = False, text[end + len(THINK_END) :]
                continue
            keep = _partial_suffix(text, THINK_END)
            reasoning.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What is still held back, once the output has ended."""
        held, self._held = self._held, ""
        return (held, "") if self._in_reasoning else ("", held)

    def split(self, text: str) -> tuple[str, str]:
        """A whole output as (reasoning, content)."""
        reasoning, content = self.push(text)
        more_reasoning, more_content = self.flush()
        return reasoning + more_reasoning, content + more_content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
