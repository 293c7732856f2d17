"""What every proposer offers the speculator: drafts for running requests, and a hook when a
request finishes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from stillcut.engine.request import Request


class Proposer(Protocol):
    """Proposes draft tokens to follow each request's tokens (prompt and output so far)."""

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """Up to `num_tokens[i]` drafts for `requests[i]` (fewer, or none, when it has no
        guess); a request with 0 asked for gets []."""
        ...

    def finish(self, request: Request) -> None:
        """`request` finished or was aborted: forget it (and learn from its output)."""
        ...
