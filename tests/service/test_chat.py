"""OpenAI-compatible chat through the official `openai` client: answers equal the engine's own
greedy output for the same conversation and media, streamed or not, over several turns, with
every way of naming media the server allows."""

import io

import numpy as np
import openai
import pytest
from PIL import Image

from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.service.api import DEFAULT_EVS
from stillcut.vision.pipeline import ImageInput, VideoInput

from .conftest import data_url, pool_state

MAX_TOKENS = 6
TOP_LOGPROBS = 3
LOGPROB_ATOL = 1e-4  # the server may compute the prompt in other chunks (prefix-cache hits)


@pytest.fixture(scope="module")
def client(main_server):
    return openai.OpenAI(api_key="unused", base_url=f"{main_server.url}/v1", max_retries=0)


def _messages(url, question="What moves?", kind="video_url"):
    parts = [{"type": kind, kind: {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


def _reference(llm, messages, inputs, **sampling):
    """The engine's own output for the same conversation: the chat parts become the
    processor's media parts, the media are encoded the way the server does."""
    plain = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else [
                p if p["type"] == "text" else {"type": p["type"].removesuffix("_url")}
                for p in m["content"]
            ],
        }
        for m in messages
    ]
    items = llm.encode(inputs)
    prompt = llm.processor.build(plain, items)
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, **sampling)
    (output,) = llm.engine.generate([prompt], params)
    return output


def _assert_same_answer(choice_logprobs, text, expected):
    assert text == expected.text
    tops = [[t.logprob for t in entry.top_logprobs] for entry in choice_logprobs.content]
    expected_tops = [top for _, top, _ in expected.logprobs]
    assert len(tops) == len(expected_tops)
    gap = np.abs(np.array(tops) - np.array(expected_tops)).max()
    assert gap <= LOGPROB_ATOL


def _create(client, model, messages, **options):
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
        **options,
    )


def test_non_streaming_chat_with_a_video_data_url_equals_the_engine(
    client, main_server, reference_llm
):
    messages = _messages(data_url(main_server.clip))
    response = _create(client, main_server.llm.name, messages)
    expected = _reference(reference_llm, messages, [VideoInput(main_server.clip, evs=DEFAULT_EVS)])
    choice = response.choices[0]
    _assert_same_answer(choice.logprobs, choice.message.content, expected)
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == expected.metrics.num_prompt_tokens
    assert response.usage.completion_tokens == len(expected.token_ids)
    evs = response.model_extra["evs"]
    assert evs["tokens_after"] < evs["tokens_before"]  # the default EVS pruned the clip
    assert pool_state(main_server.server) == (True, 0)


def test_streaming_chat_sends_the_same_text_then_a_usage_chunk(client, main_server, reference_llm):
    messages = _messages(data_url(main_server.clip), "Stream it.")
    chunks = list(_create(client, main_server.llm.name, messages, stream=True))
    expected = _reference(reference_llm, messages, [VideoInput(main_server.clip, evs=DEFAULT_EVS)])
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [expected.finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == len(expected.token_ids)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == pytest.approx(
        [lp for _, _, lp in expected.logprobs], abs=LOGPROB_ATOL
    )


def test_multi_turn_follow_up_includes_the_earlier_answer(client, main_server, reference_llm):
    first = _messages(data_url(main_server.clip))
    answer = _create(client, main_server.llm.name, first).choices[0].message.content
    follow_up = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And what stays still?"},
    ]
    response = _create(client, main_server.llm.name, follow_up)
    inputs = [VideoInput(main_server.clip, evs=DEFAULT_EVS)]
    expected = _reference(reference_llm, follow_up, inputs)
    _assert_same_answer(response.choices[0].logprobs, response.choices[0].message.content, expected)
    # the first turn's prompt, video included, came from the prefix cache
    assert response.usage.prompt_tokens_details.cached_tokens >= 16


def test_file_and_http_urls_and_images_and_evs_options(client, main_server, reference_llm):
    evs = {"mode": "threshold", "threshold": 0.05}
    clip = main_server.clip
    for url in (f"file://{main_server.media_dir / 'clip.mp4'}", f"{main_server.http_url}/clip.mp4"):
        messages = _messages(url)
        response = _create(client, main_server.llm.name, messages, extra_body={"evs": evs})
        expected = _reference(reference_llm, messages, [VideoInput(clip, evs=EVSConfig(**evs))])
        choice = response.choices[0]
        _assert_same_answer(choice.logprobs, choice.message.content, expected)
        assert response.model_extra["evs"]["setting"].startswith("evs:threshold")
    png = io.BytesIO()
    Image.fromarray(np.full((56, 84, 3), 120, np.uint8)).save(png, format="PNG")
    messages = _messages(data_url(png.getvalue(), "image/png"), "Colour?", kind="image_url")
    response = _create(client, main_server.llm.name, messages)
    expected = _reference(reference_llm, messages, [ImageInput(png.getvalue())])
    _assert_same_answer(response.choices[0].logprobs, response.choices[0].message.content, expected)


def test_evs_before_the_tower_is_a_request_field(client, main_server, reference_llm):
    evs = {"mode": "rate", "rate": 0.75, "stage": "pixels"}
    messages = _messages(f"file://{main_server.media_dir / 'clip.mp4'}")
    response = _create(client, main_server.llm.name, messages, extra_body={"evs": evs})
    expected = _reference(
        reference_llm, messages, [VideoInput(main_server.clip, evs=EVSConfig(**evs))]
    )
    choice = response.choices[0]
    _assert_same_answer(choice.logprobs, choice.message.content, expected)
    assert response.model_extra["evs"]["setting"] == "evs:rate:q=0.75:stage=pixels"
    with pytest.raises(openai.BadRequestError, match="stage='tower' is not one of"):
        _create(
            client, main_server.llm.name, messages, extra_body={"evs": {**evs, "stage": "tower"}}
        )


def test_sampling_fields_are_honoured(client, main_server):
    messages = [{"role": "user", "content": "Count."}]
    model = main_server.llm.name

    def sample(seed):
        return client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=1.5, top_p=0.9, seed=seed
        )

    assert sample(7).choices[0].message.content == sample(7).choices[0].message.content
    assert len({sample(seed).choices[0].message.content for seed in range(4)}) > 1
    short = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"
    assert short.choices[0].model_extra["stop_reason"] is None
    greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    stop = greedy.choices[0].message.content[:1]
    stopped = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, stop=[stop]
    )
    assert (
        stopped.choices[0].finish_reason == "stop"
        and stop not in stopped.choices[0].message.content
    )
    assert stopped.choices[0].model_extra["stop_reason"] == stop  # vLLM's field
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, stop=[stop], stream=True
    )
    last = [c.choices[0] for c in streamed if c.choices and c.choices[0].finish_reason]
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in last] == [("stop", stop)]


def test_models_and_unknown_model(client, main_server):
    assert [m.id for m in client.models.list().data] == [main_server.llm.name]
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert raised.value.body["code"] == "model_not_found"
