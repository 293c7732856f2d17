"""Aggregating a timeline's captions into a summary, in as many rounds as the context needs.

One aggregation prompt holds the instruction and one line per caption (`prompts`). When every
caption's line fits one prompt beside the summary's tokens, one round makes the summary.
Otherwise consecutive captions are packed into as few prompts as fit, each prompt's summary
becomes one caption spanning its captions' times, and the next round aggregates those, until
one prompt holds them all. A prompt's length is its head (the template and the instruction)
plus its lines: each line starts after a newline with "[", where the tokenizer's pieces begin
afresh, so line lengths add up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from stillcut.engine.admission import RequestTooLong
from stillcut.engine.processor import Prompt, PromptProcessor
from stillcut.engine.request import SamplingParams
from stillcut.vision.summary.host import Event, SummaryHost, final_output, in_task_group, one_line
from stillcut.vision.summary.prompts import CAPTION_LINE, TimedCaption, aggregation_messages
from stillcut.vision.summary.result import SummaryUsage


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


async def aggregate(
    host: SummaryHost,
    processor: PromptProcessor,
    timeline: Sequence[TimedCaption],
    room: int,
    per_round: int | None,
    max_tokens: int,
    max_in_flight: int,
    usage: SummaryUsage,
    on_event: Callable[[Event], None],
) -> tuple[str, int]:
    """The summary of `timeline`'s non-empty captions (at most `max_tokens` per summary, at
    most `max_in_flight` prompts at once, each at most `room` tokens and `per_round` captions),
    and the rounds it took."""
    captions = [entry for entry in timeline if entry.text]
    params = SamplingParams(max_tokens=max_tokens)
    rounds = 0
    while captions:
        rounds += 1
        groups = await host.text(
            lambda captions=captions: _groups(processor, captions, room, per_round)
        )
        prompts = await host.text(
            lambda groups=groups: [processor.build(aggregation_messages(g)) for g in groups]
        )
        texts = await _complete_all(host, prompts, params, max_in_flight, usage, rounds, on_event)
        if len(groups) == 1:
            return texts[0], rounds
        captions = [
            TimedCaption(group[0].start_s, group[-1].end_s, text)
            for group, text in zip(groups, texts, strict=True)
            if text
        ]
    return "", rounds


def _groups(
    processor: PromptProcessor, captions: list[TimedCaption], room: int, per_round: int | None
) -> list[list[TimedCaption]]:
    head = len(processor.build(aggregation_messages(captions[:1])).token_ids)
    first = captions[0]
    head -= len(
        processor.encode(CAPTION_LINE.format(start=first.start_s, end=first.end_s, text=first.text))
    )
    lines = [
        len(processor.encode("\n" + CAPTION_LINE.format(start=c.start_s, end=c.end_s, text=c.text)))
        for c in captions
    ]
    return [[captions[i] for i in group] for group in caption_groups(lines, head, room, per_round)]


async def _complete_all(
    host: SummaryHost,
    prompts: list[Prompt],
    params: SamplingParams,
    max_in_flight: int,
    usage: SummaryUsage,
    round_index: int,
    on_event: Callable[[Event], None],
) -> list[str]:
    """The one-line answers to `prompts`, at most `max_in_flight` running at once."""
    texts: list[str | None] = [None] * len(prompts)
    slots = asyncio.Semaphore(max_in_flight)

    async def complete(index: int) -> None:
        async with slots:
            output = await final_output(host, prompts[index], params)
        texts[index] = one_line(output.text)
        usage.add_output(output)
        on_event(
            {
                "type": "aggregate",
                "round": round_index,
                "num_done": sum(t is not None for t in texts),
                "num_prompts": len(prompts),
            }
        )

    async def start_all(group: asyncio.TaskGroup) -> None:
        for index in range(len(prompts)):
            group.create_task(complete(index))

    await in_task_group(start_all)
    return texts
