"""The engine on CUDA: the same greedy tokens as on the CPU, and decode step times.

Runs one checkpoint through `LLMEngine` on the CPU (fp32, torch attention) and on CUDA (fp32,
then bf16, Triton attention) with the same prompts: text only, and text around a synthetic
video item (random embeddings on a dense grid) so the multimodal scatter and M-RoPE positions
run too. fp32 tokens must match the CPU's exactly; bf16 is reported. Then decode step times on
CUDA at batch 1 and 16. Needs no PyAV and no hub; exits 1 when a check fails.

    python bench/engine_gpu_check.py CHECKPOINT
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.multimodal import MultiModalItem
from stillcut.engine.positions import dense_coords
from stillcut.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


def engine_on(path: str, device: str, dtype: str) -> LLMEngine:
    config = EngineConfig(
        dtype=dtype,
        device=device,
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16, max_model_len=1024),
        cache=CacheConfig(num_blocks=1024, held_share=0.0),
    )
    return LLMEngine(path, config)


def prompts(engine: LLMEngine) -> list:
    hidden = engine.model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    item = MultiModalItem(
        kind="video",
        embeds=torch.randn(3 * 4 * 6, hidden, generator=generator),
        coords=dense_coords(3, 4, 6),
        grid_thw=(3, 8, 12),
        second_per_grid_ts=1.0,
        identifier="synthetic-video",
    )
    return [
        engine.processor.build_text("Tell me a story about the sea."),
        engine.processor.build_text("What happens here?", [item]),
    ]


def decode_step_ms(engine: LLMEngine, batch: int, steps: int = 20) -> float:
    prompt = engine.processor.build_text("Count to a hundred.")
    ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        for _ in range(batch)
    ]
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    args = parser.parse_args()
    cpu = engine_on(args.checkpoint, "cpu", "float32")
    expected = [o.token_ids for o in cpu.generate(prompts(cpu), GREEDY)]
    failures = 0
    for dtype in ("float32", "bfloat16"):
        gpu = engine_on(args.checkpoint, "cuda", dtype)
        got = [o.token_ids for o in gpu.generate(prompts(gpu), GREEDY)]
        for name, ours, ref in zip(("text", "video"), got, expected, strict=True):
            same = sum(a == b for a, b in zip(ours, ref, strict=True))
            ok = ours == ref or dtype == "bfloat16"
            failures += not ok
            print(
                f"{dtype:<9} {name:<6} {same}/{len(ref)} tokens equal to CPU fp32"
                f"{'' if ok else '  FAILED'}"
            )
        gpu.scheduler.kv_cache.check_consistency()
        for batch in (1, 16):
            print(f"{dtype:<9} decode step, batch {batch:>2}: {decode_step_ms(gpu, batch):.2f} ms")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
