"""Long-video summaries through the Python API, `POST /v1/videos/summarize` and the CLI.

The trained demo model (real words) on a 12 s clip cut into 4 s chunks: each caption is what
the engine writes for that chunk asked about on its own; captions are aggregated in rounds;
asking again (another summary, a when-question) decodes and encodes nothing and finds the
prompts in the prefix cache. The route answers the same as the API, streams one event per
chunk, refuses bad requests with the documented errors, and a client that leaves frees
everything.
"""

import io
import json
from contextlib import redirect_stdout
from fractions import Fraction

import httpx
import pytest

from stillcut.demo import demo_checkpoint
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.service.cli import main
from stillcut.service.config import ServerConfig
from stillcut.vision.summary.prompts import chunk_caption_messages
from stillcut.vision.synthetic import moving_texture, write_video

from .conftest import (
    assert_error,
    assert_healthy,
    data_url,
    make_llm,
    running_server,
    settled_pool_state,
)

SPANS = [(0.0, 4.0), (4.0, 8.0), (8.0, 12.0)]
OPTIONS = {"chunk_s": 4.0, "caption_tokens": 16, "summary_tokens": 16}
QUESTION = "when does the yellow cross appear?"


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("summary") / "clip.mp4"
    write_video(path, moving_texture(96, 112, 84, seed=11), time_base=Fraction(1, 8))
    return path


@pytest.fixture(scope="module")
def llm():
    return make_llm(demo_checkpoint())


@pytest.fixture(scope="module")
def first(llm, clip_path):
    return llm.summarize(clip_path, captions_per_round=2, questions=[QUESTION], **OPTIONS)


@pytest.fixture(scope="module")
def server(tmp_path_factory, clip_path):
    media_dir = tmp_path_factory.mktemp("summary-media")
    (media_dir / "clip.mp4").write_bytes(clip_path.read_bytes())
    config = ServerConfig(media_dir=media_dir, max_upload_bytes=512 * 1024)
    with running_server(demo_checkpoint(), config) as server:
        yield server


def test_each_caption_is_the_chunk_asked_about_alone(llm, first, clip_path):
    assert [(e.start_s, e.end_s) for e in first.timeline] == SPANS
    for entry in first.timeline:  # 4 tubelets: the default rate would keep only the first
        item = llm.pipeline.video(clip_path, evs=None, start=entry.start_s, end=entry.end_s)
        prompt = llm.processor.build(chunk_caption_messages(entry.start_s, entry.end_s), [item])
        (output,) = llm.engine.generate([prompt], SamplingParams(max_tokens=16))
        assert entry.text == " ".join(output.text.split()) != ""
    usage = first.usage
    assert (usage.num_chunks, usage.num_cached_chunks) == (3, 0)
    assert usage.num_whole_chunks == 3 and usage.video_tokens_after == usage.video_tokens_before
    # three captions, two per prompt: two prompts, then one
    assert first.num_rounds == 2 and usage.num_requests == 3 + 2 + 1 and first.summary
    assert first.evs == llm.evs_default.evs.key() and first.timings.total_s > 0
    (answer,) = first.answers
    assert answer.question == QUESTION and answer.text


def test_the_default_rate_prunes_long_chunks_and_a_named_rate_every_chunk(llm, clip_path):
    options = {"chunk_s": 8.0, "caption_tokens": 4, "summarize": False}
    default = llm.summarize(clip_path, **options)  # 8 tubelets, then 4
    per_tubelet = default.usage.video_tokens_before // 12
    assert default.usage.num_whole_chunks == 1  # a quarter of the 8 tubelets; the 4 whole
    assert default.usage.video_tokens_after == (2 + 4) * per_tubelet
    named = llm.summarize(clip_path, evs=EVSConfig(mode="rate", rate=0.75), **options)
    assert named.usage.num_whole_chunks == 0  # a quarter of the 8; the first of the 4
    assert named.usage.video_tokens_after == (2 + 1) * per_tubelet


def test_asking_again_decodes_nothing_and_hits_the_prefix_cache(llm, first, clip_path):
    work = llm.pipeline.work
    before = (work.frames_decoded, work.tower_passes)
    again = llm.summarize(clip_path, captions_per_round=2, **OPTIONS)
    assert again.timeline == first.timeline and again.summary == first.summary
    assert again.usage.num_cached_chunks == 3
    assert again.usage.cached_tokens > first.usage.cached_tokens
    answer = llm.when(clip_path, QUESTION, **OPTIONS)
    assert answer == first.answers[0]
    assert (work.frames_decoded, work.tower_passes) == before


def test_the_route_answers_as_the_api_does(server, first, clip_path):
    files = {"file": ("clip.mp4", clip_path.read_bytes(), "video/mp4")}
    form = {**{k: str(v) for k, v in OPTIONS.items()}, "question": QUESTION}
    response = httpx.post(f"{server.url}/v1/videos/summarize", files=files, data=form, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "video.summary" and body["model"] == "checkpoint"
    timeline = [(e["start_s"], e["end_s"], e["caption"]) for e in body["timeline"]]
    assert timeline == [tuple(entry) for entry in first.timeline]
    assert body["answers"][0]["text"] == first.answers[0].text
    assert body["chunk_s"] == 4.0 and body["usage"]["num_chunks"] == 3
    assert_healthy(server)


def test_the_route_streams_an_event_per_chunk(server, first, clip_path):
    media_dir = server.app.state.service.config.media_dir
    form = {"url": (media_dir / "clip.mp4").as_uri(), "stream": "true", "summarize": "false"}
    form |= {"chunk_s": "4", "caption_tokens": "16"}
    fields = {name: (None, value) for name, value in form.items()}  # multipart, no file
    with httpx.stream(
        "POST", f"{server.url}/v1/videos/summarize", files=fields, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [e["type"] for e in events] == ["plan", "chunk", "chunk", "chunk", "result"]
    assert events[0]["num_chunks"] == 3
    chunks = sorted(events[1:4], key=lambda e: e["index"])
    assert [e["caption"] for e in chunks] == [entry.text for entry in first.timeline]
    assert sorted(e["num_done"] for e in events[1:4]) == [1, 2, 3]
    assert events[-1]["summary"] == "" and events[-1]["num_rounds"] == 0


@pytest.mark.parametrize(
    ("form", "status", "code", "phrase"),
    [
        ({"prompt": "hi"}, 400, "unsupported_parameter", "unknown form field(s): prompt"),
        ({"max_frames": "8"}, 400, "unsupported_parameter", "samples every chunk at fps"),
        ({"chunk_s": "0"}, 400, "invalid_parameter", "chunk_s=0.0"),
        ({"chunk_s": "4", "overlap_s": "4"}, 400, "invalid_parameter", "overlap_s=4.0"),
        ({"chunk_s": "3000"}, 400, "invalid_chunking", "at most chunk_s="),
        ({"question": "what is red?"}, 400, "invalid_question", "ask when"),
        ({"evs": "{"}, 400, "invalid_evs", "evs must be JSON"),
    ],
)
def test_bad_requests_are_refused(server, clip_path, form, status, code, phrase):
    files = {"file": ("clip.mp4", clip_path.read_bytes(), "video/mp4")}
    response = httpx.post(f"{server.url}/v1/videos/summarize", files=files, data=form)
    assert_error(response, status, code, phrase)


def test_bad_media_is_refused_and_the_server_stays_healthy(server):
    url = f"{server.url}/v1/videos/summarize"
    response = httpx.post(url, files={"chunk_s": (None, "4")})
    assert_error(response, 400, "missing_file", "'file' field or name it with 'url'")
    tiny = {"url": (None, data_url(b"\x00" * 64))}
    assert httpx.post(url, files=tiny).status_code in (415, 422)
    garbage = {"file": ("clip.mp4", b"\x00" * 4096, "video/mp4")}
    assert httpx.post(url, files=garbage).status_code in (415, 422)
    assert_healthy(server)


def test_a_client_that_leaves_frees_everything(server, clip_path):
    files = {"file": ("clip.mp4", clip_path.read_bytes(), "video/mp4")}
    form = {"stream": "true", "chunk_s": "2", "caption_tokens": "64", "evs": "off"}
    with httpx.stream(
        "POST", f"{server.url}/v1/videos/summarize", files=files, data=form, timeout=60
    ) as response:
        for line in response.iter_lines():
            if '"type":"chunk"' in line:
                break  # leave after the first caption
    assert settled_pool_state(server) == (True, 0)
    assert_healthy(server)


def test_the_command_line_prints_the_summary_as_json(clip_path):
    printed = io.StringIO()
    argv = ["summarize", str(clip_path), "--chunk-s", "4", "--caption-tokens", "16"]
    with redirect_stdout(printed):
        assert main([*argv, "--summary-tokens", "16", "--ask", QUESTION, "--json"]) == 0
    report = json.loads(printed.getvalue())
    assert report["model"] == "stillcut-demo" and report["chunk_s"] == 4.0
    assert [(e["start_s"], e["end_s"]) for e in report["timeline"]] == SPANS
    assert report["answers"][0]["question"] == QUESTION
    for bad in (["--chunk-s", "-1"], ["--ask", "what moves?"], ["--caption-tokens", "0"]):
        assert main(["summarize", str(clip_path), *bad]) == 2
