"""Nemotron 3 Nano Omni behind the server: the official `openai` client with a `video_url`
gets transformers' answer, `chat_template_kwargs` reach the chat template, and with
`--reasoning-parser think` the thinking part comes back as `reasoning_content` (streamed as
`delta.reasoning_content`); a second question about the clip restores a recurrent-state
snapshot, counted in `/metrics`; `stillcut describe` answers on the checkpoint; a live session
and EVS before the tower are refused with a clear message (the family's entry says why)."""

import json
import re
import shutil

import httpx
import openai
import pytest

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.service import cli, server
from stillcut.service.api import VideoLLM
from stillcut.service.config import ServerConfig
from stillcut.service.server import BackgroundServer
from stillcut.vision.decode import DecodeConfig

from ..engine.models.nemotron_omni.nemotron_reference import NemotronReference

MAX_TOKENS = 12
DECODE = DecodeConfig(fps=2.0, max_frames=6)
EVS = {"mode": "rate", "rate": 0.5}  # the checkpoint's own rate, which transformers applies
QUESTION = "What happens in this video?"


@pytest.fixture(scope="module")
def checkpoint():
    return cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")


@pytest.fixture(scope="module")
def served(checkpoint, samples_dir, tmp_path_factory):
    media_dir = tmp_path_factory.mktemp("nemotron-media")
    shutil.copy(samples_dir / "moving_object.mp4", media_dir / "clip.mp4")
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024),
        cache=CacheConfig(num_blocks=128, block_size=16),
    )
    llm = VideoLLM(checkpoint, engine_config=engine_config, decode_config=DECODE)
    config = ServerConfig(media_dir=media_dir, reasoning_parser="think")
    background = BackgroundServer(llm, config)
    client = openai.OpenAI(api_key="unused", base_url=f"{background.url}/v1", max_retries=0)
    try:
        yield background, client, media_dir / "clip.mp4", NemotronReference(checkpoint)
    finally:
        background.stop()


def _messages(url: str | None) -> list[dict]:
    parts = [{"type": "text", "text": QUESTION}]
    if url is not None:
        parts.insert(0, {"type": "video_url", "video_url": {"url": url}})
    return [{"role": "user", "content": parts}]


def _reference_text(served, *, thinking: bool) -> str:
    """transformers' greedy answer to the clip and question, as text."""
    background, _, clip, reference = served
    media = reference.video(clip, DECODE)
    parts = [{"type": "video"}, {"type": "text", "text": QUESTION}]
    prompt = reference.prompt_ids(
        [{"role": "user", "content": parts}], media, enable_thinking=thinking
    )
    tokens = reference.greedy(prompt, media, EVS["rate"], MAX_TOKENS)
    processor = background.app.state.service.llm.processor
    eos = set(processor.special.eos_token_ids)
    ended = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return processor.tokenizer.decode(tokens[:ended], skip_special_tokens=True)


def test_a_video_url_answer_equals_transformers_with_thinking_off(served):
    _, client, clip, _ = served
    answer = client.chat.completions.create(
        model=None,
        messages=_messages(f"file://{clip}"),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"evs": EVS, "chat_template_kwargs": {"enable_thinking": False}},
    )
    message = answer.choices[0].message
    # the template closed the thinking block itself: everything is the answer
    assert message.content == _reference_text(served, thinking=False)
    assert message.model_extra["reasoning_content"] == ""


def test_thinking_streams_as_reasoning_content(served):
    _, client, clip, _ = served
    expected = _reference_text(served, thinking=True)
    stream = client.chat.completions.create(
        model=None,
        messages=_messages(f"file://{clip}"),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"evs": EVS},
    )
    reasoning, content = [], []
    for chunk in stream:
        for choice in chunk.choices:
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    # the prompt opened `<think>`: the answer so far (no `</think>` yet) is all reasoning
    assert "</think>" not in expected
    assert "".join(reasoning) == expected and "".join(content) == ""


def test_bad_chat_template_kwargs_are_a_400(served):
    _, client, _, _ = served
    with pytest.raises(openai.BadRequestError, match="set by the server"):
        client.chat.completions.create(
            model=None,
            messages=_messages(None),
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
        )
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs must be an object"):
        client.chat.completions.create(
            model=None, messages=_messages(None), extra_body={"chat_template_kwargs": "x"}
        )


def test_evs_before_the_tower_is_a_400_naming_why(served):
    background, client, clip, _ = served
    passes = background.app.state.service.llm.pipeline.work.tower_passes
    with pytest.raises(openai.BadRequestError, match="stage 'pixels'.*RADIO"):
        client.chat.completions.create(
            model=None,
            messages=_messages(f"file://{clip}"),
            max_tokens=2,
            extra_body={"evs": {**EVS, "stage": "pixels"}},
        )
    assert background.app.state.service.llm.pipeline.work.tower_passes == passes


def _snapshot_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    found = re.findall(r"^stillcut_state_snapshots_(\w+)_total (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in found}


def test_a_second_question_restores_a_snapshot_counted_in_metrics(served):
    background, client, clip, _ = served
    before = _snapshot_counters(background.url)
    assert set(before) == {"saved", "restored", "evicted"}
    for question in ("What moves?", "What colour is it?"):
        messages = _messages(f"file://{clip}")
        messages[0]["content"][1]["text"] = question
        reply = client.chat.completions.create(model=None, messages=messages, max_tokens=2)
        assert reply.choices[0].message.content is not None
    after = _snapshot_counters(background.url)
    assert after["saved"] > before["saved"]
    assert after["restored"] >= before["restored"] + 1


def test_a_live_session_is_refused_by_the_family_entry(served):
    from websockets.sync.client import connect

    background, _, _, _ = served
    url = background.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url) as socket:
        socket.send('{"type": "start"}')
        reply = socket.recv(timeout=30)
    assert "live sessions are not supported for 'nemotron_h_omni'" in reply


def test_describe_cli_answers_on_the_checkpoint(checkpoint, samples_dir, capsys):
    clip = samples_dir / "moving_object.mp4"
    argv = ["describe", str(clip), "--model", str(checkpoint), "--max-tokens", "3", "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["usage"]["completion_tokens"] == 3
    assert report["evs"]["tokens_after"] < report["evs"]["tokens_before"]


def test_serve_takes_the_reasoning_parser_flag(checkpoint, monkeypatch):
    served_with = {}
    monkeypatch.setattr(server, "serve", lambda llm, config, **_: served_with.update(config=config))
    argv = ["serve", "--model", str(checkpoint), "--reasoning-parser", "think"]
    assert cli.main(argv) == 0
    assert served_with["config"].reasoning_parser == "think"
