"""Full CUDA graphs for decode steps: one per batch bucket, captured once at start.

A decode step's shapes depend only on how many requests decode: not on EVS (pruning changes the
prompt, never a decode) and not on context lengths (the Triton attention kernel finds each
request's keys, and each split's share of them, on the device). So the runner pads a step of
decodes to the next bucket (1, 2, 4, ... up to `max_num_seqs`) and replays that bucket's graph,
whose inputs are the runner's persistent device buffers and whose output is the bucket's
logits; steps with prefill run eagerly. A verify step of speculative decoding is such a step
too: a request verifying K drafts is 1 + K one-token rows (causal by their sequence lengths),
so one graph per bucket of rows serves every K, and the buckets reach max_num_seqs x (1 + K). A
graph is captured with the longest context the engine allows as its `max_seq_len`, so its
split-KV count serves every later length. Inside a graph attention must be the Triton kernel
(the torch backend reads host lists), and models with recurrent layers are not captured (their
state rows are host lists too).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from stillcut.kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from stillcut.engine.runner import ModelRunner

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int, max_num_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, ... below the largest decode batch a step can hold, then that batch."""
    limit = min(max_num_seqs, max_num_tokens)
    return (*(1 << k for k in range(limit.bit_length()) if 1 << k < limit), limit)


def bucket_for(num_decodes: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_decodes` rows; None when none does (or no buckets)."""
    return next((bucket for bucket in buckets if bucket >= num_decodes), None)


def graphs_unavailable(device: torch.device, has_recurrent_state: bool) -> str | None:
    """Why decode graphs cannot be captured for a model on `device`; None when they can."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "the model is not on a CUDA device"
    if has_recurrent_state:
        return "the model has recurrent layers (their state rows are host lists)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (the torch attention backend reads host lists)"
    return None


class DecodeGraphs:
    """The captured graph and its output logits `[bucket, vocab]` per decode bucket."""

    def __init__(
        self,
        graphs: dict[int, torch.cuda.CUDAGraph],
        logits: dict[int, torch.Tensor],
        capture_s: float,
        memory_bytes: int,
    ) -> None:
        self.graphs = graphs
        self.logits = logits
        self.capture_s = capture_s
        self.memory_bytes = memory_bytes

    @classmethod
    def capture(cls, runner: ModelRunner) -> DecodeGraphs:
        """Capture every bucket of `runner.decode_buckets`, largest first so the smaller ones
        reuse its memory pool; logs the time taken and the device memory the graphs hold."""
        reason = graphs_unavailable(runner.device, bool(runner.recurrent_states))
        assert reason is None, reason
        torch.cuda.synchronize(runner.device)
        free_before = torch.cuda.mem_get_info(runner.device)[0]
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        graphs, logits = {}, {}
        with torch.inference_mode():
            for bucket in sorted(runner.decode_buckets, reverse=True):
                graphs[bucket], logits[bucket] = _capture_bucket(runner, bucket, pool)
        torch.cuda.synchronize(runner.device)
        capture_s = time.perf_counter() - started
        memory_bytes = max(0, free_before - torch.cuda.mem_get_info(runner.device)[0])
        log.info(
            "decode CUDA graphs: %d buckets %s captured in %.2f s, holding %.1f MiB",
            len(graphs),
            sorted(graphs),
            capture_s,
            memory_bytes / 2**20,
        )
        return cls(graphs, logits, capture_s, memory_bytes)

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the bucket's graph on the staged step; its logits `[bucket, vocab]`."""
        self.graphs[bucket].replay()
        return self.logits[bucket]


def stage_pad_decodes(runner: ModelRunner, bucket: int) -> AttentionMetadata:
    """Stage a decode step of `bucket` pad rows only (what a bucket's graph is captured on)."""
    buffers = runner.buffers
    buffers.staging()
    query_start, seq_lens = [0], []
    buffers.stage_pads(query_start, seq_lens, bucket, runner.sink_block)
    buffers.stage_requests(query_start, seq_lens, runner.block_array, [], 0, None)
    return buffers.metadata(query_start, seq_lens, runner.max_model_len)


def _capture_bucket(
    runner: ModelRunner, bucket: int, pool
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm up (Triton compiles, the allocator settles) on a side stream, then capture, on a
    step of pad rows only whose `max_seq_len` is the longest context allowed (so the split-KV
    count it fixes serves every replay)."""
    metadata = stage_pad_decodes(runner, bucket)
    inputs = runner.buffers.device

    def decode_step() -> torch.Tensor:
        hidden = runner.model(
            inputs.input_ids[:bucket], inputs.positions[:, :bucket], runner.kv_caches, metadata
        )  # [bucket, hidden]
        return runner.model.compute_logits(hidden)  # [bucket, vocab]

    side = torch.cuda.Stream(runner.device)
    side.wait_stream(torch.cuda.current_stream(runner.device))
    with torch.cuda.stream(side):
        decode_step()
    torch.cuda.current_stream(runner.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = decode_step()
    return graph, logits
