"""The bounds on what one request may ask of the server, checked before any work starts.

A client chooses the JSON it sends, its stop strings, how many media it attaches and how
densely each video is sampled; unbounded, each of those lets one request slow every other
(deep JSON exhausts the parser's stack, stop strings are matched on the engine thread, frames
are decoded and encoded). Each bound here is refused with a message naming it. The server's
frame and fps ceilings also cap its own defaults, so a request that names nothing is bounded
too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from stillcut.service.config import ServerConfig
from stillcut.service.errors import bad_request
from stillcut.vision.decode import DecodeConfig

MAX_JSON_DEPTH = 64
MAX_JSON_VALUES = 1_000_000  # counted as commas (those in strings too): parsing stays bounded
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_TOO_DEEP = f"the JSON is nested deeper than the limit of {MAX_JSON_DEPTH} levels"


class JSONRefused(ValueError):
    """A JSON document past a bound; `code` says which: "json_too_deep", "json_too_large"
    or "invalid_text" (a lone surrogate, which no UTF-8 text can hold)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def loads_json(data: str | bytes) -> Any:
    """`json.loads`, refusing (`JSONRefused`) documents with more than `MAX_JSON_VALUES` commas
    (before parsing), nested deeper than `MAX_JSON_DEPTH`, or holding a lone surrogate escape
    (`"\\ud800"`); other bad JSON raises `ValueError` as json does, with a message that names
    no interpreter setting. Costs O(size): run it off the event loop for large documents."""
    comma = b"," if isinstance(data, bytes) else ","
    if data.count(comma) >= MAX_JSON_VALUES:
        raise JSONRefused(
            f"the JSON holds more than {MAX_JSON_VALUES} values (counted as its commas)",
            "json_too_large",
        )
    try:
        value = json.loads(data)
    except RecursionError:  # deeper than the interpreter's stack: far past the limit
        raise JSONRefused(_TOO_DEEP, "json_too_deep") from None
    except ValueError as error:
        if "set_int_max_str_digits" in str(error):  # the interpreter's own bound on integers
            raise ValueError("a number in the JSON has more than 4300 digits") from None
        raise
    _check(value)
    return value


def _check(value: Any) -> None:
    """Every container of `value` within `MAX_JSON_DEPTH` levels, every string valid text."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _LONE_SURROGATE.search(item):
                raise JSONRefused(
                    "the JSON holds a lone surrogate escape (such as \\ud800): text must be "
                    "valid Unicode",
                    "invalid_text",
                )
            continue
        if isinstance(item, dict):
            children = [*item, *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise JSONRefused(_TOO_DEEP, "json_too_deep")
        stack.extend((child, depth + 1) for child in children)


def check_stop(stop: tuple) -> tuple[str, ...]:
    """`stop` if it holds at most `MAX_STOP_STRINGS` strings of at most `MAX_STOP_CHARS`
    characters; `ValueError` otherwise."""
    if not all(isinstance(text, str) for text in stop):
        raise ValueError("stop must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(
            f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed"
        )
    return stop


def checked_sampling(
    fps: float | None, max_frames: int | None, config: ServerConfig, defaults: DecodeConfig
) -> dict[str, Any]:
    """A request's `fps` and `max_frames` under the server's ceilings (400 above one); where
    the request names none and the server's default is above its ceiling, the ceiling."""
    values = {}
    asked_values = (("fps", fps, "limit_fps"), ("max_frames", max_frames, "limit_frames"))
    for name, asked, limit_name in asked_values:
        limit = getattr(config, limit_name)
        if asked is not None and asked > limit:
            raise bad_request(
                f"{name}={asked:g} exceeds the server's {limit_name}={limit:g}", "over_limit"
            )
        default = getattr(defaults, name)
        values[name] = asked if asked is not None or default <= limit else limit
    return values


def check_media_count(num_media: int, config: ServerConfig) -> None:
    """400 when a request attaches more media than `limit_mm_per_prompt`."""
    if num_media > config.limit_mm_per_prompt:
        raise bad_request(
            f"the request has {num_media} media parts; the server's "
            f"limit_mm_per_prompt={config.limit_mm_per_prompt}",
            "too_many_media",
        )
