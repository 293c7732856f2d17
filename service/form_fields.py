"""A multipart form's text fields, typed and checked: each failure is a 400 naming the field."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.datastructures import FormData
from starlette.requests import Request

from stillcut.kernels.evs import EVSConfig
from stillcut.service.errors import bad_request
from stillcut.service.media import read_upload_form

T = TypeVar("T")


async def read_checked_form(
    request: Request, check: Callable[[FormData, EVSConfig | None], Awaitable[T]]
) -> T:
    """The request's multipart form (read within the server's limits) through `check(form,
    the server's default EVS)`, then closed (an uploaded file's spooled bytes go with it); the
    model it names (`checked.model`) must be the one served."""
    state = request.app.state.service
    form = await read_upload_form(request, state.config)
    try:
        checked = await check(form, state.llm.evs_default.evs)
    finally:
        await form.close()
    state.check_model(checked.model)
    return checked


def form_text(form: FormData, name: str) -> str | None:
    """The field's text (None: absent); a file in it is refused."""
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"form field {name!r} must be text, not a file", "invalid_type")
    return value


def form_texts(form: FormData, name: str) -> list[str]:
    """Every value of a field that may repeat; a file among them is refused."""
    values = form.getlist(name)
    if any(not isinstance(value, str) for value in values):
        raise bad_request(f"form field {name!r} must be text, not a file", "invalid_type")
    return list(values)


def form_number(form: FormData, name: str, kind: type) -> int | float | None:
    """The field as `kind` (int or float; None: absent or empty); finite."""
    text = form_text(form, name)
    if text is None or text == "":
        return None
    try:
        value = kind(text)
    except ValueError:
        raise bad_request(
            f"form field {name}={text!r} must be {kind.__name__}", "invalid_type"
        ) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"form field {name}={text!r} must be finite", "invalid_type")
    return value


def form_flag(form: FormData, name: str, default: bool = False) -> bool:
    """The field as a bool: true / false / 1 / 0 (absent: `default`)."""
    text = (form_text(form, name) or str(default)).lower()
    if text not in ("true", "false", "1", "0"):
        raise bad_request(f"form field {name}={text!r} must be true or false", "invalid_type")
    return text in ("true", "1")
