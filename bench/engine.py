"""Throughput and time to first token: stillcut's engine against transformers' `generate`.

A random checkpoint shaped like Qwen2.5-VL-7B scaled down to run in minutes on 2 cores. The
scaling keeps the 7B model's ratio of vision-tower to language-model FLOPs per token (both
non-embedding; the tower runs on 4 patches per language token): 642.5M / 6525M = 0.098 for
the 7B, 3.84M / 38.3M = 0.100 here. 16 requests ask about sample clips of 4 to 16 frames with
max_tokens from 32 to 256 (random weights never stop early, so every request runs to its
max_tokens and lengths must vary for continuous batching to matter). All requests arrive at
once at t0; TTFT is measured from t0 (and, as "in LM", from when a request joins the language
model, after its vision work: the part EVS shortens). Modes, side by side in one run:

  a1  transformers generate, one request at a time
  a2  transformers generate, all requests in one padded batch (each kept to its max_tokens)
  b   stillcut, all requests submitted at once
  c   the same with EVS rate 0.75
  d   the same as b, asking a second question about the same videos (prefix + encoder cache)
  e   the same with EVS rate 0.75 before the tower (`stage="pixels"`: it encodes kept tokens)

Time breakdown: decode (video decode + preprocess), evs (EVS itself), encode (vision tower),
prefill (steps that hold prefill tokens) and generation (decode-only steps); transformers'
prefill is measured as time to its first token minus the tower, and its "in LM" TTFT from the
`generate` call (which runs the tower inside).

Modes b, c and e each start with both caches cleared and assert that no video hit a cache; with
`--rounds R` they run R times interleaved (b, d, c, e, b, d, ...) and every figure is the
median over rounds. Mode e's lines beside its targets: encode time e / b (e's EVS time, its
pixel features and choice, counted in), the TTFT e / b would reach with no encode time at all
(its floor: each request's TTFT less the encode time spent before it joined), and the encode
time per kept token beside b's per token.

    python bench/engine.py [--requests 16] [--skip-hf] [--rounds 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.models.qwen2_vl.preprocess import preprocess_video
from stillcut.engine.request import SamplingParams
from stillcut.kernels.evs import EVSConfig
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.pipeline import VisionPipeline

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
CLIPS = ("moving_object.mp4", "pan.mp4", "scene_cut.mp4", "motion_mask.mp4")
TEXT = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 2688,
}
VISION = {
    "depth": 4,
    "hidden_size": 256,
    "num_heads": 4,
    "intermediate_size": 684,
    "fullatt_block_indexes": (3,),
}
QUESTIONS = ("What happens in this video?", "Which object moves the most, and where to?")


@dataclass(frozen=True)
class Job:
    clip: Path
    num_frames: int
    max_tokens: int


@dataclass
class Timings:
    decode: float = 0.0
    evs: float = 0.0  # EVS's own time (before the tower: pixel features and the choice)
    encode: float = 0.0
    prefill: float = 0.0
    generation: float = 0.0
    ttfts: list[float] = field(default_factory=list)  # from t0
    engine_ttfts: list[float] = field(default_factory=list)  # from joining the engine
    # from t0, less the encode time spent before the request joined: TTFT with no encoder
    floor_ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    encoded_tokens: int = 0  # video tokens the tower produced (kept ones, before the tower)
    cache_hits: int = 0  # videos served by the encoder cache or the prefix cache


def jobs(count: int) -> list[Job]:
    return [
        Job(SAMPLES / CLIPS[i % len(CLIPS)], 4 + 2 * (i % 7), 32 + (i * 53) % 225)
        for i in range(count)
    ]


def run_stillcut(engine, pipeline, work, evs, question) -> Timings:
    """All requests arrive at t0. As in vLLM, where the encoder runs for the requests a step
    schedules, vision work and engine steps interleave: each request's clip is decoded and
    encoded in arrival order and the request joins the engine; after each clip the tower had
    to encode, one engine step runs (prefilling it beside the decodes of those already running)
    before the next clip. Clips found in the encoder cache cost nothing and join at once."""
    timings = Timings()
    t0, t0_monotonic = time.perf_counter(), time.monotonic()  # request metrics use monotonic
    encoded_before: dict[str, float] = {}  # request id -> encode seconds before it joined
    video_start: dict[str, int] = {}  # request id -> its video's first prompt position

    def step() -> None:
        has_prefill = bool(engine.scheduler.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        )
        start = time.perf_counter()
        outputs = engine.step()
        spent = time.perf_counter() - start
        if has_prefill:
            timings.prefill += spent
        else:
            timings.generation += spent
        for output in outputs:
            if output.finished:
                ttft = output.metrics.first_token_time - t0_monotonic
                timings.tokens += len(output.token_ids)
                timings.ttfts.append(ttft)
                timings.engine_ttfts.append(output.metrics.ttft)
                timings.floor_ttfts.append(ttft - encoded_before[output.request_id])
                cached = output.metrics.num_cached_tokens
                timings.cache_hits += cached > video_start[output.request_id]

    for job in work:
        item = pipeline.video(job.clip, evs=evs, max_frames=job.num_frames, end=job.num_frames / 2)
        timings.decode += item.stats.get("decode_s", 0.0) + item.stats.get("preprocess_s", 0.0)
        timings.evs += item.stats.get("evs_s", 0.0)
        timings.encode += 0.0 if item.stats["cache_hit"] else item.stats["encode_s"]
        timings.encoded_tokens += 0 if item.stats["cache_hit"] else item.num_tokens
        timings.cache_hits += item.stats["cache_hit"]
        prompt = engine.processor.build_text(question, [item])
        params = SamplingParams(max_tokens=job.max_tokens, ignore_eos=True)
        request_id = engine.add_request(prompt, params)
        encoded_before[request_id] = timings.encode
        video_start[request_id] = prompt.mm_positions[0].offset
        if not item.stats["cache_hit"]:
            step()
    while engine.has_unfinished_requests():
        step()
    timings.wall = time.perf_counter() - t0
    return timings


def run_cold(engine, pipeline, work, evs, question) -> Timings:
    """`run_stillcut` after both caches are cleared; no video may hit either."""
    pipeline.cache.clear()
    engine.scheduler.kv_cache.reset_prefix_cache()
    timings = run_stillcut(engine, pipeline, work, evs, question)
    assert timings.cache_hits == 0, f"{timings.cache_hits} videos hit a cache"
    return timings


class _FirstToken:
    """A streamer that records when the first generated token appears."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_inputs(engine, preprocess, work, question):
    """Decode and preprocess each clip (the same ops and output as transformers' processor),
    and the prompt token ids with one placeholder per merged token."""
    prompts, videos, grids, seconds, decode_s = [], [], [], [], 0.0
    for job in work:
        start = time.perf_counter()
        decoded = decode_video(
            job.clip, DecodeConfig(max_frames=job.num_frames), end=job.num_frames / 2
        )
        prepared = preprocess_video(decoded.frames, decoded.sample_fps, preprocess)
        decode_s += time.perf_counter() - start
        merged = prepared.grid_thw[0] * prepared.grid_thw[1] * prepared.grid_thw[2] // 4
        prompts.append(engine.processor.build_text(question, [_Stub(merged)]).token_ids)
        videos.append(prepared.patches)
        grids.append(prepared.grid_thw)
        seconds.append(prepared.second_per_grid_ts)
    return prompts, videos, grids, seconds, decode_s


class _Stub:
    """Stands in for an item when only the placeholder count matters."""

    kind = "video"
    identifier = "stub"

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens


def timed_tower(model) -> list[float]:
    spent: list[float] = []
    tower = model.model.visual
    tower.register_forward_pre_hook(lambda *_: spent.append(-time.perf_counter()))
    tower.register_forward_hook(lambda *_: spent.append(time.perf_counter()))
    return spent


def run_hf_sequential(model, engine, preprocess, work, question) -> Timings:
    timings, spent = Timings(), timed_tower(model)
    t0 = time.perf_counter()
    prompts, videos, grids, seconds, timings.decode = hf_inputs(engine, preprocess, work, question)
    for job, ids, video, grid, sec in zip(work, prompts, videos, grids, seconds, strict=True):
        streamer = _FirstToken()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=torch.tensor([ids]),
                pixel_values_videos=video,
                video_grid_thw=torch.tensor([grid]),
                second_per_grid_ts=torch.tensor([sec]),
                max_new_tokens=job.max_tokens,
                min_new_tokens=job.max_tokens,
                do_sample=False,
                streamer=streamer,
                pad_token_id=0,
            )
        timings.ttfts.append(streamer.first - t0)
        timings.engine_ttfts.append(streamer.first - start)
        timings.prefill += streamer.first - start
        timings.generation += time.perf_counter() - streamer.first
        timings.tokens += job.max_tokens
    timings.encode = sum(spent)
    timings.prefill -= timings.encode
    timings.wall = time.perf_counter() - t0
    return timings


def run_hf_batched(model, engine, preprocess, work, question) -> Timings:
    timings, spent = Timings(), timed_tower(model)
    t0 = time.perf_counter()
    prompts, videos, grids, seconds, timings.decode = hf_inputs(engine, preprocess, work, question)
    longest = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    streamer = _FirstToken()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            pixel_values_videos=torch.cat(videos),
            video_grid_thw=torch.tensor(grids),
            second_per_grid_ts=torch.tensor(seconds),
            max_new_tokens=max(job.max_tokens for job in work),
            min_new_tokens=max(job.max_tokens for job in work),
            do_sample=False,
            streamer=streamer,
            pad_token_id=pad,
        )
    timings.ttfts = [streamer.first - t0] * len(work)
    timings.engine_ttfts = [streamer.first - start] * len(work)
    timings.encode = sum(spent)
    timings.prefill = streamer.first - start - timings.encode
    timings.generation = time.perf_counter() - streamer.first
    timings.tokens = sum(job.max_tokens for job in work)  # what the requests asked for
    timings.wall = time.perf_counter() - t0
    return timings


def make_engine(path) -> LLMEngine:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=4096),
        cache=CacheConfig(num_blocks=2048, held_share=0.0),
    )
    return LLMEngine(path, config)


def median_of(runs: list[Timings], figure) -> float:
    """The median over rounds of `figure(timings)`."""
    return statistics.median(figure(t) for t in runs)


FIGURES = {
    "tok/s": lambda t: t.tokens / t.wall,
    "ttft": lambda t: statistics.median(t.ttfts),
    "in_lm": lambda t: statistics.median(t.engine_ttfts),
    "floor": lambda t: statistics.median(t.floor_ttfts),
    "decode": lambda t: t.decode,
    "encode": lambda t: t.encode,
    "evs": lambda t: t.evs,
    "encode_evs": lambda t: t.encode + t.evs,
    "prefill": lambda t: t.prefill,
    "generate": lambda t: t.generation,
    "wall": lambda t: t.wall,
    "per_token": lambda t: t.encode / max(1, t.encoded_tokens),
}


def print_table(rows: dict[str, list[Timings]]) -> None:
    print(
        f"{'mode':<40}{'tok/s':>8}{'TTFT p50':>10}{'in LM':>8}{'decode':>8}{'evs':>7}{'encode':>8}"
        f"{'prefill':>9}{'generate':>10}{'wall':>8}"
    )
    for name, runs in rows.items():
        f = {key: median_of(runs, figure) for key, figure in FIGURES.items()}
        print(
            f"{name:<40}{f['tok/s']:>8.1f}{f['ttft']:>9.2f}s{f['in_lm']:>7.2f}s"
            f"{f['decode']:>7.1f}s{f['evs']:>6.2f}s{f['encode']:>7.1f}s{f['prefill']:>8.1f}s"
            f"{f['generate']:>9.1f}s"
            f"{f['wall']:>7.1f}s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="only the stillcut modes")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of b, d, c, e")
    args = parser.parse_args()
    path = cached_checkpoint("random-demo", seed=0, dtype="float32", text=TEXT, vision=VISION)
    work = jobs(args.requests)
    rows: dict[str, list[Timings]] = {}

    engine = make_engine(path)
    pipeline = VisionPipeline(path, decode_config=DecodeConfig())
    if not args.skip_hf:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        rows["a1 transformers, one at a time"] = [
            run_hf_sequential(model, engine, pipeline.video_preprocess, work, QUESTIONS[0])
        ]
        rows["a2 transformers, padded batch"] = [
            run_hf_batched(model, engine, pipeline.video_preprocess, work, QUESTIONS[0])
        ]
        del model
    modes = {
        "b  stillcut, all at once": (None, run_cold, QUESTIONS[0]),
        "d  b + second question (cached)": (None, run_stillcut, QUESTIONS[1]),
        "c  stillcut, EVS rate 0.75": (EVSConfig(mode="rate", rate=0.75), run_cold, QUESTIONS[0]),
        "e  stillcut, EVS rate 0.75 before the tower": (
            EVSConfig(mode="rate", rate=0.75, stage="pixels"),
            run_cold,
            QUESTIONS[0],
        ),
    }
    for _ in range(args.rounds):
        for name, (evs, run, question) in modes.items():
            rows.setdefault(name, []).append(run(engine, pipeline, work, evs, question))
    print(
        f"{args.requests} requests, clips of 4-16 frames, max_tokens 32-256, "
        f"{torch.get_num_threads()} threads, medians of {args.rounds} round(s)"
    )
    print_table(rows)
    print_targets(rows)


def print_targets(rows: dict[str, list[Timings]]) -> None:
    def figure(key: str) -> dict[str, float]:
        return {name[:2].strip(): median_of(runs, FIGURES[key]) for name, runs in rows.items()}

    ttft, tput, encode = figure("ttft"), figure("tok/s"), figure("encode")
    if "e" in encode:  # before the tower, EVS's own time is part of what the encode costs
        encode["e"] = figure("encode_evs")["e"]
    targets = [
        ("throughput b / a1", ("b", "a1"), tput, ">=", 2.5),
        ("throughput b / a2", ("b", "a2"), tput, ">=", 1.3),
        ("median TTFT c / b", ("c", "b"), ttft, "<=", 0.5),
        ("median TTFT d / b", ("d", "b"), ttft, "<=", 0.1),
        ("encode+evs e / b", ("e", "b"), encode, "<=", 0.45),
        ("throughput e / c", ("e", "c"), tput, ">=", 0.97),
    ]
    for label, (top, bottom), values, op, bound in targets:
        if top not in values or bottom not in values:
            continue
        ratio = values[top] / values[bottom]
        met = ratio >= bound if op == ">=" else ratio <= bound
        print(f"{label:<20}{ratio:>7.2f}  target {op} {bound}: {'met' if met else 'MISSED'}")
    in_lm = figure("in_lm")
    print(
        f"{'(in the LM, c / b)':<20}{in_lm['c'] / in_lm['b']:>7.2f}  the TTFT EVS acts on: "
        "from joining the engine, vision excluded"
    )
    floor = figure("floor")["e"] / ttft["b"]
    ratio = ttft["e"] / ttft["b"]
    met = ratio <= 0.5 or ratio <= floor + 0.05
    print(
        f"{'median TTFT e / b':<20}{ratio:>7.2f}  target <= 0.5 or within 0.05 of its floor "
        f"{floor:.2f} (e with no encode time): {'met' if met else 'MISSED'}"
    )
    per_token = figure("per_token")
    print(
        f"{'encode per token':<20}  e {per_token['e'] * 1e3:.2f} ms a kept token, "
        f"b {per_token['b'] * 1e3:.2f} ms a token"
    )


if __name__ == "__main__":
    main()
