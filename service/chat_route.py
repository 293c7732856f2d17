"""`POST /v1/chat/completions` and `GET /v1/models`, as OpenAI clients expect them.

A chat request's media (`video_url` / `image_url` parts) are fetched or decoded from their
URLs, encoded together on the encode worker, and placed in the conversation where their
parts were; a URL that appears several times is fetched and encoded once. Earlier assistant
turns are part of the prompt like any other message; the body is parsed and the prompt
tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stillcut.service.chat_request import ChatRequest, check_evs_stage, parse_chat_request
from stillcut.service.media import read_body, refuse_gif_image, unsupported_type
from stillcut.service.media_url import resolve_media_url
from stillcut.service.openai_format import ChatFormatter
from stillcut.service.reasoning import ThinkSplitter
from stillcut.service.request_limits import check_media_count
from stillcut.service.result import evs_summary
from stillcut.service.sse import sse_response
from stillcut.service.state import (
    ServiceState,
    last_output,
    record_of,
    seconds_left,
    until_disconnect,
)
from stillcut.vision.pipeline import ImageInput, VideoInput

JSON_OVERHEAD_BYTES = 1 << 20  # the conversation's text around its data URLs


def chat_body_limit(max_upload_bytes: int) -> int:
    """A body may hold one upload's worth of media as base64 (4/3 larger), plus text."""
    return max_upload_bytes * 4 // 3 + JSON_OVERHEAD_BYTES


async def models_endpoint(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    model = {
        "id": state.llm.name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "stillcut",
        "max_model_len": state.llm.engine.config.scheduler.max_model_len,
        "evs_default": state.llm.evs_default.to_dict(),
    }
    return JSONResponse({"object": "list", "data": [model]})


async def chat_endpoint(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    budget = seconds_left(request, state.config)
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise unsupported_type(
            f"Content-Type {content_type or '(none)'!r} is not supported; send application/json"
        )
    body = await read_body(request, chat_body_limit(state.config.max_upload_bytes))
    # parsing a large body takes long: it runs on the prompt worker, never on the event loop
    chat = await state.prompter.run(lambda: parse_chat_request(body, state.llm.evs_default.evs))
    state.check_model(chat.model)
    check_media_count(len(chat.media), state.config)
    async with asyncio.timeout(budget):
        return await until_disconnect(request, _complete(request, state, chat, budget))


async def _complete(
    request: Request, state: ServiceState, chat: ChatRequest, budget: float
) -> Response:
    record = record_of(request)
    config = state.config
    sampling = chat.video.input_options(config, state.llm.pipeline.decode_config)
    chat.video.check_pixels(state.llm.pipeline)
    check_evs_stage(chat.evs, state.llm.pipeline.family)
    sources: dict[tuple[str, str], bytes | Path] = {}
    for part in chat.media:  # a URL given twice is fetched once
        if (part.kind, part.url) not in sources:
            sources[part.kind, part.url] = await resolve_media_url(
                part.url, part.kind, part.where, config, state.http
            )
            if part.kind == "image":
                refuse_gif_image(sources[part.kind, part.url], part.where)
    inputs = [
        ImageInput(sources[part.kind, part.url])
        if part.kind == "image"
        else VideoInput(sources[part.kind, part.url], evs=chat.evs, **sampling)
        for part in chat.media
    ]
    max_video_tokens = chat.video.max_video_tokens
    items = (
        await state.encode(inputs, chat.params.max_tokens, record, max_video_tokens)
        if inputs
        else []
    )
    processor = state.llm.processor
    prompt = await state.build_prompt(
        lambda: processor.build(chat.messages, items, chat.template_kwargs)
    )
    setting = "off" if chat.evs is None or chat.evs.is_off else chat.evs.key()
    formatter = ChatFormatter(
        request_id=record.request_id,
        model=state.llm.name,
        tokenizer=processor.tokenizer,
        logprobs=chat.logprobs,
        include_usage=chat.include_usage,
        evs=evs_summary(items, setting) if any(i.kind == "video" for i in items) else None,
        reasoning=(
            ThinkSplitter.for_prompt(processor.tokenizer, prompt.token_ids)
            if config.reasoning_parser == "think"
            else None
        ),
    )
    outputs = state.generate(prompt, chat.params, items, record)
    first = await anext(outputs)
    if not chat.stream:
        return JSONResponse(formatter.completion(await last_output(first, outputs)))
    return sse_response(
        first,
        outputs,
        seconds_left=budget - (time.monotonic() - record.arrival),
        record=record,
        retry_after=config.retry_after_s,
        events=formatter.chunks,
    )
