"""`POST /v1/videos/describe`: one uploaded video and a prompt in, a description out.

The form holds `file` (the video) and optionally `prompt`, `model`, `evs` (JSON, as in chat
requests, or "off"), the sampling fields (`max_tokens`, `temperature`, `top_p`, `top_k`,
`min_p`, `seed`, `repetition_penalty`, `presence_penalty`, `frequency_penalty`, `stop`, which
may repeat), the video options (`video_options`: `fps`, `max_frames`, `num_frames`, `start`,
`end`, the model's pixel budget such as `max_pixels`, `max_video_tokens`, `resize`), `stream`
and `include_frames` (adds `frames`: base64 JPEG thumbnails of the sampled frames and each
tubelet's retention mask, for the web page). The answer is the `DescribeResult` as JSON, or
with `stream=true` server-sent events: `{"type": "token", "text"}` per piece of text, then
`{"type": "result", ...}` with the whole result.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stillcut.engine.llm_engine import RequestOutput
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.service.api import DEFAULT_PROMPT
from stillcut.service.chat_request import check_evs_stage, parse_evs_text, sampling_params
from stillcut.service.errors import bad_request
from stillcut.service.form_fields import form_flag, form_number, form_text, read_checked_form
from stillcut.service.frames_view import frames_view, thumbnails
from stillcut.service.media import check_content_type
from stillcut.service.result import describe_result
from stillcut.service.sse import sse_response
from stillcut.service.state import (
    ServiceState,
    last_output,
    record_of,
    seconds_left,
    until_disconnect,
)
from stillcut.service.video_options import VideoOptions, parse_video_options, video_option_names
from stillcut.vision.pipeline import VideoInput

_NUMBERS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
}
_FIELDS = {"file", "prompt", "model", "evs", "stop", "stream", "include_frames", *_NUMBERS}
_FIELDS |= set(video_option_names())
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty")
_PENALTIES = ("presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class DescribeForm:
    """A checked describe request."""

    data: bytes
    prompt: str
    model: str | None
    evs: EVSConfig | None
    params: SamplingParams
    video: VideoOptions
    stream: bool
    include_frames: bool


async def describe_endpoint(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    record = record_of(request)
    budget = seconds_left(request, state.config)
    checked = await read_checked_form(request, _check_form)
    decode_defaults = state.llm.pipeline.decode_config
    video = checked.video.input_options(state.config, decode_defaults)
    checked.video.check_pixels(state.llm.pipeline)
    check_evs_stage(checked.evs, state.llm.pipeline.family)
    spec = VideoInput(checked.data, evs=checked.evs, **video)
    setting = "off" if checked.evs is None or checked.evs.is_off else checked.evs.key()

    frames: dict = {}

    def result_body(items: list[MultiModalItem], output: RequestOutput) -> dict:
        result = describe_result(items, output, record.arrival, setting).to_dict()
        meta = {"id": record.request_id, "object": "video.description", "model": state.llm.name}
        return {**meta, "created": int(time.time()), **result, **frames}

    async def run() -> Response:
        max_video_tokens = checked.video.max_video_tokens
        items = await state.encode([spec], checked.params.max_tokens, record, max_video_tokens)
        if checked.include_frames:
            work = state.llm.pipeline.work
            thumbs = await state.encoder.run(
                lambda: thumbnails(checked.data, decode_defaults, video, work)
            )
            frames["frames"] = frames_view(items[0], thumbs)
        processor = state.llm.processor
        prompt = await state.build_prompt(lambda: processor.build_text(checked.prompt, items))
        outputs = state.generate(prompt, checked.params, items, record)
        first = await anext(outputs)
        if not checked.stream:
            return JSONResponse(result_body(items, await last_output(first, outputs)))

        def events(output: RequestOutput) -> list[dict]:
            text = [{"type": "token", "text": output.delta}] if output.delta else []
            if not output.finished:
                return text
            return [*text, {"type": "result", **result_body(items, output)}]

        return sse_response(
            first,
            outputs,
            seconds_left=budget - (time.monotonic() - record.arrival),
            record=record,
            retry_after=state.config.retry_after_s,
            events=events,
        )

    async with asyncio.timeout(budget):
        return await until_disconnect(request, run())


async def _check_form(form: FormData, default_evs: EVSConfig | None) -> DescribeForm:
    unknown = sorted(set(form.keys()) - _FIELDS)
    if unknown:
        raise bad_request(f"unknown form field(s): {', '.join(unknown)}", "unsupported_parameter")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise bad_request("the form needs the video as a file in its 'file' field", "missing_file")
    check_content_type(upload.content_type, "video", "the uploaded file")
    numbers = {name: form_number(form, name, kind) for name, kind in _NUMBERS.items()}
    fields = {
        name: numbers[name] for name in (*_SAMPLING, *_PENALTIES) if numbers[name] is not None
    }
    params = sampling_params(fields, numbers["max_tokens"], form.getlist("stop") or None, None)
    return DescribeForm(
        data=await upload.read(),
        prompt=form_text(form, "prompt") or DEFAULT_PROMPT,
        model=form_text(form, "model"),
        evs=parse_evs_text(form_text(form, "evs"), default_evs),
        params=params,
        video=parse_video_options({name: form_text(form, name) for name in video_option_names()}),
        stream=form_flag(form, "stream"),
        include_frames=form_flag(form, "include_frames"),
    )
