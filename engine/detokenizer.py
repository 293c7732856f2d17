"""Incremental detokenization with stop strings: output token ids in, text deltas out.

Byte-level BPE splits multi-byte UTF-8 characters (CJK, emoji) across tokens, so the text of a
token is not always text yet. The tokenizers library's own `DecodeStream` buffers such tokens
and yields a chunk only once it decodes to whole characters, so no delta ever carries half a
character. Stop strings are matched on the accumulated text. Text that could be the start of a
stop string is held back until the next tokens show it is not, so a client never receives
characters that later turn out to belong to a stop; when a stop completes, the output ends
right before it. `flush` releases what is still held when a request ends for another reason.
A push costs the same however long the output already is: stops are searched for only in the
text not yet returned (a stop never starts in returned text), and returned text is kept as
its pieces, joined only when asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens the stream starts from: decoders that drop a leading space at the start of a
# text (SentencePiece's) need a little context; the rest of the prompt never matters.
NUM_CONTEXT_TOKENS = 6
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas and finds its stop strings.

    After a stop string completes, `finished` is true, `stop_reason` is that string, the text
    ends right before it, and later pushes are ignored. The stop that completes first wins
    (among stops completing together, the one that starts first).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ) -> None:
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={stop!r} must hold non-empty strings only")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._context_ids = [int(t) for t in (prompt_token_ids or ())][-NUM_CONTEXT_TOKENS:]
        self._stream = DecodeStream(ids=self._context_ids, skip_special_tokens=skip_special_tokens)
        self._output_ids: list[int] = []
        self._num_pending_ids = 0  # pushed ids whose text the stream still holds
        self.pieces: list[str] = []  # every non-empty delta returned, in order; append-only
        self._unreturned = ""  # text decoded after the pieces: held back, or a stop's
        self.finished = False
        self.stop_reason: str | None = None
        self.num_unread_tokens = 0  # of the last push: pushed after a stop completed

    @property
    def text(self) -> str:
        """The output text returned so far (the concatenation of every delta)."""
        return "".join(self.pieces)

    def push(self, token_ids: int | Sequence[int]) -> str:
        """Add output tokens; return the new text that is safe to show (may be empty).

        With stop strings, several tokens read as if pushed one at a time: a stop completing
        at one ends the text there, and those after it stay unread (`num_unread_tokens`)."""
        token_ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self.num_unread_tokens = len(token_ids) if self.finished else 0
        delta = ""
        for index, token_id in enumerate([] if self.finished else token_ids):
            chunk = self._step(int(token_id))
            self._output_ids.append(int(token_id))
            if chunk is None:
                self._num_pending_ids += 1
            else:
                self._num_pending_ids = 0
                self._unreturned += chunk
            if self._stop or index == len(token_ids) - 1:
                delta += self._advance(final=False)
            if self.finished:
                self.num_unread_tokens = len(token_ids) - index - 1
                break
        return delta

    def flush(self) -> str:
        """The request ended (EOS, length, abort): return everything still held back.

        Tokens that never completed a character decode as the one-shot decode renders them
        (U+FFFD), so the final text equals `detokenize` of the same ids.
        """
        if self.finished:
            return ""
        if self._num_pending_ids:
            context = self._decode(self._context_ids)
            full = self._decode(self._context_ids + self._output_ids)[len(context) :]
            decoded = self.text + self._unreturned
            # Only a decoder that renders invalid bytes differently in a window than in the whole
            # could break this; then the text already shown stands.
            if full.startswith(decoded):
                self._unreturned += full[len(decoded) :]
            self._num_pending_ids = 0
        return self._advance(final=True)

    def _step(self, token_id: int) -> str | None:
        """The stream's next chunk. Byte-fallback decoders (SentencePiece's and its kind) render a
        run of byte tokens that is not valid UTF-8 as one U+FFFD per token, so a byte shown on
        its own ("+") can turn into U+FFFD once a stray byte follows, and `DecodeStream` then
        refuses its changed prefix. As vLLM does, restart the stream after the tokens so far
        (the text already shown stands) and decode the new token from there."""
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as error:  # tokenizers raises a bare Exception
            if _INVALID_PREFIX not in str(error):
                raise
        context = (self._context_ids + self._output_ids[-NUM_CONTEXT_TOKENS:])[-NUM_CONTEXT_TOKENS:]
        self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip_special_tokens)
        return self._stream.step(self._tokenizer, token_id)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, *, final: bool) -> str:
        # Text that could begin a stop is never returned, so a stop lies in the unreturned text:
        # what was held back (shorter than the longest stop) and what came since.
        text = self._unreturned
        stop_at, stop = find_stop(text, self._stop)
        if stop is not None:
            self.finished, self.stop_reason = True, stop
            safe_end = stop_at
        elif final:
            safe_end = len(text)
        else:
            safe_end = len(text) - _held_back(text, self._stop)
        delta, self._unreturned = text[:safe_end], text[safe_end:]
        if delta:
            self.pieces.append(delta)
        return delta


def detokenize(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
    stop: tuple[str, ...] = (),
) -> str:
    """One-shot decode of a whole output, cut before its first stop string: what the deltas
    of an `IncrementalDetokenizer` (plus its `flush`) add up to."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    stop_at, _ = find_stop(text, stop)
    return text if stop_at is None else text[:stop_at]


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> tuple[int | None, str | None]:
    """`(index, stop string)` of the first stop string to complete in `text[start:]`, or
    `(None, None)`. Among stops completing at the same character the one starting first wins."""
    found = [(i + len(s), i, s) for s in stop if (i := text.find(s, start)) >= 0]
    if not found:
        return None, None
    _, index, first = min(found)
    return index, first


def _held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a stop string."""
    held = 0
    for candidate in stop:
        for length in range(min(len(candidate) - 1, len(text)), held, -1):
            if text.endswith(candidate[:length]):
                held = length
                break
    return held
