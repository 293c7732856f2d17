"""`POST /v1/videos/summarize`: a video longer than one context in, its timeline and summary out.

The multipart form holds the video as `file`, or names it with `url` (data:, file: inside the
media folder, or an allowed http(s) host, as chat requests name media), and optionally
`model`, `evs` (JSON as in chat requests, or "off"; without it, the server's default, short
chunks kept whole as in `vision.summary.chunks`), `chunk_s`, `overlap_s`, `caption_tokens`,
`summary_tokens`, `summarize` (false: the timeline only), `question` (may repeat: questions
about when something happens, answered from the timeline), `stream`, and the video options
`fps`, `start`, `end`, the model's pixel budget and `max_video_tokens` (each chunk's). The
answer is the summary (`VideoSummary`) as JSON, or with `stream=true` server-sent events:
`{"type": "plan", ...}` once the chunks are known, `{"type": "chunk", ...}` per caption as it
is written, `{"type": "aggregate", ...}` per aggregation prompt, then `{"type": "result", ...}`
and `[DONE]`. A request is bounded like the others: by its upload, its deadline, the chunks a
video may give (`SummaryOptions.max_chunks`) and the captions in flight; problems with the
video or the chunking are answered before the stream opens, with their HTTP status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stillcut.kernels.evs import EVSConfig
from stillcut.service.chat_request import parse_evs_text
from stillcut.service.errors import api_error, bad_request
from stillcut.service.evs_default import UNSET, EVSChoice
from stillcut.service.form_fields import (
    form_flag,
    form_number,
    form_text,
    form_texts,
    read_checked_form,
)
from stillcut.service.media import check_content_type
from stillcut.service.media_url import resolve_media_url
from stillcut.service.sse import DONE, sse_event
from stillcut.service.state import ServiceState, record_of, seconds_left, until_disconnect
from stillcut.service.summary_api import ServiceHost, summary_request, with_answers
from stillcut.service.video_options import VideoOptions, parse_video_options, video_option_names
from stillcut.vision.summary.chunks import ChunkingError
from stillcut.vision.summary.result import VideoSummary
from stillcut.vision.summary.summarize import SummaryOptions, summarize
from stillcut.vision.summary.when import check_when_question

_NUMBERS = {"chunk_s": float, "overlap_s": float, "caption_tokens": int, "summary_tokens": int}
_UNSAMPLED = ("max_frames", "num_frames")  # a summary samples every chunk at fps
_FIELDS = {"file", "url", "model", "evs", "question", "stream", "summarize", *_NUMBERS}
_FIELDS |= set(video_option_names()) - set(_UNSAMPLED)
MAX_QUESTIONS = 16
MAX_QUESTION_CHARS = 1000
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class SummarizeForm:
    """A checked summarize request (the video as uploaded bytes, or its URL)."""

    data: bytes | None
    url: str | None
    model: str | None
    evs: EVSChoice  # UNSET: the server's default (`summary_request` resolves it)
    options: dict
    video: VideoOptions
    questions: tuple[str, ...]
    stream: bool


async def summarize_endpoint(request: Request) -> Response:
    state: ServiceState = request.app.state.service
    record = record_of(request)
    budget = seconds_left(request, state.config)
    checked = await read_checked_form(request, _check_form)
    checked.video.check_pixels(state.llm.pipeline)
    video = checked.video.input_options(state.config, state.llm.pipeline.decode_config)
    video = {name: video[name] for name in ("fps", "start", "end")}

    def body(summary: VideoSummary) -> dict:
        meta = {"id": record.request_id, "object": "video.summary", "model": state.llm.name}
        record.evs_kept += summary.usage.video_tokens_after
        record.evs_total += summary.usage.video_tokens_before
        answered = with_answers(summary, checked.questions)
        return {**meta, "created": int(time.time()), **answered.to_dict()}

    async def run() -> Response:
        source = checked.data
        if source is None:
            source = await resolve_media_url(checked.url, "video", "url", state.config, state.http)
        chunk_request, options = _requests(state, source, checked, video)
        events: asyncio.Queue[dict] = asyncio.Queue()
        planned = asyncio.get_running_loop().create_future()

        def heard(event: dict) -> None:
            if event["type"] == "plan" and not planned.done():
                planned.set_result(None)
            events.put_nowait(event)

        host = ServiceHost(state, record)
        llm = state.llm
        scheduler = llm.engine.config.scheduler
        work = summarize(
            host, llm.pipeline, llm.processor, scheduler, chunk_request, options, heard
        )
        task = asyncio.create_task(_chunking_checked(work))
        if not checked.stream:
            return JSONResponse(body(await _shielded(task)))
        await asyncio.wait({task, planned}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and task.exception() is not None:
            raise task.exception()
        left = budget - (time.monotonic() - record.arrival)
        return _event_stream(task, events, body, left, record, state.config.retry_after_s)

    async with asyncio.timeout(budget):
        return await until_disconnect(request, run())


def _requests(state: ServiceState, source: bytes | Path, checked: SummarizeForm, video: dict):
    try:
        return summary_request(
            state.llm,
            source,
            checked.evs,
            **checked.options,
            **video,
            pixels=dict(checked.video.pixels),
            max_video_tokens=checked.video.max_video_tokens,
        )
    except ValueError as error:  # the options' own checks (SummaryOptions)
        raise bad_request(str(error), "invalid_parameter") from None


async def _chunking_checked(work):
    """`work`, its `ChunkingError` (chunks that cannot be) a 400."""
    try:
        return await work
    except ChunkingError as error:
        raise bad_request(str(error), "invalid_chunking") from None


async def _shielded(task: asyncio.Task):
    """`task`'s result; cancelling the caller cancels the task and waits for it to end."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise


def _event_stream(task, events, body, seconds_left: float, record, retry_after) -> Response:
    """The summary's events as they come, its result, then `[DONE]`; a failure mid-way is an
    error event. A client that leaves cancels the summary."""

    async def stream() -> AsyncIterator[bytes]:
        try:
            async with asyncio.timeout(seconds_left):
                while not (task.done() and events.empty()):
                    getter = asyncio.ensure_future(events.get())
                    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if getter.done():
                        yield sse_event(getter.result())
                    else:
                        getter.cancel()
                yield sse_event({"type": "result", **body(task.result())})
        except Exception as error:  # headers are sent: report in the stream
            api = api_error(error, retry_after=retry_after)
            record.error_code = api.code
            yield sse_event(api.body(record.request_id))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        yield DONE

    return StreamingResponse(stream(), media_type="text/event-stream", headers=_HEADERS)


async def _check_form(form: FormData, _: EVSConfig | None) -> SummarizeForm:
    # the server's default EVS is left UNSET here: a summary treats a default as one
    unknown = sorted(set(form.keys()) - _FIELDS)
    if unknown:
        unsampled = [name for name in unknown if name in _UNSAMPLED]
        if unsampled:
            raise bad_request(
                f"{', '.join(unsampled)}: a summary samples every chunk at fps; set fps and "
                "chunk_s instead",
                "unsupported_parameter",
            )
        raise bad_request(f"unknown form field(s): {', '.join(unknown)}", "unsupported_parameter")
    upload, url = form.get("file"), form_text(form, "url")
    if (upload is None) == (url is None):
        raise bad_request(
            "send the video as the 'file' field or name it with 'url'", "missing_file"
        )
    if upload is not None and not isinstance(upload, UploadFile):
        raise bad_request("the form's 'file' field must be a file", "missing_file")
    if upload is not None:
        check_content_type(upload.content_type, "video", "the uploaded file")
    questions = tuple(form_texts(form, "question"))
    if len(questions) > MAX_QUESTIONS:
        raise bad_request(f"{len(questions)} questions: at most {MAX_QUESTIONS}", "over_limit")
    for question in questions:
        if len(question) > MAX_QUESTION_CHARS:
            raise bad_request(f"a question has over {MAX_QUESTION_CHARS} characters", "over_limit")
        try:
            check_when_question(question)
        except ValueError as error:
            raise bad_request(str(error), "invalid_question") from None
    numbers = {name: form_number(form, name, kind) for name, kind in _NUMBERS.items()}
    options = {name: value for name, value in numbers.items() if value is not None}
    options["summarize"] = form_flag(form, "summarize", default=True)
    try:
        SummaryOptions(**options)
    except ValueError as error:
        raise bad_request(str(error), "invalid_parameter") from None
    names = set(video_option_names()) - set(_UNSAMPLED)
    return SummarizeForm(
        data=await upload.read() if upload is not None else None,
        url=url,
        model=form_text(form, "model"),
        evs=parse_evs_text(form_text(form, "evs"), UNSET),
        options=options,
        video=parse_video_options({name: form_text(form, name) for name in names}),
        questions=questions,
        stream=form_flag(form, "stream"),
    )
