"""Prompt processing: chat messages plus encoded media items to the token ids the engine runs.

Media are encoded (and pruned by EVS) before the prompt exists, so each item already knows how
many tokens it keeps. The chat template renders one marker per media part, the family's
`PromptFormat` writes each with one placeholder token (`prompt_formats`), the text is
tokenized, and each placeholder is then expanded into `item.num_tokens` copies. A family
without a video token writes each video as its frames, one image item per grid step. Live
sessions (families that serve them) split a one-video prompt in two: `vision_prefix`
(everything up to and including the video's placeholders, held and extended tubelet by
tubelet) and `ask_suffix` (from the vision end marker to the assistant header). A narration
(families with a `narration_timestamp`) is one user turn with the instruction and an open
assistant turn, then per tubelet its timestamp text and the tubelet as its own video
(`narration_input`), each followed by what the model says about it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from stillcut.engine.chat_template import ChatTemplate
from stillcut.engine.checkpoint import CheckpointLike, open_checkpoint
from stillcut.engine.model_config import CheckpointError
from stillcut.engine.models.registry import ModelFamily
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.prompt_formats import MarkerTexts, videos_as_frames
from stillcut.engine.request import PlaceholderRange

ROLES = ("system", "user", "assistant")
_MAX_SEGMENT_END_LISTS = 8
PART_TYPES = ("text", "video", "image")
Message = Mapping[str, Any]
_VISION_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)

# The instruction a narration starts with unless given one (the demo model is trained on it).
DEFAULT_NARRATE_PROMPT = "Narrate what happens, one short line at a time."


class PromptError(ValueError):
    """Messages or items that cannot form a prompt; the message says what was wrong."""


@dataclass(frozen=True)
class SpecialTokenIds:
    """The token ids the processor places or the engine stops on; `video_token_id` is None
    for a family whose videos are frames of images, the vision start/end ids for a family
    whose prompt format writes its delimiters as text."""

    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in _VISION_TOKEN_FIELDS:
            value = getattr(self, name)
            if (value is None and name == "image_token_id") or (value is not None and value < 0):
                raise ValueError(f"{name}={value} must be >= 0")
        if self.image_token_id == self.video_token_id:
            raise ValueError(
                f"image_token_id={self.image_token_id} must differ from video_token_id"
            )


@dataclass(frozen=True)
class Prompt:
    """Token ids with every placeholder expanded; `mm_positions[i]` places `items[i]`."""

    token_ids: list[int]
    items: list[MultiModalItem]
    mm_positions: list[PlaceholderRange]


class PromptProcessor:
    """Builds prompts for one checkpoint from its tokenizer, chat template, token ids and the
    family's registry entry (its prompt format, video token and live-session flags)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        special: SpecialTokenIds,
        family: ModelFamily,
    ) -> None:
        if (special.video_token_id is None) == family.has_video_token:
            raise ValueError(
                f"video_token_id={special.video_token_id} disagrees with family "
                f"{family.model_type!r} (has_video_token={family.has_video_token})"
            )
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special = special
        self.family = family
        self._pad_kinds = {special.image_token_id: "image", special.video_token_id: "video"}
        self._pad_kinds.pop(None, None)
        marker_ids = (
            special.vision_start_token_id,
            special.image_token_id,
            special.vision_end_token_id,
            special.video_token_id,
        )
        begin, placeholder, end, video = (
            None if i is None else tokenizer.id_to_token(i) for i in marker_ids
        )
        # Text that would smuggle placeholders or vision markers into the prompt.
        reserved = (begin, placeholder, end, video)
        self._reserved_text = tuple(dict.fromkeys(t for t in reserved if t is not None))
        self._markers = None if placeholder is None else MarkerTexts(placeholder, begin, end, video)
        self._segment_ends: OrderedDict[tuple[str, ...], frozenset[int]] = OrderedDict()
        self._segment_ends_lock = threading.Lock()  # sessions ask from worker threads
        self._video_prefix_ids: list[int] = []
        if family.live_sessions:
            self._video_prefix_ids, _ = self._split_at_video_pad("")

    @classmethod
    def from_checkpoint(cls, path: CheckpointLike) -> PromptProcessor:
        """Load the tokenizer, chat template and special ids of a checkpoint (or its folder or
        hub id)."""
        checkpoint = open_checkpoint(path)
        folder = checkpoint.folder
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        config = checkpoint.config
        special = SpecialTokenIds(
            image_token_id=config.image_token_id,
            video_token_id=config.video_token_id,
            vision_start_token_id=config.vision_start_token_id,
            vision_end_token_id=config.vision_end_token_id,
            eos_token_ids=_eos_token_ids(folder, tokenizer_config, tokenizer),
        )
        template = ChatTemplate.from_checkpoint(folder, tokenizer_config)
        return cls(tokenizer, template, special, config.family)

    def build(
        self,
        messages: Sequence[Message],
        items: Sequence[MultiModalItem] = (),
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """The prompt for an OpenAI-style conversation, ending with the assistant header.

        `messages` have a `role` (system, user, assistant) and a `content`: a string or a list
        of parts `{"type": "text", "text": ...}`, `{"type": "video"}`, `{"type": "image"}`.
        `items` are the encoded media, in the order their parts appear. `template_kwargs` are
        extra variables for the chat template (e.g. `{"enable_thinking": False}`).
        """
        plain = self._plain_messages(messages)
        items = list(items)
        _check_media(_media_kinds(plain), items)
        if self.family.has_video_token:
            # the video's placeholder run is where its positions start: it must not vanish
            for index, item in enumerate(items):
                if item.num_tokens < 1:
                    raise PromptError(f"item {index} has no tokens; every item needs one")
        else:
            plain, items = videos_as_frames(plain, items)
        try:
            text = self.chat_template.render(
                plain, add_generation_prompt=True, extra=template_kwargs
            )
        except ValueError as error:
            raise PromptError(str(error)) from None
        text, items = self.family.prompt_format.expand(text, items, self._markers)
        return _place(self.encode(text), items, self._pad_kinds)

    def build_text(self, prompt: str, items: Sequence[MultiModalItem] = ()) -> Prompt:
        """One user message: the items first, then `prompt`."""
        parts = [{"type": item.kind} for item in items] + [{"type": "text", "text": prompt}]
        return self.build([{"role": "user", "content": parts}], items)

    def vision_prefix(self, items: Sequence[MultiModalItem] = ()) -> Prompt:
        """A live session's held prefix: the template up to the video's placeholder, then the
        session's tubelets so far (`stream_input`). A tubelet EVS pruned away entirely is a
        0-token item: it still extends the logical video's grid."""
        self._require_live_sessions()
        tubelets = self.stream_input(items)
        offset = len(self._video_prefix_ids)
        positions = [PlaceholderRange(p.offset + offset, p.length) for p in tubelets.mm_positions]
        return Prompt(self._video_prefix_ids + tubelets.token_ids, tubelets.items, positions)

    def stream_input(self, items: Sequence[MultiModalItem]) -> Prompt:
        """What appends live tubelets (video items) to a held prefix, as the family's prompt
        format writes a stream's tubelets (`PromptFormat.stream_tubelet`): their placeholders,
        with the text around each; no tokens at all for 0-token tubelets written bare."""
        self._require_live_sessions()
        if any(item.kind != "video" for item in items):
            raise PromptError("a live session's items must all be videos")
        token_ids: list[int] = []
        positions = []
        for item in items:
            before, after = self.family.prompt_format.stream_tubelet(item, self._markers)
            token_ids += self.encode(before) if before else []
            positions.append(PlaceholderRange(len(token_ids), item.num_tokens))
            token_ids += [self.special.video_token_id] * item.num_tokens
            token_ids += self.encode(after) if after else []
        return Prompt(token_ids, list(items), positions)

    def ask_suffix(self, question: str) -> list[int]:
        """What follows a live session's placeholders to ask `question`: the vision end marker,
        the question, the end of the user turn and the assistant header."""
        self._require_live_sessions()
        return self._split_at_video_pad(question)[1]

    def tubelet_time(self, item: MultiModalItem) -> float:
        """The time a narration writes before the one-tubelet video `item` (seconds), as the
        family's prompt format gives it (`PromptFormat.tubelet_time`)."""
        return self.family.prompt_format.tubelet_time(item)

    def narration_prompt(self, instruction: str, item: MultiModalItem, timestamp: float) -> Prompt:
        """A narration's start: `instruction` as the user turn, the assistant turn opened, and
        its first tubelet (see `narration_input`)."""
        head = self.build_text(instruction)
        tubelet = self.narration_input(item, timestamp)
        offset = len(head.token_ids) + tubelet.index(self.special.video_token_id)
        return Prompt(head.token_ids + tubelet, [item], [PlaceholderRange(offset, item.num_tokens)])

    def narration_input(self, item: MultiModalItem, timestamp: float) -> list[int]:
        """What a narration appends for one tubelet: its timestamp as the family writes it,
        then the tubelet as its own video, `item.num_tokens` placeholders between the vision
        markers (at least one: a tubelet EVS emptied is skipped by the caller)."""
        form = self.family.narration_timestamp
        if form is None:
            raise PromptError(f"{self.family.model_type!r} checkpoints do not narrate")
        if item.kind != "video" or item.num_tokens < 1:
            raise PromptError("a narrated tubelet must be a video item with at least one token")
        special = self.special
        pads = [special.video_token_id] * item.num_tokens
        text = self.encode(form.format(t=timestamp))
        return [*text, special.vision_start_token_id, *pads, special.vision_end_token_id]

    def segment_end_token_ids(self, strings: Sequence[str]) -> frozenset[int]:
        """Ids of the tokens whose text holds any of `strings` (narration segment ends). The
        vocabulary is decoded once per distinct list; the last few lists are kept."""
        key = tuple(strings)
        with self._segment_ends_lock:
            if key not in self._segment_ends:
                vocab_size = self.tokenizer.get_vocab_size()
                texts = self.tokenizer.decode_batch([[i] for i in range(vocab_size)])
                ends = frozenset(i for i, text in enumerate(texts) if any(s in text for s in key))
                self._segment_ends[key] = ends
                while len(self._segment_ends) > _MAX_SEGMENT_END_LISTS:
                    self._segment_ends.popitem(last=False)
            self._segment_ends.move_to_end(key)
            return self._segment_ends[key]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special token strings in it become special tokens."""
        # encode_batch releases the GIL while it works (encode holds it), so a long prompt
        # tokenized on a server's worker thread does not stall its event loop
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def _plain_messages(self, messages: Sequence[Message]) -> list[dict[str, Any]]:
        plain = [self._plain_message(index, message) for index, message in enumerate(messages)]
        if not plain:
            raise PromptError("messages must hold at least one message")
        return plain

    def _require_live_sessions(self) -> None:
        if not self.family.live_sessions:
            raise PromptError(
                f"live sessions are not supported for {self.family.model_type!r} checkpoints"
                f"{'' if self.family.has_video_token else ' (its videos are frames of images)'}"
            )

    def _split_at_video_pad(self, question: str) -> tuple[list[int], list[int]]:
        parts = [{"type": "video"}, {"type": "text", "text": question}]
        plain = self._plain_messages([{"role": "user", "content": parts}])
        token_ids = self.encode(self.chat_template.render(plain, add_generation_prompt=True))
        video_pads = [i for i, t in enumerate(token_ids) if t == self.special.video_token_id]
        if len(video_pads) != 1:
            raise CheckpointError(
                f"the chat template renders one video part as {len(video_pads)} video pad tokens; "
                "live sessions need exactly one"
            )
        return token_ids[: video_pads[0]], token_ids[video_pads[0] + 1 :]

    def _plain_message(self, index: int, message: Message) -> dict[str, Any]:
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise PromptError(f"{where} must be a dict with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise PromptError(f"{where}.role={role!r}: allowed {', '.join(ROLES)}")
        if isinstance(content, str):
            return {"role": role, "content": self._checked_text(f"{where}.content", content)}
        if not isinstance(content, Sequence):
            raise PromptError(f"{where}.content must be a string or a list of parts")
        parts = [self._plain_part(f"{where}.content[{i}]", p) for i, p in enumerate(content)]
        return {"role": role, "content": parts}

    def _plain_part(self, where: str, part: Any) -> dict[str, str]:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in PART_TYPES:
            raise PromptError(f"{where}.type={kind!r}: allowed {', '.join(PART_TYPES)}")
        if kind != "text":
            return {"type": kind}
        return {"type": "text", "text": self._checked_text(f"{where}.text", part.get("text"))}

    def _checked_text(self, where: str, text: Any) -> str:
        if not isinstance(text, str):
            raise PromptError(f"{where} must be a string, got {type(text).__name__}")
        for reserved in self._reserved_text:
            if reserved in text:
                raise PromptError(
                    f"{where} contains {reserved!r}; media go in video/image parts, not in text"
                )
        return text


def _media_kinds(messages: Sequence[Message]) -> list[str]:
    """The kinds of the media parts of plain messages, in order."""
    return [
        part["type"]
        for message in messages
        if not isinstance(message["content"], str)
        for part in message["content"]
        if part["type"] != "text"
    ]


def _check_media(part_kinds: list[str], items: list[MultiModalItem]) -> None:
    """The items must match the media parts one to one, in kind and order."""
    item_kinds = [item.kind for item in items]
    if len(part_kinds) != len(item_kinds):
        raise PromptError(
            f"the messages hold {len(part_kinds)} media parts ({', '.join(part_kinds)}) but "
            f"{len(item_kinds)} items were given ({', '.join(item_kinds)})"
        )
    for index, (part_kind, item_kind) in enumerate(zip(part_kinds, item_kinds, strict=True)):
        if part_kind != item_kind:
            raise PromptError(
                f"media part {index} is {part_kind!r} but item {index} is {item_kind!r}; "
                "give the items in the order of their parts"
            )


def _place(
    token_ids: list[int], items: list[MultiModalItem], placeholder_ids: Collection[int]
) -> Prompt:
    """Repeat each placeholder token `item.num_tokens` times for the next item (0 drops it)."""
    num_placeholders = sum(token_id in placeholder_ids for token_id in token_ids)
    if num_placeholders != len(items):
        raise CheckpointError(
            f"the chat template rendered {num_placeholders} media placeholder tokens for "
            f"{len(items)} media items; it must render one per media part"
        )
    expanded: list[int] = []
    positions: list[PlaceholderRange] = []
    remaining = iter(items)
    for token_id in token_ids:
        if token_id not in placeholder_ids:
            expanded.append(token_id)
            continue
        num_tokens = next(remaining).num_tokens
        positions.append(PlaceholderRange(len(expanded), num_tokens))
        expanded.extend([token_id] * num_tokens)
    return Prompt(expanded, items, positions)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise CheckpointError(f"{file} is not valid JSON: {error}") from error


def _eos_token_ids(
    folder: Path, tokenizer_config: Mapping[str, Any], tokenizer: Tokenizer
) -> tuple[int, ...]:
    """generation_config.json's eos ids (an int or a list), then the tokenizer's eos token."""
    configured = _read_json(folder / "generation_config.json").get("eos_token_id")
    ids = configured if isinstance(configured, list) else [configured]
    eos_token = tokenizer_config.get("eos_token")
    eos_token = eos_token.get("content") if isinstance(eos_token, Mapping) else eos_token
    if isinstance(eos_token, str):
        ids.append(tokenizer.token_to_id(eos_token))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))
