"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` renders it.

Rendering needs only jinja2 (which torch already requires), not transformers: importing
transformers and building its tokenizer wrapper costs seconds the prompt processor does not
need. The environment matches transformers' (sandboxed, `trim_blocks`, `lstrip_blocks`, loop
controls, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`) and the
template sees the same variables: the messages, `add_generation_prompt`, `tools`, `documents`
and the tokenizer's special token strings (`bos_token`, `eos_token`, ...). Templates come from
checkpoints, which may be untrusted, hence the sandbox.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stillcut.engine.model_config import CheckpointError

# The tokenizer_config.json entries that transformers hands the template as variables.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
RENDER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplate:
    """A compiled chat template plus the special token strings it may refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    @classmethod
    def from_checkpoint(
        cls, folder: Path, tokenizer_config: Mapping[str, Any] | None = None
    ) -> ChatTemplate:
        """The template of the checkpoint in `folder`.

        Looked up where checkpoints keep it: `chat_template.jinja`, then `chat_template.json`
        (the processor's file in older vision-language releases), then `tokenizer_config.json`'s
        `chat_template` (a string, or a list of named templates of which `default` is used).
        """
        config = tokenizer_config or {}
        return cls(_template_source(folder, config), _special_token_strings(config))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (plain dicts, as the template expects them).
        `extra` are more template variables (`chat_template_kwargs`, e.g. `enable_thinking`);
        they may not replace the ones set here, nor the template's globals (`namespace`,
        `range`, ...)."""
        globals_ = self._template.environment.globals
        taken = sorted(set(extra or ()) & {*RENDER_VARIABLES, *self.special_tokens, *globals_})
        if taken:
            raise ValueError(f"chat template variables {taken} are set by the server")
        try:
            return self._template.render(
                messages=list(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **(extra or {}),
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template rejected the messages: {error}") from error


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _template_source(folder: Path, tokenizer_config: Mapping[str, Any]) -> str:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        try:
            return json.loads(json_file.read_text(encoding="utf-8"))["chat_template"]
        except (ValueError, KeyError) as error:
            raise CheckpointError(f"{json_file} holds no chat_template: {error}") from error
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        source = {entry.get("name"): entry.get("template") for entry in source}.get("default")
    if not isinstance(source, str):
        raise CheckpointError(
            f"{folder} has no chat template (looked for chat_template.jinja, chat_template.json "
            "and a default chat_template in tokenizer_config.json)"
        )
    return source


def _special_token_strings(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    strings = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = tokenizer_config.get(key)
        # Older configs store an AddedToken as a dict with its text under "content".
        value = value.get("content") if isinstance(value, Mapping) else value
        if isinstance(value, str):
            strings[key] = value
    return strings
