"""`POST /v1/videos/plan`: what describing a video would sample and cost, before any decoding.

The video is the request body (`video/*` or `application/octet-stream`), or named by a `url`
query parameter (data:, file: inside the media folder, or an allowed http(s) host, as chat
requests name media). The query holds the video options (`video_options`), `evs` (JSON as in
chat requests, or "off"; default: the server's) and `max_tokens` (the answer's room, default
as in describe). The answer is the plan (`vision.video_plan.VideoPlan`): the frames that
would be sampled and their times, tokens before EVS and after (exact in rate mode, a range in
threshold mode), KV bytes, whether it fits `max_model_len` and the server's limits, and when
it does not, the most frames that would. Only the container's packet index is read.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stillcut.service.api import DEFAULT_MAX_TOKENS
from stillcut.service.chat_request import parse_evs_text
from stillcut.service.errors import bad_request
from stillcut.service.media import check_content_type, read_body
from stillcut.service.media_url import resolve_media_url
from stillcut.service.state import ServiceState, record_of
from stillcut.service.video_options import parse_video_options, video_option_names

_QUERY = {"url", "evs", "max_tokens", "model", *video_option_names()}


async def plan_endpoint(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    query = request.query_params
    unknown = sorted(set(query) - _QUERY)
    if unknown:
        raise bad_request(f"unknown query field(s): {', '.join(unknown)}", "unsupported_parameter")
    state.check_model(query.get("model"))
    options = parse_video_options(query)
    pipeline = state.llm.pipeline
    options.check_pixels(pipeline)
    evs = parse_evs_text(query.get("evs"), state.llm.evs_default.evs)
    max_tokens = _max_tokens(query.get("max_tokens"))
    source = await _source(request, state, query.get("url"))
    inputs = options.input_options(state.config, pipeline.decode_config)
    pixels = dict(inputs.pop("pixels"))
    budget = {"max_tokens": max_tokens, "max_video_tokens": options.max_video_tokens}
    plan = await state.prompter.run(
        lambda: state.llm.plan(source, evs=evs, pixels=pixels, **budget, **inputs)
    )
    meta = {"id": record_of(request).request_id, "object": "video.plan", "model": state.llm.name}
    return JSONResponse({**meta, "created": int(time.time()), **plan.to_dict()})


async def _source(request: Request, state: ServiceState, url: str | None) -> bytes:
    if url is not None:
        return await resolve_media_url(url, "video", "url", state.config, state.http)
    check_content_type(request.headers.get("content-type"), "video", "the body")
    data = await read_body(request, state.config.max_upload_bytes, "the video")
    if not data:
        raise bad_request("send the video as the body, or name it with ?url=", "missing_file")
    return data


def _max_tokens(text: str | None) -> int:
    if text is None:
        return DEFAULT_MAX_TOKENS
    if not text.isdigit() or int(text) < 1:
        raise bad_request(f"max_tokens={text!r} must be an integer >= 1", "invalid_type")
    return int(text)
