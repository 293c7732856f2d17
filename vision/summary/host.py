"""Where a summary's work runs, and how it waits for the engine.

A `SummaryHost` gives the vision pipeline (one job at a time), tokenizing off the event loop,
and the engine's requests; the Python API and the service each give one. Requests of a summary
run as tasks of one group: the first failure cancels the others and is raised as it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from stillcut.engine.llm_engine import RequestOutput
from stillcut.engine.processor import Prompt
from stillcut.engine.request import SamplingParams

T = TypeVar("T")
Event = dict[str, Any]  # a summary's progress, as the service streams it


class SummaryHost(Protocol):
    """Where a summary's work runs."""

    async def vision(self, fn: Callable[[], T]) -> T:
        """`fn()` with the vision pipeline to itself (one such job at a time)."""

    async def text(self, fn: Callable[[], T]) -> T:
        """`fn()` that tokenizes (off the event loop)."""

    def generate(self, prompt: Prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """One request's outputs; the last is finished. Leaving early aborts it."""


async def final_output(host: SummaryHost, prompt: Prompt, params: SamplingParams) -> RequestOutput:
    """`prompt` run to its end through `host`; its finished output."""
    final = None
    async for output in host.generate(prompt, params):
        final = output
    assert final is not None and final.finished
    return final


async def in_task_group(body: Callable[[asyncio.TaskGroup], Awaitable[None]]) -> None:
    """Run `body(group)` and every task it starts; the first failure is raised as it is (the
    others are cancelled)."""
    try:
        async with asyncio.TaskGroup() as group:
            await body(group)
    except BaseExceptionGroup as failed:
        raise _first(failed) from None


def one_line(text: str) -> str:
    """A caption or a summary as one line (the aggregation prompt takes one per caption)."""
    return " ".join(text.split())


def _first(failed: BaseExceptionGroup) -> BaseException:
    error = failed.exceptions[0]
    return _first(error) if isinstance(error, BaseExceptionGroup) else error
