"""Paged attention on CUDA: the Triton kernel against the torch backend, accuracy and speed.

Each scenario is one runner step on a random paged KV cache (shuffled block tables, block size
16) with the head shapes of a real model: decode batches, prefill from scratch, a chunk after a
cached prefix mixed with decodes, Gemma 3 style bidirectional images with a sliding window, a
soft cap, and long decodes at batch 1 and 4 that split their keys (split-KV). Correctness
first: the Triton kernel in fp32 (TF32 off) and bf16 against the torch backend in fp32 on the
same data (max abs error <= 1e-4 and 2e-2), and a captured decode step replaying to the eager
result. Then times, medians of CUDA-event timings, Triton against torch in bf16. Exits 1 when
a check fails. `bench/engine_gpu_check.py` runs this as its first part.

    python bench/attention_gpu_check.py [--iters 20]
    python bench/attention_gpu_check.py --smoke    # tiny shapes on CPU, Triton interpreted
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from stillcut.kernels.attention import paged_attention
from stillcut.kernels.attention_metadata import AttentionMetadata

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max abs error against torch fp32


@dataclass(frozen=True)
class Scenario:
    """One step: `requests` are (context_len, query_len); `items` rows are (b, start, end)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    requests: list[tuple[int, int]]
    items: list[tuple[int, int, int]] = field(default_factory=list)
    window: int | None = None
    soft_cap: float | None = None


def decodes(count: int, low: int, high: int, seed: int) -> list[tuple[int, int]]:
    generator = torch.Generator().manual_seed(seed)
    return [(int(n), 1) for n in torch.randint(low, high, (count,), generator=generator)]


def images(
    b: int, first: int, end: int, length: int = 256, gap: int = 40
) -> list[tuple[int, int, int]]:
    """Bidirectional items of `length` tokens separated by `gap` text tokens."""
    return [(b, s, s + length) for s in range(first, end - length, length + gap)]


def scenarios() -> list[Scenario]:
    qwen7b = dict(num_heads=28, num_kv_heads=4, head_dim=128)
    gemma4b = dict(num_heads=8, num_kv_heads=4, head_dim=256)
    gemma_decodes = decodes(16, 1500, 5000, seed=2)
    return [
        Scenario("qwen7b decode x64", **qwen7b, requests=decodes(64, 500, 4000, seed=0)),
        Scenario("qwen7b prefill 4096", **qwen7b, requests=[(4096, 4096)]),
        Scenario(
            "qwen7b chunk 2048@8192 + 32 dec",
            **qwen7b,
            requests=[(8192, 2048)] + decodes(32, 500, 4000, seed=1),
        ),
        Scenario(
            "gemma3-4b chunk+dec, images, w1024",
            **gemma4b,
            requests=[(4096, 2048)] + gemma_decodes,
            items=images(0, 100, 4096) + [it for b in (1, 2, 3) for it in images(b, 50, 1500)],
            window=1024,
        ),
        Scenario(
            "gemma3-4b decode x64, w1024",
            **gemma4b,
            requests=decodes(64, 1500, 5000, seed=3),
            items=[it for b in range(0, 64, 4) for it in images(b, 20, 1400)],
            window=1024,
        ),
        Scenario(
            "soft cap 50, w4096 (gemma2-2b)",
            **gemma4b,
            requests=[(2048, 2048)] + decodes(16, 500, 3000, seed=4),
            window=4096,
            soft_cap=50.0,
        ),
        Scenario("split-KV: qwen7b decode 16k x1", **qwen7b, requests=[(16384, 1)]),
        Scenario("split-KV: qwen7b decode 8k x4", **qwen7b, requests=decodes(4, 6000, 9000, 5)),
        Scenario(
            "split-KV: gemma3 16k x1, image, cap",
            **gemma4b,
            requests=[(16384, 1)],
            items=[(0, 16000, 16384)],
            soft_cap=50.0,
        ),
    ]


def shrink(sc: Scenario, factor: int = 64) -> Scenario:
    """The same step in miniature, for a CPU run of the interpreter."""
    requests = [
        (max(2, ctx // factor), max(1, min(q // factor, ctx // factor))) for ctx, q in sc.requests
    ]
    requests = requests[:5]
    items = [(b, s // factor, max(s // factor + 1, e // factor)) for b, s, e in sc.items if b < 5]
    items = [it for it in items if it[2] <= requests[it[0]][0]]
    group = sc.num_heads // sc.num_kv_heads
    window = None if sc.window is None else max(2, sc.window // factor)
    return replace(
        sc,
        num_heads=group,
        num_kv_heads=1,
        head_dim=32,
        requests=requests,
        items=items,
        window=window,
    )


def build(sc: Scenario, dtype: torch.dtype, device: torch.device):
    """Query `[N, H, D]`, a random cache `[2, blocks, 16, Hkv, D]` and the step's metadata."""
    generator = torch.Generator(device=device).manual_seed(0)
    blocks_per_request = [-(-ctx // BLOCK_SIZE) for ctx, _ in sc.requests]
    num_blocks = sum(blocks_per_request) + 1
    order = torch.randperm(num_blocks, generator=generator, device=device).tolist()
    block_tables = torch.zeros(len(sc.requests), max(blocks_per_request), dtype=torch.int32)
    slots, starts = [], [0]
    for b, (ctx, query_len) in enumerate(sc.requests):
        table = [order.pop() for _ in range(blocks_per_request[b])]
        block_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        for p in range(ctx - query_len, ctx):
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        starts.append(starts[-1] + query_len)
    shape = (2, num_blocks, BLOCK_SIZE, sc.num_kv_heads, sc.head_dim)
    kv_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    query = torch.randn(starts[-1], sc.num_heads, sc.head_dim, generator=generator, device=device)
    seq_lens = [ctx for ctx, _ in sc.requests]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(q for _, q in sc.requests),
        max_seq_len=max(seq_lens),
        mm_ranges=torch.tensor(sc.items, dtype=torch.int32, device=device) if sc.items else None,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return query.to(dtype), kv_cache, metadata


def time_ms(fn, iters: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def _runner(sc: Scenario, dtype, device):
    query, kv_cache, metadata = build(sc, dtype, device)
    kwargs = dict(scale=sc.head_dim**-0.5, sliding_window=sc.window, logits_soft_cap=sc.soft_cap)

    def run(backend: str, q=query, kv=kv_cache):
        return paged_attention(q, kv, metadata, backend=backend, **kwargs)

    return run, query, kv_cache, metadata


def check_scenario(sc: Scenario, dtype, device) -> tuple[str, bool]:
    """Triton in `dtype` against torch fp32 on the same data; the row and whether it passed."""
    from stillcut.kernels.paged_attention_triton import num_kv_splits

    run, query, kv_cache, md = _runner(sc, dtype, device)
    expected = run("torch", query.float(), kv_cache.float())
    error = (run("triton").float() - expected).abs().max().item()
    ok = error <= TOLERANCE[dtype]  # False for NaN too
    splits = num_kv_splits(md.max_query_len, md.max_seq_len, len(sc.requests), sc.num_kv_heads)
    if sc.name.startswith("split-KV") and splits < 2:
        ok = False  # the scenario must exercise the split path
    return (
        f"{sc.name:<36} {str(dtype)[6:]:>8} {query.shape[0]:>6} {splits:>6} {error:>10.2e} "
        f"{TOLERANCE[dtype]:>8.0e}  {'ok' if ok else 'FAIL'}"
    ), ok


def time_scenario(sc: Scenario, dtype, device, iters: int) -> str:
    """Median times of both backends in `dtype`, interleaved by backend per scenario."""
    run, query, _, _ = _runner(sc, dtype, device)
    times = {b: time_ms(lambda b=b: run(b), iters, device) for b in ("triton", "torch")}
    return (
        f"{sc.name:<36} {str(dtype)[6:]:>8} {query.shape[0]:>6} {times['triton']:>9.3f} "
        f"{times['torch']:>9.3f} {times['torch'] / times['triton']:>7.1f}x"
    )


def check_cuda_graph(sc: Scenario, device: torch.device) -> bool:
    """A captured decode step replays to the eager result: the launcher never syncs."""
    query, kv_cache, metadata = build(sc, torch.bfloat16, device)
    kwargs = dict(scale=sc.head_dim**-0.5, sliding_window=sc.window, backend="triton")
    eager = paged_attention(query, kv_cache, metadata, **kwargs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_attention(query, kv_cache, metadata, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(query, kv_cache, metadata, **kwargs)
    query.mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    expected = paged_attention(query, kv_cache, metadata, **kwargs)
    ok = torch.equal(captured, expected) and not torch.equal(captured, eager)
    print(f"cuda graph, {sc.name}: {'ok' if ok else 'FAIL'}")
    return ok


def setup(smoke: bool) -> tuple[torch.device, list[Scenario]]:
    """The device and scenarios of a run: CUDA at full size, or tiny ones interpreted on CPU
    (small enough for split-KV only where its threshold is lowered to match)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is first imported
        from stillcut.kernels import paged_attention_triton

        paged_attention_triton.MIN_KEYS_PER_SPLIT = 16  # the shrunk contexts split like 16k
        return torch.device("cpu"), [shrink(sc) for sc in scenarios()]
    assert torch.cuda.is_available(), "needs CUDA (or --smoke)"
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda"), scenarios()


def check_all(device: torch.device, cases: list[Scenario]) -> bool:
    """The correctness table (and, on CUDA, graph replays); whether everything passed."""
    print(f"{'scenario':<36} {'dtype':>8} {'tokens':>6} {'splits':>6} {'max err':>10} {'tol':>8}")
    all_ok = True
    for sc in cases:
        for dtype in (torch.float32, torch.bfloat16):
            row, ok = check_scenario(sc, dtype, device)
            print(row, flush=True)
            all_ok &= ok
    if device.type == "cuda":
        for sc in (cases[0], cases[4], cases[6]):
            all_ok &= check_cuda_graph(sc, device)
    return all_ok


def time_all(device: torch.device, cases: list[Scenario], iters: int) -> None:
    print(
        f"{'scenario':<36} {'dtype':>8} {'tokens':>6} {'triton ms':>9} {'torch ms':>9} "
        f"{'speedup':>8}"
    )
    for sc in cases:
        print(time_scenario(sc, torch.bfloat16, device, iters), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    args = parser.parse_args()
    device, cases = setup(args.smoke)
    all_ok = check_all(device, cases)
    time_all(device, cases, 1 if args.smoke else args.iters)
    raise SystemExit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
