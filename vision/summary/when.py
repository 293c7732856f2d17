"""Questions about when something happens, answered from a summary's timeline.

The model sees the video, one chunk at a time, and writes each chunk's caption; that is all it
does for a question. The timeline answers: it knows each caption's times, so "when does the
red square appear?" becomes a search of the captions for what the question names, and the
answer is the times of the chunks whose captions say it. So an answer is as good as the
captions and as precise as a chunk (an answer's times are its chunks' start and end).

How a question is read: after "when" and its auxiliary ("does", "is", ...) and without
articles, the subject is the words up to the first verb or preposition of a small list (the
red square), the last word standing for the verb when none is listed; what follows is what it
does (appear, move to the left). Presence verbs (appear, show up, enter, be visible, ...) ask
for every mention of the subject, the first one being when it appears; other words narrow the
mentions to the captions that also hold them (disappears, moves left), in the same clause
(clauses end at ".", ";", "!", "?"); the subject must be there word for word (a red square
beside a blue circle is no red circle). Words are compared by a small stem ("moves", "moving",
"move"). The answer lists the spans of consecutive matching chunks; a subject no caption
names, or an event none says, is answered as such.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from stillcut.vision.summary.prompts import TimedCaption

_AUXILIARIES = {"does", "do", "did", "is", "are", "was", "were", "will", "would", "can", "could"}
_ARTICLES = {"a", "an", "the"}
_LINKS = {"to", "of", "in", "on", "at", "from", "into", "onto", "with", "by", "and", "it"}
_PRESENCE = {"appear", "show", "visible", "seen", "present", "enter", "arrive", "come", "start"}
_VERBS = _PRESENCE | {
    "move", "go", "leave", "disappear", "vanish", "exit", "stop", "turn", "fall", "rise",
    "jump", "run", "walk", "stand", "change", "happen", "open", "close", "begin", "end", "pass",
}  # fmt: skip
_CLAUSE_END = re.compile(r"[.;!?]")
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class TemporalAnswer:
    """When the timeline says `subject` does `event` (an empty event: is mentioned at all):
    the spans (seconds) of consecutive chunks whose captions say so, and a sentence."""

    question: str
    subject: str
    event: str
    spans: tuple[tuple[float, float], ...]
    text: str

    @property
    def first_s(self) -> float | None:
        """When it first happens (the start of the first span), None when never."""
        return self.spans[0][0] if self.spans else None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["spans"] = [list(span) for span in self.spans]
        data["first_s"] = self.first_s
        return data


def answer_when(timeline: Sequence[TimedCaption], question: str) -> TemporalAnswer:
    """Answer a "when ..." question from `timeline` (see the module docstring). Raises
    ValueError for a question that does not ask when."""
    words = _question_words(question)
    clauses = [(entry, _clause_words(entry.text)) for entry in timeline]
    length = _subject_length(words)
    subject = words[:length]
    mentions = [e for e, found in clauses if any(_holds(c, subject) for c in found)]
    if not mentions:
        named = " ".join(subject)
        return TemporalAnswer(question, named, "", (), f'No caption names "{named}".')
    event = [w for w in words[length:] if w not in _LINKS]
    if event and _stem(event[0]) in _PRESENCE_STEMS:
        event = []
    matches = [
        e for e, found in clauses if any(_holds(c, subject) and _has(c, event) for c in found)
    ]
    spans = _spans(matches)
    what, said = " ".join(subject), " ".join([*subject, *event])
    if not event:
        text = f"The {what} first appears at {spans[0][0]:.1f}s (named {_listed(spans)})."
    elif spans:
        text = f'The captions say "{said}" {_listed(spans)}.'
    else:
        text = f'No caption says "{said}"; the {what} is named {_listed(_spans(mentions))}.'
    return TemporalAnswer(question, what, " ".join(event), spans, text)


def check_when_question(question: str) -> None:
    """Raise ValueError unless `question` asks when something happens."""
    _question_words(question)


def _question_words(question: str) -> list[str]:
    words = _WORD.findall(question.lower())
    if not words or words[0] != "when":
        raise ValueError(f"question={question!r}: ask when something happens ('when does ...?')")
    words = words[1:]
    if words and words[0] in _AUXILIARIES:
        words = words[1:]
    words = [w for w in words if w not in _ARTICLES]
    if not words:
        raise ValueError(f"question={question!r}: say what to look for ('when does the ...?')")
    return words


def _clause_words(text: str) -> list[list[str]]:
    clauses = (_WORD.findall(part) for part in _CLAUSE_END.split(text.lower()))
    return [[w for w in clause if w not in _ARTICLES] for clause in clauses if clause]


def _subject_length(words: list[str]) -> int:
    """How many of `words` name the subject: those before the first listed verb or link word
    after the first word, else all but the last (the verb)."""
    for index, word in enumerate(words[1:], start=1):
        if word in _LINKS or _stem(word) in _VERB_STEMS:
            return index
    return max(1, len(words) - 1)


def _holds(clause: list[str], run: list[str]) -> bool:
    """Whether `clause` has the words of `run` one after another."""
    stems, wanted = [_stem(w) for w in clause], [_stem(w) for w in run]
    return any(stems[i : i + len(wanted)] == wanted for i in range(len(stems) - len(wanted) + 1))


def _has(clause: list[str], words: list[str]) -> bool:
    stems = {_stem(w) for w in clause}
    return all(_stem(w) in stems for w in words)


def _stem(word: str) -> str:
    """A crude stem: "moves", "moving", "moved", "move" -> "mov"; "crosses", "cross" ->
    "cross"."""
    for suffix in ("ing", "ed", "es", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            word = word[: -len(suffix)]
            break
    return word[:-1] if word.endswith("e") and len(word) > 3 else word


def _spans(entries: list[TimedCaption]) -> tuple[tuple[float, float], ...]:
    """The entries' times, neighbours that touch or overlap merged."""
    spans: list[list[float]] = []
    for entry in entries:
        if spans and entry.start_s <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], entry.end_s)
        else:
            spans.append([entry.start_s, entry.end_s])
    return tuple((start, end) for start, end in spans)


def _listed(spans: Sequence[tuple[float, float]]) -> str:
    return ", ".join(f"from {start:.1f}s to {end:.1f}s" for start, end in spans)


_PRESENCE_STEMS = frozenset(_stem(word) for word in _PRESENCE)
_VERB_STEMS = frozenset(_stem(word) for word in _VERBS)
