"""Per-request video options are honoured and echoed by every route: the Python API, the
describe form, chat completions (through the `openai` client), the CLI, and the token plan
(`POST /v1/videos/plan`, `stillcut inspect --plan`) says beforehand what they then do."""

import json
from fractions import Fraction

import httpx
import openai
import pytest
import torch

from stillcut.service import cli
from stillcut.service.api import VideoLLM
from stillcut.vision.synthetic import moving_texture, write_video

from .conftest import ENGINE_CONFIG, assert_error, data_url

MAX_TOKENS = 3
# 4 frames evenly over [0.5, 2.75) s of the 4 fps clip: times 0.5, 1.0625, 1.625, 2.1875 take
# the frames shown at 0.5, 1.0, 1.5 and 2.0 s; frames of at most 12 merged tokens, fast resize.
OPTIONS = {"num_frames": 4, "start": 0.5, "end": 2.75, "max_pixels": 12 * 28 * 28, "resize": "fast"}
EXPECTED_TIMES = [0.5, 1.0, 1.5, 2.0]
EVS = {"mode": "rate", "rate": 0.5}


@pytest.fixture(scope="module")
def python_video(reference_llm, tiny_clip):
    """The Python API's answer: the reference the routes must equal."""
    from stillcut.kernels.evs import EVSConfig

    options = {k: v for k, v in OPTIONS.items() if k != "max_pixels"}
    result = reference_llm.describe(
        tiny_clip,
        evs=EVSConfig(**EVS),
        max_tokens=MAX_TOKENS,
        pixels={"max_pixels": OPTIONS["max_pixels"]},
        **options,
    )
    (video,) = result.to_dict()["evs"]["videos"]
    return video


def test_python_api_honours_and_echoes_the_options(python_video, reference_llm, tiny_clip):
    from stillcut.kernels.evs import EVSConfig

    video = python_video
    options = {k: v for k, v in OPTIONS.items() if k != "max_pixels"}
    pixels = {"max_pixels": OPTIONS["max_pixels"]}
    plan = reference_llm.plan(tiny_clip, evs=EVSConfig(**EVS), pixels=pixels, **options)
    assert list(plan.frame_times) == EXPECTED_TIMES
    assert plan.tokens_after_evs == video["tokens_after"] and plan.fits
    assert video["timestamps"] == EXPECTED_TIMES and video["num_frames"] == 4
    assert (video["start"], video["end"]) == (0.5, 2.75)
    assert video["pixel_budget"]["max_pixels"] == OPTIONS["max_pixels"]
    assert video["resize"] == "fast"
    width, height = video["resized"]
    assert width * height <= OPTIONS["max_pixels"]
    assert len(video["kept_per_tubelet"]) == 2 == video["token_grid"][0]
    assert sum(video["kept_per_tubelet"]) == video["tokens_after"] < video["tokens_before"]


def test_describe_form_echoes_the_same(main_server, python_video):
    fields = {**OPTIONS, "max_tokens": MAX_TOKENS, "evs": json.dumps(EVS)}
    files = {"file": ("clip.mp4", main_server.clip, "video/mp4")}
    response = httpx.post(f"{main_server.url}/v1/videos/describe", files=files, data=fields)
    assert response.status_code == 200, response.text
    assert response.json()["evs"]["videos"] == [python_video]


@pytest.fixture(scope="module")
def resized_clip(tmp_path_factory) -> bytes:
    """A clip the model resizes at decode (320x180 to 308x168: smaller, in 28-pixel patches)."""
    path = tmp_path_factory.mktemp("resized") / "clip.mp4"
    write_video(path, moving_texture(4, 320, 180, seed=8), time_base=Fraction(1, 2))
    return path.read_bytes()


def test_describe_form_takes_the_resize_mode(main_server, reference_llm, resized_clip):
    """`resize` reaches decoding (fast and exact embed differently) and is echoed; the
    form's answer equals the Python API's with the same mode."""
    files = {"file": ("clip.mp4", resized_clip, "video/mp4")}
    for mode in ("fast", "exact"):
        fields = {"resize": mode, "evs": "off", "max_tokens": 1}
        response = httpx.post(f"{main_server.url}/v1/videos/describe", files=files, data=fields)
        assert response.status_code == 200, response.text
        (video,) = response.json()["evs"]["videos"]
        python = reference_llm.describe(resized_clip, evs=None, max_tokens=1, resize=mode)
        assert video == python.to_dict()["evs"]["videos"][0] and video["resize"] == mode
    fast, exact = (
        reference_llm.pipeline.video(resized_clip, resize=mode).embeds for mode in ("fast", "exact")
    )
    assert fast.shape == exact.shape and not torch.equal(fast, exact)
    refused = httpx.post(
        f"{main_server.url}/v1/videos/describe", files=files, data={"resize": "quick"}
    )
    assert_error(refused, 400, "invalid_parameter", "resize='quick' must be 'exact' or 'fast'")


def test_chat_echoes_the_same(main_server, python_video):
    client = openai.OpenAI(api_key="unused", base_url=f"{main_server.url}/v1", max_retries=0)
    parts = [{"type": "video_url", "video_url": {"url": data_url(main_server.clip)}}]
    completion = client.chat.completions.create(
        model=main_server.llm.name,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}],
        max_tokens=MAX_TOKENS,
        extra_body={**OPTIONS, "evs": EVS},
    )
    assert completion.model_extra["evs"]["videos"] == [python_video]


def test_plan_route_says_beforehand_what_describe_does(main_server, python_video):
    query = {**OPTIONS, "evs": json.dumps(EVS)}
    response = httpx.post(
        f"{main_server.url}/v1/videos/plan",
        params=query,
        content=main_server.clip,
        headers={"content-type": "video/mp4"},
    )
    assert response.status_code == 200, response.text
    plan = response.json()
    assert plan["object"] == "video.plan" and plan["num_frames"] == 4
    assert plan["frame_times"] == EXPECTED_TIMES
    assert plan["tokens_before_evs"] == python_video["tokens_before"]
    assert plan["evs_exact"] and plan["tokens_after_evs"] == python_video["tokens_after"]
    assert plan["fits"] and plan["kv_bytes"] > 0
    url = f"{main_server.http_url}/clip.mp4"
    by_url = httpx.post(f"{main_server.url}/v1/videos/plan", params={**query, "url": url})
    assert by_url.status_code == 200, by_url.text
    assert by_url.json()["frame_times"] == EXPECTED_TIMES


def test_plan_over_the_limits_says_how_many_frames_fit(
    main_server, reference_llm, tiny_checkpoint, tmp_path, capsys
):
    """`max_video_tokens` is honoured on every route: each refuses, before decoding, with the
    number of frames the plan says would fit."""
    query = {"fps": 4, "max_video_tokens": 40, "evs": "off"}
    response = httpx.post(
        f"{main_server.url}/v1/videos/plan", params=query, content=main_server.clip
    )
    plan = response.json()
    assert not plan["fits"] and 0 < plan["fitting_num_frames"] < plan["num_frames"]
    hint = f"at most {plan['fitting_num_frames']} frames"
    files = {"file": ("clip.mp4", main_server.clip, "video/mp4")}
    refused = httpx.post(
        f"{main_server.url}/v1/videos/describe", files=files, data={**query, "max_tokens": 2}
    )
    assert_error(refused, 400, "too_many_visual_tokens", hint)
    parts = [{"type": "video_url", "video_url": {"url": data_url(main_server.clip)}}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, **query}
    refused = httpx.post(f"{main_server.url}/v1/chat/completions", json=body)
    assert_error(refused, 400, "too_many_visual_tokens", hint)
    with pytest.raises(ValueError, match=hint):
        reference_llm.describe(main_server.clip, evs=None, max_tokens=2, fps=4, max_video_tokens=40)
    path = tmp_path / "clip.mp4"
    path.write_bytes(main_server.clip)
    argv = ["describe", str(path), "--model", str(tiny_checkpoint), "--fps", "4", "--no-evs"]
    assert cli.main([*argv, "--max-video-tokens", "40", "--max-tokens", "2"]) == 2
    assert hint in capsys.readouterr().err


# 12 samples at 4 fps over the 3 s clip, capped at 5: spread evenly at 0, 0.6, 1.2, 1.8 and
# 2.4 s, they take the frames shown at these times
RATE = {"fps": 4, "max_frames": 5}
RATE_TIMES = [0.0, 0.5, 1.0, 1.75, 2.25]


def test_fps_and_max_frames_are_honoured_on_every_route(
    main_server, reference_llm, tiny_checkpoint, tmp_path, capsys
):
    python = reference_llm.describe(main_server.clip, evs=None, max_tokens=1, **RATE)
    (video,) = python.to_dict()["evs"]["videos"]
    assert video["timestamps"] == RATE_TIMES and video["sample_fps"] == pytest.approx(5 / 3)
    files = {"file": ("clip.mp4", main_server.clip, "video/mp4")}
    fields = {**RATE, "evs": "off", "max_tokens": 1}
    described = httpx.post(f"{main_server.url}/v1/videos/describe", files=files, data=fields)
    assert described.json()["evs"]["videos"] == [video]
    client = openai.OpenAI(api_key="unused", base_url=f"{main_server.url}/v1", max_retries=0)
    parts = [{"type": "video_url", "video_url": {"url": data_url(main_server.clip)}}]
    completion = client.chat.completions.create(
        model=main_server.llm.name,
        messages=[{"role": "user", "content": parts}],
        max_tokens=1,
        extra_body={**RATE, "evs": "off"},
    )
    assert completion.model_extra["evs"]["videos"] == [video]
    planned = httpx.post(f"{main_server.url}/v1/videos/plan", params=RATE, content=main_server.clip)
    assert planned.json()["frame_times"] == RATE_TIMES
    path = tmp_path / "clip.mp4"
    path.write_bytes(main_server.clip)
    argv = ["describe", str(path), "--model", str(tiny_checkpoint), "--json", "--no-evs"]
    assert cli.main([*argv, "--fps", "4", "--max-frames", "5", "--max-tokens", "1"]) == 0
    (video,) = json.loads(capsys.readouterr().out)["evs"]["videos"]
    assert video["timestamps"] == RATE_TIMES


@pytest.mark.parametrize(
    ("query", "phrase"),
    [
        ({"num_frames": "0"}, "num_frames must be >= 1"),
        ({"fps": "fast"}, "fps='fast' must be float"),
        ({"max_pixels": "5"}, "max_pixels must be an integer in [784, "),
        ({"start": "2", "end": "1"}, "end must be after start"),
        ({"frames": "3"}, "unknown query field(s): frames"),
        ({"resize": "FAST"}, "resize='FAST' must be 'exact' or 'fast'"),
    ],
)
def test_bad_options_are_400s(main_server, query, phrase):
    response = httpx.post(
        f"{main_server.url}/v1/videos/plan", params=query, content=main_server.clip
    )
    assert response.status_code == 400 and phrase in response.json()["error"]["message"]


def test_cli_describe_and_inspect_honour_the_options(tiny_checkpoint, tiny_clip, tmp_path, capsys):
    path = tmp_path / "clip.mp4"
    path.write_bytes(tiny_clip)
    flags = ["--num-frames", "4", "--start", "0.5", "--end", "2.75", "--max-pixels", "9408"]
    argv = ["describe", str(path), "--model", str(tiny_checkpoint), "--json", *flags]
    assert cli.main([*argv, "--max-tokens", "2", "--evs-rate", "0.5"]) == 0
    (video,) = json.loads(capsys.readouterr().out)["evs"]["videos"]
    assert video["timestamps"] == EXPECTED_TIMES and video["pixel_budget"]["max_pixels"] == 9408
    inspect = ["inspect", str(path), "--model", str(tiny_checkpoint), "--json", *flags]
    assert cli.main([*inspect, "--evs-rate", "0.5", "--plan"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["frame_times"] == EXPECTED_TIMES
    assert plan["tokens_after_evs"] == video["tokens_after"]


def test_a_twenty_minute_file_is_described_or_refused_with_the_plan_that_fits(
    tiny_checkpoint, tmp_path
):
    """No duration cap refuses it (at the default decode settings): sampled at the defaults it
    is described, 64 frames spread over it; asked at 2 fps it is refused, before decoding, with
    the frames that would fit."""
    path = tmp_path / "long.mp4"  # 121 frames, one every 10 s
    write_video(path, moving_texture(121, 112, 84, seed=13), time_base=Fraction(10))
    llm = VideoLLM(tiny_checkpoint, engine_config=ENGINE_CONFIG)
    (video,) = llm.describe(path, max_tokens=1).to_dict()["evs"]["videos"]
    assert video["num_frames"] == 64 and video["end"] >= 1200
    assert video["timestamps"][-1] > 1150 and video["tokens_after"] < video["tokens_before"]
    plan = llm.plan(path, evs=None, fps=2, max_frames=2400)
    assert not plan.fits and plan.fitting_num_frames
    with pytest.raises(ValueError, match=f"at most {plan.fitting_num_frames} frames") as refused:
        llm.describe(path, evs=None, max_tokens=1, fps=2, max_frames=2400)
    assert "max_duration_s" not in str(refused.value)
