"""Prompt-lookup proposals: the tokens that followed the last earlier occurrence of the
request's final n tokens, for the largest n in [min_n, max_n] that occurs (vLLM's `ngram`).

Repeated text (a question that quotes the prompt, a list, a loop of a small model) makes the
continuation of an earlier match a good guess at no cost beyond a scan of the request's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stillcut.engine.request import Request


def lookup(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the most recent earlier occurrence of the last n
    of `tokens` [L] int64, for the largest n in [min_n, max_n] with one; [] if none."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows [L - n, n] over everything but the final token: a match must be followed
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


class NgramProposer:
    """Drafts from the request's own prompt and output (see the module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [
            lookup(np.asarray(r.all_token_ids, dtype=np.int64), self.min_n, self.max_n, k)
            if k
            else []
            for r, k in zip(requests, num_tokens, strict=True)
        ]

    def finish(self, request: Request) -> None:
        """Nothing is kept per request."""
