"""Decode buckets and step buffers on CPU (what CUDA graphs replay), and the graphs on CUDA.

Padding a step of decodes to its bucket must not change a token; every step's inputs must be
views of the runner's persistent buffers (a graph replays on fixed addresses); without CUDA
the graph code paths must stay off and say why. The capture itself runs where CUDA is.
"""

from __future__ import annotations

import logging

import pytest
import torch

from stillcut.engine import memory_plan
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from stillcut.engine.cuda_graphs import (
    bucket_for,
    decode_buckets,
    graphs_unavailable,
    stage_pad_decodes,
)
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.engine.runner import ModelRunner

PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38, 39]]
# Three requests finishing at different steps: the decode batch goes 3 -> 2 -> 1. The tiny
# random model greedily repeats its last token; a repetition penalty and seeded sampling make
# every token depend on the logits.
# Their logprobs show what a token may hide: a pad row writing to a request's K/V.
PARAMS = [
    SamplingParams(max_tokens=9, ignore_eos=True, repetition_penalty=1.5, logprobs=1),
    SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, seed=3, logprobs=1),
    SamplingParams(max_tokens=3, ignore_eos=True, repetition_penalty=1.5, logprobs=1),
]


def _engine(path, device: str = "cpu", **options) -> LLMEngine:
    config = EngineConfig(
        device=device,
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512),
        cache=CacheConfig(num_blocks=64, held_share=0.0),
        **options,
    )
    return LLMEngine(path, config)


class _ForwardSpy:
    """Records the inputs of every model forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        self._forward = model.forward
        model.forward = self

    def __call__(self, input_ids, positions, kv_caches, metadata, **kwargs):
        self.calls.append((input_ids, positions, metadata))
        return self._forward(input_ids, positions, kv_caches, metadata, **kwargs)


def _tokens_and_logprobs(engine: LLMEngine, params=PARAMS) -> tuple[list, torch.Tensor]:
    outputs = engine.generate(PROMPTS, params)
    logprobs = [chosen for out in outputs for _, _, chosen in out.logprobs]
    return [out.token_ids for out in outputs], torch.tensor(logprobs)


@pytest.fixture(scope="module")
def unpadded(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    assert engine.runner.decode_buckets == () and engine.runner.graphs is None
    return _tokens_and_logprobs(engine)


def test_padding_decodes_to_a_bucket_gives_the_unpadded_tokens(
    tiny_checkpoint, unpadded, monkeypatch
):
    # Pretend graphs are possible, without capturing: decode steps are padded, run eagerly.
    monkeypatch.setattr(memory_plan, "graphs_unavailable", lambda *args: None)
    monkeypatch.setattr(ModelRunner, "capture_decode_graphs", lambda self: None)
    engine = _engine(tiny_checkpoint)
    assert engine.runner.decode_buckets == (1, 2, 4, 8)
    spy = _ForwardSpy(engine.model)
    tokens, logprobs = _tokens_and_logprobs(engine)
    assert tokens == unpadded[0]
    torch.testing.assert_close(logprobs, unpadded[1], rtol=0, atol=1e-5)
    decode_rows = [ids.shape[0] for ids, _, md in spy.calls if md.max_query_len == 1]
    assert 4 in decode_rows and 3 not in decode_rows  # three decodes ran as a bucket of four
    assert decode_rows[-1] == 1
    engine.scheduler.kv_cache.check_consistency()


def test_verify_steps_are_padded_to_buckets_of_rows(tiny_checkpoint, monkeypatch):
    # A request verifying K drafts is 1 + K one-token rows: a verify step takes a bucket (and,
    # on CUDA, its graph) like a decode step. The tiny model repeats tokens: n-grams propose.
    # (Seeded draws are keyed by position under speculation: compared with speculation unpadded.)
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=3, dynamic=False)
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 10, 8)]
    unpadded = _tokens_and_logprobs(_engine(tiny_checkpoint, speculative=speculative), greedy)
    monkeypatch.setattr(memory_plan, "graphs_unavailable", lambda *args: None)
    monkeypatch.setattr(ModelRunner, "capture_decode_graphs", lambda self: None)
    engine = _engine(tiny_checkpoint, speculative=speculative)
    assert engine.runner.decode_buckets == (1, 2, 4, 8, 16, 32)  # 8 seqs x (1 + 3) rows
    spy = _ForwardSpy(engine.model)
    tokens, logprobs = _tokens_and_logprobs(engine, greedy)
    assert tokens == unpadded[0]
    torch.testing.assert_close(logprobs, unpadded[1], rtol=0, atol=1e-5)
    assert engine.speculator.num_accepted_tokens > 0
    one_token_steps = [md for _, _, md in spy.calls if md.max_query_len == 1]
    verify_rows = [len(md.seq_lens_cpu) for md in one_token_steps if len(md.seq_lens_cpu) > 4]
    assert verify_rows and set(verify_rows) <= {8, 16}  # rows of three verifying requests
    assert all(len(md.seq_lens_cpu) in engine.runner.decode_buckets for md in one_token_steps)
    engine.scheduler.kv_cache.check_consistency()


def test_the_step_graphs_are_captured_on_writes_only_the_sink_block(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(memory_plan, "graphs_unavailable", lambda *args: None)
    monkeypatch.setattr(ModelRunner, "capture_decode_graphs", lambda self: None)
    engine = _engine(tiny_checkpoint)
    engine.generate(PROMPTS[:1], PARAMS[:1])  # real K/V in some blocks
    runner = engine.runner
    before = [cache.clone() for cache in runner.kv_caches]
    metadata = stage_pad_decodes(runner, 4)  # what `DecodeGraphs` captures the bucket on
    assert metadata.max_seq_len == runner.max_model_len  # the split-KV count fits every length
    assert metadata.block_tables[:, 0].tolist() == [runner.sink_block] * 4
    assert not metadata.block_tables[:, 1:].any()
    inputs = runner.buffers.device
    with torch.inference_mode():
        hidden = engine.model(
            inputs.input_ids[:4], inputs.positions[:, :4], runner.kv_caches, metadata
        )
        assert engine.model.compute_logits(hidden).isfinite().all()
    sink = runner.sink_block
    for cache, old in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(cache[:, :sink], old[:, :sink])
        assert not torch.equal(cache[:, sink], old[:, sink])


def test_step_inputs_are_views_of_the_persistent_buffers(tiny_checkpoint):
    engine = _engine(tiny_checkpoint)
    spy = _ForwardSpy(engine.model)
    engine.generate(PROMPTS, PARAMS)
    device = engine.runner.buffers.device
    assert len(spy.calls) > 4
    for input_ids, positions, md in spy.calls:  # prefill and decode steps alike
        pairs = [
            (input_ids, device.input_ids),
            (positions, device.positions),
            (md.slot_mapping, device.slot_mapping),
            (md.query_start_loc, device.query_start_loc),
            (md.seq_lens, device.seq_lens),
            (md.block_tables, device.block_tables),
        ]
        for step_tensor, buffer in pairs:
            assert step_tensor.data_ptr() == buffer.data_ptr()
            assert step_tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        # the block table is the full zero-padded width, rows past each request's blocks zero
        assert md.block_tables.shape[1] == device.block_tables.shape[1]
        for row, seq_len in zip(md.block_tables.tolist(), md.seq_lens.tolist(), strict=True):
            assert not any(row[-(-seq_len // engine.block_size) :])


def test_graph_paths_stay_off_without_cuda(tiny_checkpoint, caplog):
    assert "not on a CUDA device" in graphs_unavailable(torch.device("cpu"), False)
    assert "recurrent" in graphs_unavailable(torch.device("cuda"), True) or not (
        torch.cuda.is_available()
    )
    with caplog.at_level(logging.INFO, logger="stillcut.engine.llm_engine"):
        engine = _engine(tiny_checkpoint, enforce_eager=True)
    assert "decode steps run eagerly: enforce_eager is set" in caplog.text
    assert engine.runner.graphs is None and engine.runner.decode_buckets == ()
    assert decode_buckets(64, 2048) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(48, 2048) == (1, 2, 4, 8, 16, 32, 48)
    assert decode_buckets(64, 20) == (1, 2, 4, 8, 16, 20)
    assert [bucket_for(n, (1, 2, 4)) for n in (1, 3, 4, 5)] == [1, 4, 4, None]
    assert bucket_for(1, ()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_decode_graphs_replay_the_eager_tokens(tiny_checkpoint):
    eager = _engine(tiny_checkpoint, "cuda", enforce_eager=True)
    expected = [out.token_ids for out in eager.generate(PROMPTS, PARAMS)]
    engine = _engine(tiny_checkpoint, "cuda")
    assert sorted(engine.runner.graphs.logits) == [1, 2, 4, 8]
    assert [out.token_ids for out in engine.generate(PROMPTS, PARAMS)] == expected
