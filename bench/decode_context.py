"""Decode steps at long contexts: the native CPU step against the model's torch ops.

A video prompt is thousands of tokens, and at long contexts a decode step also reads every
cached key and value of every layer. This times the model's forward for one decode step of
`batch` requests whose contexts hold `context` tokens (random K/V in scattered blocks; no
prefill), through the native step and through the torch ops, interleaved in one run, beside
the floor of bytes read (weights without the head and embedding, plus the K/V) over the read
bandwidth measured in the same run.

    python bench/decode_context.py [--model PATH] [--contexts 1024 4096 16384] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stillcut.engine.checkpoint import load_model_config, resolve_checkpoint
from stillcut.engine.factory import random_demo_checkpoint
from stillcut.kernels.attention_metadata import AttentionMetadata

BLOCK_SIZE = 16
ROUNDS = 7


def metadata(batch: int, context: int, blocks_per_request: int) -> AttentionMetadata:
    """One decode step: request b's new token is its `context`-th, in scattered blocks."""
    order = torch.randperm(batch * blocks_per_request, generator=torch.Generator().manual_seed(0))
    tables = order.view(batch, blocks_per_request).to(torch.int32)
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    return AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=context,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[context] * batch,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the random-demo preset)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    folder = resolve_checkpoint(args.model or random_demo_checkpoint())
    model = load_model_config(folder).family.language_model_class().from_checkpoint(folder)
    native = model.cpu_decoder
    if native is None:
        raise SystemExit("the native CPU decode step is not built here (no C compiler?)")
    layer_bytes = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    threads = torch.get_num_threads()
    print(f"{threads} thread(s); read per step: layer weights {layer_bytes / 1e6:.0f} MB + K/V")
    print(
        f"{'batch':>6}{'context':>9}{'KV MB':>8}{'floor ms':>10}{'native ms':>11}{'torch ms':>10}"
        f"{'native/floor':>14}{'torch/native':>14}"
    )
    for batch in args.batches:
        for context in args.contexts:
            blocks = -(-context // BLOCK_SIZE)
            shape = model.kv_cache_shape(batch * blocks, BLOCK_SIZE)
            kv_caches = [torch.randn(shape) * 0.5 for _ in model.layers]
            kv_bytes = batch * context * 2 * shape[3] * shape[4] * 4 * model.num_layers
            buffer = torch.ones((layer_bytes + kv_bytes) // 4)
            step = metadata(batch, context, blocks)
            ids = torch.arange(batch) * 7 + 3
            positions = torch.full((model.num_position_rows, batch), context - 1)
            times: dict[str, list[float]] = {"native": [], "torch": [], "floor": []}
            with torch.inference_mode():
                for _ in range(ROUNDS):
                    for name, decoder in (("native", native), ("torch", None)):
                        model.cpu_decoder = decoder
                        step.plans.clear()
                        start = time.perf_counter()
                        model(ids, positions, kv_caches, step)
                        times[name].append(time.perf_counter() - start)
                    start = time.perf_counter()
                    buffer.sum()
                    times["floor"].append(time.perf_counter() - start)
            model.cpu_decoder = native
            ms = {name: statistics.median(spent[1:]) * 1e3 for name, spent in times.items()}
            print(
                f"{batch:>6}{context:>9}{kv_bytes / 1e6:>8.0f}{ms['floor']:>10.2f}"
                f"{ms['native']:>11.2f}{ms['torch']:>10.2f}{ms['native'] / ms['floor']:>14.2f}"
                f"{ms['torch'] / ms['native']:>14.2f}"
            )
            del kv_caches, buffer


if __name__ == "__main__":
    main()
