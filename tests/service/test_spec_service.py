"""Speculative decoding through the service: chat usage reports OpenAI's prediction token
counts and `/metrics` the draft counters and the accepted-per-step histogram; the answer is
the one decoding without speculation gives. With a draft model, `VideoLLM` has its pipeline
encode media with the draft's tower too, so describing a video and narrating frames get
drafts (a copy of the target has them all accepted)."""

import httpx
import numpy as np
import openai

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.request import SamplingParams
from stillcut.service.api import VideoLLM
from stillcut.service.config import ServerConfig
from stillcut.service.server import BackgroundServer

QUESTION = "one two three four, one two three four, one two three four, one two"


def test_chat_usage_and_metrics_report_speculation():
    checkpoint = cached_checkpoint("tiny", seed=0, text={"initializer_range": 0.2})
    speculative = SpeculativeConfig(num_speculative_tokens=3, dynamic=False)
    llm = VideoLLM(checkpoint, engine_config=_config(speculative))
    reference = VideoLLM(checkpoint, engine_config=_config(None)).engine
    server = BackgroundServer(llm, ServerConfig())
    try:
        client = openai.OpenAI(api_key="unused", base_url=f"{server.url}/v1", max_retries=0)
        reply = client.chat.completions.create(
            model=llm.name,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=40,
            temperature=0,
        )
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
        prompt = reference.processor.build([{"role": "user", "content": QUESTION}])
        (expected,) = reference.generate([prompt], SamplingParams(max_tokens=40))
        assert reply.choices[0].message.content == expected.text
        metrics = httpx.get(f"{server.url}/metrics").text
        drafted = _value(metrics, "stillcut_spec_draft_tokens_total")
        accepted = _value(metrics, "stillcut_spec_accepted_tokens_total")
        assert (drafted, accepted) == (
            details.accepted_prediction_tokens + details.rejected_prediction_tokens,
            details.accepted_prediction_tokens,
        )
        assert _value(metrics, "stillcut_spec_accepted_tokens_per_step_sum") == accepted
    finally:
        server.stop()


def test_a_draft_model_drafts_for_a_described_and_a_narrated_video():
    checkpoint = cached_checkpoint("tiny", seed=0, text={"initializer_range": 0.2})
    speculative = SpeculativeConfig(
        method="draft", draft_model=str(checkpoint), num_speculative_tokens=3, dynamic=False
    )
    llm = VideoLLM(checkpoint, engine_config=_config(speculative))
    reference = VideoLLM(checkpoint, engine_config=_config(None))
    assert llm.pipeline.draft is not None and reference.pipeline.draft is None
    frames = np.random.default_rng(0).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)
    described = llm.describe(frames, max_tokens=16)
    assert described.token_ids == reference.describe(frames, max_tokens=16).token_ids
    speculator = llm.engine.speculator
    assert speculator.num_draft_tokens == speculator.num_accepted_tokens > 0
    num_described = speculator.num_draft_tokens
    stamped = [(k / 2.0, frame) for k, frame in enumerate(frames)]
    ours = [s.text for s in llm.narrate(iter(stamped), max_tokens_per_segment=8)]
    assert ours == [s.text for s in reference.narrate(iter(stamped), max_tokens_per_segment=8)]
    assert speculator.num_draft_tokens == speculator.num_accepted_tokens > num_described


def _config(speculative: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(max_model_len=1024),
        cache=CacheConfig(num_blocks=128),
        speculative=speculative,
    )


def _value(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])
