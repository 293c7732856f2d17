"""Suffix proposals: continuations of the request's latest n tokens found in its own tokens and
in recent outputs of requests with the same cache salt.

Repeated questions about the same kind of video get answers that share whole phrases, so the
outputs of finished requests are kept (each after the last few tokens of its prompt, so an
answer's opening is found from the prompt's end) in an index per cache salt: requests of one
tenant never see another's text. Each `SuffixIndex` maps every n-gram (n in [min_n, max_n]) to
where it last ended, so a lookup costs O(max_n) however much is stored, and a request's own
index grows by the tokens it appended since its last proposal. Memory is bounded: a salt's
index keeps at most `max_stored_tokens`, oldest outputs evicted first, and at most
`max_salts` salts are kept, least recently used evicted.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from stillcut.engine.request import Request

MAX_STORED_TOKENS = 65536
MAX_SALTS = 64


class SuffixIndex:
    """Token sequences and, for each n-gram in them, the latest place it ended."""

    def __init__(self, min_n: int, max_n: int, max_stored_tokens: int = MAX_STORED_TOKENS):
        self.min_n, self.max_n = min_n, max_n
        self.max_stored_tokens = max_stored_tokens
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self.ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (sequence, end)
        self.num_stored_tokens = 0
        self._ids = itertools.count()

    def add(self, token_ids: Sequence[int]) -> int:
        """Store a new sequence; returns its id (for `extend`)."""
        sequence_id = next(self._ids)
        self.sequences[sequence_id] = []
        self.extend(sequence_id, token_ids)
        return sequence_id

    def extend(self, sequence_id: int, token_ids: Sequence[int]) -> None:
        """Append tokens to a stored sequence, indexing the n-grams that now end in them."""
        tokens = self.sequences[sequence_id]
        for token_id in token_ids:
            tokens.append(int(token_id))
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n :])] = (sequence_id, end)
        self.num_stored_tokens += len(token_ids)
        while self.num_stored_tokens > self.max_stored_tokens and len(self.sequences) > 1:
            self._evict_oldest()

    def find(self, context: Sequence[int], n: int) -> tuple[int, int] | None:
        """(sequence id, end) of the latest stored occurrence of the last `n` of `context`."""
        return self.ends.get(tuple(context[-n:])) if len(context) >= n else None

    def _evict_oldest(self) -> None:
        sequence_id, tokens = self.sequences.popitem(last=False)
        self.num_stored_tokens -= len(tokens)
        for end in range(1, len(tokens) + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                if self.ends.get(key, (None, 0))[0] == sequence_id:
                    del self.ends[key]


class SuffixProposer:
    """Drafts from each request's own tokens and its salt's recent outputs (module docstring)."""

    def __init__(
        self,
        min_n: int,
        max_n: int,
        max_stored_tokens: int = MAX_STORED_TOKENS,
        max_salts: int = MAX_SALTS,
    ) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.max_stored_tokens, self.max_salts = max_stored_tokens, max_salts
        self.by_salt: OrderedDict[str | None, SuffixIndex] = OrderedDict()
        self.own: dict[str, tuple[SuffixIndex, int]] = {}  # request id -> its index, sequence

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [self._propose(r, k) if k else [] for r, k in zip(requests, num_tokens, strict=True)]

    def finish(self, request: Request) -> None:
        """Forget the request's own index; keep its output under its salt."""
        self.own.pop(request.request_id, None)
        if request.output_token_ids:
            prompt_tail = request.prompt_token_ids[-self.max_n :]
            self._salt_index(request.cache_salt).add(prompt_tail + request.output_token_ids)

    def _propose(self, request: Request, num_tokens: int) -> list[int]:
        context = request.all_token_ids
        own = self._own_index(request, context)
        shared = self.by_salt.get(request.cache_salt)
        for n in range(self.max_n, self.min_n - 1, -1):
            found = own.find(context, n)
            if found is not None:  # the own index holds the context but its last token
                return context[found[1] : found[1] + num_tokens]
            found = None if shared is None else shared.find(context, n)
            if found is not None and (drafts := shared.sequences[found[0]][found[1] :]):
                return drafts[:num_tokens]
        return []

    def _own_index(self, request: Request, context: list[int]) -> SuffixIndex:
        """The request's own index, holding all its tokens but the last."""
        entry = self.own.get(request.request_id)
        if entry is None:
            index = SuffixIndex(self.min_n, self.max_n, max_stored_tokens=2**62)
            entry = self.own[request.request_id] = (index, index.add([]))
        index, sequence_id = entry
        stored = index.sequences[sequence_id]
        index.extend(sequence_id, context[len(stored) : len(context) - 1])
        return index

    def _salt_index(self, salt: str | None) -> SuffixIndex:
        index = self.by_salt.pop(salt, None)
        if index is None:
            index = SuffixIndex(self.min_n, self.max_n, self.max_stored_tokens)
        self.by_salt[salt] = index  # most recently used last
        while len(self.by_salt) > self.max_salts:
            self.by_salt.popitem(last=False)
        return index
