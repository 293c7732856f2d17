"""Which captions go into which aggregation prompt, round by round.

One aggregation prompt holds the instruction and one line per caption (`prompts`). When every
caption's line fits one prompt beside the summary's tokens, one round makes the summary.
Otherwise consecutive captions are packed into as few prompts as fit, each prompt's summary
becomes one caption spanning its captions' times, and the next round aggregates those, until
one prompt holds them all. A prompt's length is its head (the template and the instruction)
plus its lines: each line starts after a newline with "[", where the tokenizer's pieces begin
afresh, so line lengths add up.
"""

from __future__ import annotations

from collections.abc import Sequence

from stillcut.engine.admission import RequestTooLong


def caption_groups(
    line_tokens: Sequence[int], head_tokens: int, room: int, per_round: int | None = None
) -> list[range]:
    """Consecutive groups of captions (their indices) packed into prompts of at most `room`
    tokens (`head_tokens` plus each caption's `line_tokens`) and at most `per_round`
    captions each (None: no cap). Raises `RequestTooLong` when one caption alone does not fit,
    or when no group would hold two captions (the rounds could never end)."""
    if per_round is not None and per_round < 2:
        raise ValueError(f"captions_per_round={per_round}: must be >= 2")
    groups: list[range] = []
    start, used = 0, head_tokens
    for index, tokens in enumerate(line_tokens):
        if head_tokens + tokens > room:
            raise RequestTooLong(
                f"caption {index} needs {head_tokens + tokens} tokens in an aggregation prompt; "
                f"the context leaves {room} beside the summary: raise max_model_len or lower "
                "caption_tokens / summary_tokens"
            )
        full = per_round is not None and index - start == per_round
        if used + tokens > room or full:
            groups.append(range(start, index))
            start, used = index, head_tokens
        used += tokens
    groups.append(range(start, len(line_tokens)))
    if len(groups) > 1 and all(len(group) == 1 for group in groups):
        raise RequestTooLong(
            "no aggregation prompt holds two captions: raise max_model_len or lower "
            "caption_tokens / summary_tokens"
        )
    return groups
