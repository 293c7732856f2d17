"""The GPU path in one run: correctness first (attention, then the engine), then timings.

1. `attention_gpu_check`'s correctness table: the Triton kernel in fp32 (TF32 off) and bf16
   against the torch backend in fp32, over causal, window, soft-cap, bidirectional and
   split-KV steps, and captured decode steps replaying to the eager result.
2. The engine on the parity checkpoints (tiny random Qwen2.5-VL and Gemma 3, built here):
   greedy tokens of text prompts and of a synthetic video (a frame array, no PyAV) with EVS
   off and on, each encoded by the vision pipeline on its own device, on the CPU (fp32, the
   reference) and on CUDA in fp32 eagerly (`enforce_eager`) and with decode CUDA graphs.
   Tokens must be equal (greedy with a repetition penalty, so they depend on the context).
3. Timings on a 7B-shaped (Qwen2.5-7B) bf16 language model with random weights, built in
   device memory (never written): the batch-1 engine decode step (runner and scheduler) with
   graphs and eagerly, interleaved step by step (medians), against its weight-read floor, the
   bytes one step reads (every weight but the embedding table) over the read bandwidth
   measured in this run. Targets: graphs <= 1.3x the floor, graphs >= 1.5x faster than eager.
   Beside them: the same weights read as back-to-back matvecs in one graph (the library's own
   kernels, nothing between them) and the step's time over that, what the rest of a step costs.
   Then the attention timing table.

Exits 1 when a correctness check fails, 2 when only a timing target is missed. About three
minutes on an H200. `--cpu-smoke` runs what a CPU can (the interpreter on tiny attention
shapes, the CPU engine twice, a tiny model for the timing code) and skips the CUDA parts.

    python bench/engine_gpu_check.py [--cpu-smoke] [--qwen DIR --gemma DIR]

`--qwen`/`--gemma` take checkpoints built elsewhere (carried to a GPU machine whose
transformers differs: built ones are cached per transformers version).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import attention_gpu_check
import numpy as np
import torch

from stillcut.engine.cache_groups import AttentionGroup
from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.cuda_graphs import decode_buckets
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.qwen2_vl.config import TextConfig
from stillcut.engine.models.qwen2_vl.model import Qwen2LanguageModel
from stillcut.engine.request import Request, SamplingParams
from stillcut.engine.runner import ModelRunner
from stillcut.engine.scheduler import Scheduler
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.pipeline import VisionPipeline

# Greedy, with a repetition penalty: the tiny random models would otherwise repeat their last
# token, which hides what attention over the context got wrong.
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
EVS_SETTINGS = {"evs off": None, "evs 0.5": EVSConfig(mode="rate", rate=0.5)}
FLOOR_TARGET, GRAPH_SPEEDUP_TARGET = 1.3, 1.5
QWEN_7B = TextConfig(
    vocab_size=152064,
    hidden_size=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    intermediate_size=18944,
    mrope_section=(16, 24, 24),
)
SMOKE_LM = TextConfig(
    vocab_size=4096,
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
    mrope_section=(8, 12, 12),
)


def synthetic_frames(num_frames: int = 8, height: int = 112, width: int = 112) -> np.ndarray:
    """`[T, H, W, 3]` uint8: a static textured background with a square moving across it, so
    EVS keeps the moving part and drops the rest."""
    rng = np.random.default_rng(0)
    frames = np.repeat(rng.integers(0, 256, (1, height, width, 3), dtype=np.uint8), num_frames, 0)
    for t in range(num_frames):
        left = 8 + 10 * t
        frames[t, 30:70, left : left + 30] = (255, 40, 40)
    return frames


def engine_config(device: str, dtype: str, enforce_eager: bool) -> EngineConfig:
    return EngineConfig(
        dtype=dtype,
        device=device,
        enforce_eager=enforce_eager,
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=1024),
        cache=CacheConfig(num_blocks=256, held_share=0.0),
    )


def greedy_tokens(path: Path, device: str, enforce_eager: bool) -> dict[str, list[int]]:
    """Greedy tokens per prompt (text; the synthetic video per EVS setting) on `device`."""
    engine = LLMEngine(path, engine_config(device, "float32", enforce_eager))
    vision = VisionPipeline(path, device=device, enforce_eager=enforce_eager)
    frames = synthetic_frames()
    prompts = {"text": engine.processor.build_text("Tell me a story about the sea.")}
    for name, evs in EVS_SETTINGS.items():
        item = vision.video(frames, evs=evs)
        prompts[f"video, {name} ({item.num_tokens} tokens)"] = engine.processor.build_text(
            "What happens here?", [item]
        )
    outputs = engine.generate(list(prompts.values()), GREEDY)
    engine.scheduler.kv_cache.check_consistency()
    return {name: out.token_ids for name, out in zip(prompts, outputs, strict=True)}


def check_engine(checkpoints: dict[str, Path], cuda: bool) -> bool:
    """CPU tokens against CUDA eager and CUDA graphs on each parity checkpoint."""
    modes = {"cuda eager": ("cuda", True), "cuda graphs": ("cuda", False)}
    if not cuda:
        modes = {"cpu again": ("cpu", True)}
        print("CUDA runs skipped (no CUDA): the CPU engine is compared with itself")
    all_ok = True
    for name, path in checkpoints.items():
        expected = greedy_tokens(path, "cpu", True)
        for mode, (device, eager) in modes.items():
            got = greedy_tokens(path, device, eager)
            for prompt, tokens in got.items():
                ref = expected[prompt]
                same = sum(a == b for a, b in zip(tokens, ref, strict=True))
                ok = tokens == ref
                all_ok &= ok
                print(
                    f"{name:<16} {mode:<12} {prompt:<30} {same:>3}/{len(ref)} equal to CPU fp32"
                    f"  {'ok' if ok else 'FAIL'}",
                    flush=True,
                )
    return all_ok


def random_language_model(
    config: TextConfig, dtype: torch.dtype, device: str, qwen: Path
) -> torch.nn.Module:
    """A Qwen2 language model of `config`'s shape with random weights, made in place on
    `device` (a 7B model never exists on the host or on disk); placeholder ids from `qwen`."""
    rope_spec = Qwen2LanguageModel.from_checkpoint(qwen).rope_spec
    model = Qwen2LanguageModel(config, rope_spec, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.fill_(1.0)
            else:
                weight.normal_(0.0, 0.02, generator=generator)
    model.prepare_weights()
    return model.eval()


class DecodeLoop:
    """One request decoding through a real scheduler and a runner: what `LLMEngine.step`
    does, without detokenizing."""

    def __init__(self, model, device: str, dtype: torch.dtype, graphs: bool) -> None:
        config = model.config
        scheduler_config = SchedulerConfig(max_num_seqs=1, max_model_len=4096)
        cache_config = CacheConfig(num_blocks=256, held_share=0.0, enable_prefix_caching=False)
        group = AttentionGroup(
            tuple(range(config.num_layers)), config.num_kv_heads, config.head_dim
        )
        self.scheduler = Scheduler(scheduler_config, cache_config, 256)
        self.runner = ModelRunner(
            model,
            [group],
            num_blocks=256,
            block_size=cache_config.block_size,
            max_num_reqs=1,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_model_len=scheduler_config.max_model_len,
            device=device,
            kv_dtype=dtype,
            decode_buckets=decode_buckets(1, 1) if graphs else (),
        )
        if graphs:
            self.runner.capture_decode_graphs()
        prompt = list(range(100, 612))  # 512 tokens
        params = SamplingParams(max_tokens=3000, ignore_eos=True)
        self.scheduler.add_request(Request("r", prompt, sampling_params=params))
        self.step()  # the prefill

    def step(self) -> None:
        output = self.scheduler.schedule()
        result = self.runner.execute(output)
        self.scheduler.update_from_output(output, result.sampled)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def read_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes per second a streaming read (a sum) of a buffer of `num_bytes` reaches here."""
    buffer = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    times = []
    for _ in range(10):
        synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        synchronize(device)
        times.append(time.perf_counter() - start)
    del buffer
    return num_bytes / statistics.median(times[2:])


def matvecs_alone_ms(model: torch.nn.Module, runs: int = 40) -> float:
    """GPU time of one batch-1 matvec per weight matrix (the embedding table left out), back to
    back in one CUDA graph: what the library's kernels take to read the step's weights, with
    nothing else in between (the peer the whole step is compared with)."""
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    rows = {m.shape[1]: torch.randn(1, m.shape[1], device="cuda", dtype=m.dtype) for m in matrices}
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for matrix in matrices:
            torch.matmul(rows[matrix.shape[1]], matrix.t())
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[5:])


def time_decode(config: TextConfig, device: str, steps: int, qwen: Path) -> bool:
    """Batch-1 decode steps with graphs and eagerly against the weight-read floor."""
    from decode_roofline import weight_bytes_per_step

    dtype = torch.bfloat16
    model = random_language_model(config, dtype, device, qwen)
    read_bytes, num_params = weight_bytes_per_step(model)
    bandwidth = read_bandwidth(device, min(4 << 30, read_bytes))
    floor_ms = read_bytes / bandwidth * 1e3
    loops = {"eager": DecodeLoop(model, device, dtype, graphs=False)}
    if device == "cuda":
        loops["graphs"] = DecodeLoop(model, device, dtype, graphs=True)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(steps):  # interleaved: eager, graphs, eager, graphs ...
        for name, loop in loops.items():
            synchronize(device)
            start = time.perf_counter()
            loop.step()
            synchronize(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    medians = {name: statistics.median(t[3:]) for name, t in times.items()}
    print(
        f"{num_params / 1e9:.2f}B parameters, {read_bytes / 1e9:.2f} GB read per step, "
        f"read bandwidth {bandwidth / 1e9:.0f} GB/s -> floor {floor_ms:.3f} ms"
    )
    for name, ms in medians.items():
        print(f"batch-1 decode step, {name:<6}: {ms:8.3f} ms  {ms / floor_ms:5.2f}x the floor")
    if "graphs" not in medians:
        print("graphs timing skipped (no CUDA)")
        return True
    matvecs_ms = matvecs_alone_ms(model)
    per_matvecs = medians["graphs"] / matvecs_ms
    print(
        f"the weights as matvecs alone: {matvecs_ms:8.3f} ms  {matvecs_ms / floor_ms:5.2f}x the "
        f"floor; the graphs step {per_matvecs:.2f}x that (the kernels between the products)"
    )
    speedup = medians["eager"] / medians["graphs"]
    floor_ok = medians["graphs"] / floor_ms <= FLOOR_TARGET
    speedup_ok = speedup >= GRAPH_SPEEDUP_TARGET
    print(f"graphs <= {FLOOR_TARGET}x floor: {'ok' if floor_ok else 'MISSED'}")
    print(
        f"graphs {speedup:.2f}x faster than eager (>= {GRAPH_SPEEDUP_TARGET}x): "
        f"{'ok' if speedup_ok else 'MISSED'}"
    )
    return floor_ok and speedup_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="what runs on CPU; no CUDA")
    parser.add_argument("--iters", type=int, default=20, help="attention timing iterations")
    parser.add_argument("--qwen", type=Path, help="tiny Qwen2.5-VL checkpoint (default: built)")
    parser.add_argument("--gemma", type=Path, help="tiny Gemma 3 checkpoint (default: built)")
    args = parser.parse_args()
    checkpoints = {
        "qwen2.5-vl tiny": args.qwen or cached_checkpoint("tiny", seed=0),
        "gemma3 tiny": args.gemma or cached_checkpoint("tiny", seed=0, family="gemma3"),
    }
    started = time.perf_counter()
    device, cases = attention_gpu_check.setup(args.cpu_smoke)
    cuda = device.type == "cuda"
    if cuda:
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("== 1. attention correctness", flush=True)
    correct = attention_gpu_check.check_all(device, cases)
    print("== 2. engine tokens against the CPU", flush=True)
    correct &= check_engine(checkpoints, cuda)
    print("== 3. timings", flush=True)
    shape, steps = (QWEN_7B, 40) if cuda else (SMOKE_LM, 6)
    targets_met = time_decode(shape, device.type, steps, checkpoints["qwen2.5-vl tiny"])
    attention_gpu_check.time_all(device, cases, args.iters if cuda else 1)
    print(f"total {time.perf_counter() - started:.0f} s")
    return 1 if not correct else (0 if targets_met else 2)


if __name__ == "__main__":
    sys.exit(main())
