"""Qwen3-VL's pixel budget on every route: the Python API, the describe form, chat completions
(the `openai` client, the cap as a JSON boolean), the token plan and the CLI honour the same
budget (qwen-vl-utils' per-frame bounds, mapped onto the processor's whole-clip `size` and
per-frame cap) and echo what was in force; a value out of range, or both spellings of one
bound, is a 400 naming it."""

import json

import httpx
import openai
import pytest

from stillcut.engine.factory import cached_checkpoint
from stillcut.service import cli
from stillcut.service.config import ServerConfig

from .conftest import assert_error, data_url, make_llm, running_server

TOKEN = 32 * 32
MAX_TOKENS = 2
# 4 frames of the 112x84 clip, each at most 6 merged tokens: 128x96 shrinks to 64x64
BUDGET = {"min_pixels": TOKEN, "max_pixels": 6 * TOKEN, "cap_pixels_per_frame": 1}
OPTIONS = {"num_frames": 4, **BUDGET}


@pytest.fixture(scope="module")
def checkpoint():
    return cached_checkpoint("tiny", seed=1, family="qwen3_vl")


@pytest.fixture(scope="module")
def server(checkpoint):
    with running_server(checkpoint, ServerConfig()) as server:
        yield server


@pytest.fixture(scope="module")
def python_video(checkpoint, tiny_clip):
    """The Python API's echo: what every route must equal."""
    result = make_llm(checkpoint).describe(
        tiny_clip, evs=None, max_tokens=MAX_TOKENS, num_frames=4, pixels=BUDGET
    )
    (video,) = result.to_dict()["evs"]["videos"]
    return video


def test_python_api_honours_and_echoes_the_budget(python_video):
    in_force = python_video["pixel_budget"]
    assert {name: in_force[name] for name in BUDGET} == BUDGET
    assert (in_force["shortest_edge"], in_force["longest_edge"]) == (TOKEN, 2048 * TOKEN)
    assert python_video["resized"] == [64, 64]  # 4 x 64 x 64 fits 4 frames of 6 tokens
    assert python_video["token_grid"] == [2, 2, 2]


def test_every_route_echoes_the_same(server, tiny_clip, python_video):
    files = {"file": ("clip.mp4", tiny_clip, "video/mp4")}
    fields = {**OPTIONS, "max_tokens": MAX_TOKENS, "evs": "off"}
    described = httpx.post(f"{server.url}/v1/videos/describe", files=files, data=fields)
    assert described.status_code == 200, described.text
    assert described.json()["evs"]["videos"] == [python_video]

    client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
    parts = [{"type": "video_url", "video_url": {"url": data_url(tiny_clip)}}]
    completion = client.chat.completions.create(
        model=server.app.state.service.llm.name,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}],
        max_tokens=MAX_TOKENS,
        extra_body={**OPTIONS, "cap_pixels_per_frame": True, "evs": "off"},
    )
    assert completion.model_extra["evs"]["videos"] == [python_video]

    query = {**OPTIONS, "evs": "off"}
    plan = httpx.post(f"{server.url}/v1/videos/plan", params=query, content=tiny_clip).json()
    assert plan["pixel_budget"] == python_video["pixel_budget"]
    assert plan["token_grid"] == python_video["token_grid"]
    assert plan["tokens_after_evs"] == python_video["tokens_after"]


def test_cli_takes_the_budget_by_name(checkpoint, tiny_clip, tmp_path, capsys, python_video):
    path = tmp_path / "clip.mp4"
    path.write_bytes(tiny_clip)
    flags = ["--num-frames", "4", "--min-pixels", str(TOKEN), "--max-pixels", str(6 * TOKEN)]
    flags += ["--pixel-budget", "cap_pixels_per_frame=1"]
    argv = ["describe", str(path), "--model", str(checkpoint), "--json", *flags]
    assert cli.main([*argv, "--max-tokens", str(MAX_TOKENS), "--no-evs"]) == 0
    (video,) = json.loads(capsys.readouterr().out)["evs"]["videos"]
    assert video["pixel_budget"] == python_video["pixel_budget"]
    assert video["resized"] == python_video["resized"]


@pytest.mark.parametrize(
    ("query", "phrase"),
    [
        ({"total_pixels": "10"}, "total_pixels must be an integer in [1024, "),
        ({"cap_pixels_per_frame": "2"}, "cap_pixels_per_frame must be an integer in [0, 1]"),
        ({"min_pixels": "2048", "shortest_edge": "4096"}, "set the same bound"),
    ],
)
def test_bad_budgets_are_400s(server, tiny_clip, query, phrase):
    response = httpx.post(f"{server.url}/v1/videos/plan", params=query, content=tiny_clip)
    assert_error(response, 400, "invalid_parameter", phrase)
