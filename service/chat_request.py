"""OpenAI chat-completions requests: checked, and turned into what the engine runs.

A request's messages become the prompt processor's messages, with each `video_url` /
`image_url` part replaced by a `{"type": "video"}` / `{"type": "image"}` placeholder and its
URL collected, in order, for the media loader. Sampling fields map onto `SamplingParams`;
stillcut's extras (`evs`, the video options of `video_options` such as `fps`, `num_frames`,
`start`, `end`, `max_pixels`, `max_video_tokens`, and `top_k`, `min_p`, `repetition_penalty`)
sit in the same body, and `chat_template_kwargs` (extra chat-template variables, e.g.
`{"enable_thinking": false}`) as in vLLM. Fields we do not support are refused (400), never
silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stillcut.engine.models.registry import ModelFamily
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.service.api import DEFAULT_MAX_TOKENS
from stillcut.service.errors import bad_request, shown
from stillcut.service.evs_default import EVSChoice
from stillcut.service.media import MediaKind
from stillcut.service.request_limits import JSONRefused, check_stop, loads_json
from stillcut.service.video_options import VideoOptions, parse_video_options, video_option_names
from stillcut.vision.pixel_stage import check_pixel_stage

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MEDIA_PARTS: dict[str, MediaKind] = {"video_url": "video", "image_url": "image"}
_SAMPLING_FIELDS = {  # body field -> SamplingParams field
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}
_IGNORED_FIELDS = ("user", "metadata", "store")
_FIELDS = {
    *_SAMPLING_FIELDS,
    *_IGNORED_FIELDS,
    *("model", "messages", "max_tokens", "max_completion_tokens", "stop", "n", "stream"),
    *("stream_options", "logprobs", "top_logprobs", "evs", *video_option_names()),
    "chat_template_kwargs",
}
_EVS_FIELDS = ("mode", "rate", "threshold", "max_per_tubelet", "floor", "stage")
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", dict: "an object"}


@dataclass(frozen=True)
class MediaPart:
    """One media URL of the conversation; `where` names it in error messages."""

    kind: MediaKind
    url: str
    where: str


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request."""

    model: str | None
    messages: list[dict[str, Any]]
    media: list[MediaPart]
    params: SamplingParams
    evs: EVSConfig | None
    video: VideoOptions
    stream: bool
    include_usage: bool
    logprobs: bool
    template_kwargs: dict[str, Any] | None = None


def parse_chat_request(body: bytes, default_evs: EVSConfig | None) -> ChatRequest:
    """Parse and check a request body; `APIError` (400) says what is wrong. A request without
    `evs` gets `default_evs`."""
    try:
        data = loads_json(body)
    except JSONRefused as error:
        raise bad_request(f"the body is refused: {error}", error.code) from None
    except ValueError as error:  # UnicodeDecodeError included
        raise bad_request(f"the body is not valid JSON: {error}", "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", "invalid_json")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise bad_request(
            f"unsupported parameter(s): {', '.join(unknown)}", "unsupported_parameter"
        )
    if data.get("n", 1) != 1:
        raise bad_request(f"n={shown(data['n'])}: only n=1 is supported", "unsupported_parameter")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "invalid_type")
    messages, media = _messages(data.get("messages"))
    stream = _optional(data, "stream", bool, False)
    stream_options = _optional(data, "stream_options", dict, {})
    logprobs = _optional(data, "logprobs", bool, False)
    return ChatRequest(
        model=model,
        messages=messages,
        media=media,
        params=_sampling_params(data, logprobs),
        evs=parse_evs(data.get("evs", "default"), "evs", default_evs),
        video=parse_video_options(data),
        stream=stream,
        include_usage=_optional(stream_options, "include_usage", bool, True),
        logprobs=logprobs,
        template_kwargs=_optional(data, "chat_template_kwargs", dict, None),
    )


def parse_evs(value: Any, where: str, default: EVSChoice) -> EVSChoice:
    """`"default"` (`default` as given: the server's setting, or `UNSET` to resolve later),
    `"off"` / None (keep all), or an object with `mode` and that mode's fields, e.g.
    `{"mode": "threshold", "threshold": 0.1}`."""
    if value == "default":
        return default
    if value is None or value == "off":
        return None
    if not isinstance(value, Mapping):
        raise bad_request(
            f'{where} must be "off" or an object like {{"mode": "rate", "rate": 0.75}}',
            "invalid_evs",
        )
    unknown = sorted(set(value) - set(_EVS_FIELDS))
    if unknown:
        raise bad_request(
            f"{where} has unknown field(s) {', '.join(unknown)}; allowed: {', '.join(_EVS_FIELDS)}",
            "invalid_evs",
        )
    try:
        return EVSConfig(**value)
    except (TypeError, ValueError) as error:
        raise bad_request(f"{where}: {error}", "invalid_evs") from None


def check_evs_stage(evs: EVSConfig | None, family: ModelFamily) -> None:
    """400 unless the served model's family can prune at `evs`'s stage (a family whose tower
    cannot encode a subset of its tokens refuses `"stage": "pixels"`)."""
    try:
        check_pixel_stage(family, evs)
    except ValueError as error:
        raise bad_request(f"evs: {error}", "invalid_evs") from None


def parse_evs_text(text: str | None, default: EVSChoice) -> EVSChoice:
    """`parse_evs` of a form field or query value: JSON text, "off", or absent (`default`)."""
    try:
        value = "default" if text is None else "off" if text == "off" else loads_json(text)
    except JSONRefused as error:
        raise bad_request(f"evs: {error}", error.code) from None
    except ValueError:
        raise bad_request(
            'evs must be JSON such as {"mode": "rate", "rate": 0.75}, or "off"', "invalid_evs"
        ) from None
    return parse_evs(value, "evs", default)


def sampling_params(fields: Mapping[str, Any], max_tokens: Any, stop: Any, logprobs: Any):
    """`SamplingParams` from already-typed fields; its own checks become 400s."""
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("stop must be a string or a list of strings", "invalid_type")
    try:
        return SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            stop=check_stop(tuple(stop)),
            logprobs=logprobs,
            **fields,
        )
    except (TypeError, ValueError) as error:
        raise bad_request(str(error), "invalid_parameter") from None


def _sampling_params(data: dict[str, Any], logprobs: bool) -> SamplingParams:
    top_logprobs = _optional(data, "top_logprobs", int, None)
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "invalid_parameter")
    fields = {
        name: value
        for key, name in _SAMPLING_FIELDS.items()
        if (value := data.get(key)) is not None
    }
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    num_logprobs = (top_logprobs or 0) if logprobs else None
    return sampling_params(fields, max_tokens, data.get("stop"), num_logprobs)


def _messages(raw: Any) -> tuple[list[dict[str, Any]], list[MediaPart]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "invalid_messages")
    messages, media = [], []
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", "invalid_messages")
        raw_role = message.get("role")
        role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise bad_request(
                f"{where}.role={shown(raw_role)}: allowed {', '.join(_ROLES)}",
                "invalid_messages",
            )
        content = message.get("content")
        if isinstance(content, list):
            content = [
                _part(part, f"{where}.content[{i}]", media) for i, part in enumerate(content)
            ]
        elif not isinstance(content, str):
            raise bad_request(
                f"{where}.content must be a string or a list of parts", "invalid_messages"
            )
        messages.append({"role": role, "content": content})
    return messages, media


def _part(part: Any, where: str, media: list[MediaPart]) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text must be a string", "invalid_messages")
        return {"type": "text", "text": part["text"]}
    if isinstance(kind, str) and kind in _MEDIA_PARTS:
        target = part.get(kind)
        url = target.get("url") if isinstance(target, dict) else None
        if not isinstance(url, str):
            raise bad_request(f'{where}.{kind} must be {{"url": "..."}}', "invalid_messages")
        media.append(MediaPart(_MEDIA_PARTS[kind], url, f"{where}.{kind}.url"))
        return {"type": _MEDIA_PARTS[kind]}
    allowed = ", ".join(("text", *_MEDIA_PARTS))
    raise bad_request(f"{where}.type={shown(kind)}: allowed {allowed}", "invalid_messages")


def _optional(data: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"{key} must be {_TYPE_NAMES[kind]}, got {shown(value)}", "invalid_type")
    if kind is float and not math.isfinite(value):
        raise bad_request(f"{key} must be finite, got {value!r}", "invalid_type")
    return value
