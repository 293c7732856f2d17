"""Prefix caching on a hybrid model: a second question about a video.

The `bench` preset of a hybrid family (random weights), with the default snapshot interval:
Nemotron 3 Nano Omni (`--family nemotron_h_omni`, the default: 136M language-model parameters,
7 Mamba2, 3 attention, 8 MoE and 1 MLP layers) or Qwen3.5 (`--family qwen3_5`: 105M, 6 Gated
DeltaNet and 2 attention layers, the Qwen3-VL tower, each tubelet its own timestamped item). A
16-frame 448x448 clip (H.264, written here) is asked a 12-token question, then another 12-token
question about the same video: the second finds the video's embeddings in the encoder cache,
and its prompt in the prefix cache up to the last block boundary of the video, where it
restores the recurrent states from a snapshot and prefills only the rest. TTFT counts from the
clip's path to the first token (decode, tower, EVS at the checkpoint's rate, prompt, prefill).
Each round writes a clip of its own (another encoder quality, so other bytes) so its first
question is cold; the rounds alternate first and second questions, and the ratio is the median
of the rounds' ratios. Target: second / first <= 0.15. Beside wall time, the CPU seconds this
process spent (all its threads): seconds apart on a shared machine the wall times of the two
questions see other neighbours, while the work each does is theirs alone.

Then the memory a cached block costs (its K/V, and its share of a snapshot: one per interval
blocks), and the hit rate by prompt length: a context of 1 to 8 blocks and 7 tokens more, asked
two different 12-token questions; the second's cached tokens over its context's. Beside it,
questions of 40 tokens, which end beyond the first asker's last two blocks: the second asker
then finds no snapshot in the context and leaves one where it diverged, which the third finds.

    python bench/hybrid_prefix.py [--family nemotron_h_omni | qwen3_5] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stillcut.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.llm_engine import LLMEngine
from stillcut.engine.request import SamplingParams
from stillcut.samples.make_samples import ClipSpec, encode, render_steady_motion
from stillcut.vision.decode import DecodeConfig
from stillcut.vision.pipeline import VideoInput, VisionPipeline

TARGET = 0.15
NUM_FRAMES, SIZE, FPS = 16, 448, 4
QUESTION_TOKENS = 12
QUESTIONS = (
    "What happens in this video, and where does the red ball go",
    "Which colours does the background show, and how does it change",
)
FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)
FAMILIES = ("nemotron_h_omni", "qwen3_5")  # the hybrid families with a `bench` preset


def twelve_tokens(engine: LLMEngine, text: str) -> str:
    """`text` cut to its first 12 tokens (and checked to encode back to 12)."""
    tokenizer = engine.processor.tokenizer
    cut = tokenizer.decode(engine.processor.encode(text)[:QUESTION_TOKENS])
    assert len(engine.processor.encode(cut)) == QUESTION_TOKENS, cut
    return cut


def write_clip(folder: Path, round_index: int) -> Path:
    """16 frames of 448x448; each round's crf gives other bytes, so no cache knows them."""
    spec = ClipSpec(f"clip{round_index}", SIZE, SIZE, FPS, NUM_FRAMES, crf=20 + round_index)
    path = folder / f"{spec.name}.mp4"
    encode(path, spec, render_steady_motion(spec))
    return path


def time_to_first_token(
    engine, pipeline, clip: Path, question: str
) -> tuple[float, float, int, int]:
    """(wall and CPU seconds from the clip's path to the first token, cached tokens, prompt
    tokens)."""
    started, cpu_started = time.perf_counter(), time.process_time()
    item = pipeline.encode([VideoInput(clip)])[0]
    parts = [{"type": "video"}, {"type": "text", "text": question}]
    messages = [{"role": "user", "content": parts}]
    prompt = engine.processor.build(messages, [item])
    (output,) = engine.generate([prompt], FIRST_TOKEN)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return wall, cpu, output.metrics.num_cached_tokens, len(prompt.token_ids)


def ttft_table(engine, pipeline, questions, num_rounds: int) -> None:
    rounds = []  # per round: (first wall, first CPU, second wall, second CPU)
    with tempfile.TemporaryDirectory() as folder:
        time_to_first_token(engine, pipeline, write_clip(Path(folder), 30), questions[0])  # warm
        for index in range(num_rounds):
            clip = write_clip(Path(folder), index)
            *first, _, num_tokens = time_to_first_token(engine, pipeline, clip, questions[0])
            *second, num_cached, _ = time_to_first_token(engine, pipeline, clip, questions[1])
            rounds.append((*first, *second))
            print(
                f"  round {index}: prompt {num_tokens} tokens, the second reused {num_cached}; "
                f"TTFT {first[0] * 1e3:.0f} then {second[0] * 1e3:.0f} ms wall, "
                f"{first[1] * 1e3:.0f} then {second[1] * 1e3:.0f} ms CPU"
            )
    print("\n| TTFT, median (ms) | first question (cold) | second, same video | second / first |")
    print("|---|---:|---:|---:|")
    for name, column in (("wall", 0), ("CPU (this process)", 1)):
        ratio = statistics.median(r[column + 2] / r[column] for r in rounds)
        first = statistics.median(r[column] for r in rounds) * 1e3
        second = statistics.median(r[column + 2] for r in rounds) * 1e3
        print(f"| {name} | {first:.0f} | {second:.0f} | {ratio:.3f} |")
    print(f"\ntarget: second / first <= {TARGET} (ratios: medians of {num_rounds} rounds)")


def bytes_table(engine: LLMEngine) -> None:
    runner, interval = engine.runner, engine.config.cache.mamba_snapshot_interval
    snapshot = sum(
        t[0].numel() * t.element_size() for s in runner.state_snapshots.values() for t in s
    )
    block = sum(t[:, 0].numel() * t.element_size() for t in runner.kv_caches)
    print(f"\n| per cached block of {engine.block_size} tokens | bytes |\n|---|---:|")
    print(f"| K/V ({len(runner.kv_caches)} attention layers) | {block:,} |")
    print(
        f"| snapshot share (one {snapshot:,}-byte snapshot per {interval} blocks) | "
        f"{snapshot // interval:,} |"
    )


def hit_rate_table(engine: LLMEngine, questions: list[list[int]]) -> None:
    """Per context length: the 12-token questions' second asker's cached tokens, and with
    40-token questions (which end past the first asker's last two blocks) the second and
    third askers' (the second leaves a snapshot where the questions diverge)."""
    print(
        "\n| context (blocks + 7 tokens) | context tokens | 12-token questions: 2nd cached "
        "| hit rate | 40-token questions: 2nd cached | 3rd cached |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    config = engine.model_config
    placeholders = {config.image_token_id, config.video_token_id}
    text_ids = [t for t in range(config.text.get("vocab_size", 1024)) if t not in placeholders]

    def draw(num_tokens: int) -> list[int]:
        drawn = torch.randint(0, len(text_ids), (num_tokens,), generator=generator)
        return [text_ids[i] for i in drawn.tolist()]

    def cached(prompt: list[int]) -> int:
        return engine.generate([prompt], FIRST_TOKEN)[0].metrics.num_cached_tokens

    for num_blocks in range(1, 9):
        num_context = num_blocks * engine.block_size + 7
        context = draw(num_context)
        short = [cached(context + question) for question in questions]
        context = draw(num_context)  # a new context: nothing of the last one is cached
        long = [cached(context + draw(40)) for _ in range(3)]
        assert short[0] == long[0] == 0, "contexts are random: the first asker never hits"
        print(
            f"| {num_blocks} | {num_context} | {short[1]} | {short[1] / num_context:.2f} "
            f"| {long[1]} | {long[2]} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="TTFT rounds (0: skip them)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--family", choices=FAMILIES, default=FAMILIES[0])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = cached_checkpoint("bench", family=args.family)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_model_len=8192),
        cache=CacheConfig(kv_cache_memory=1 << 30),
    )
    engine = LLMEngine(path, config)
    pipeline = VisionPipeline(path, decode_config=DecodeConfig(fps=FPS, max_frames=NUM_FRAMES))
    questions = [twelve_tokens(engine, q) for q in QUESTIONS]
    snapshots = engine.scheduler.kv_cache.snapshots
    print(
        f"hybrid prefix caching, {path.name}: {engine.scheduler.kv_cache.num_blocks} KV blocks, "
        f"{snapshots.num_slots} snapshots, one every {snapshots.interval} blocks; "
        f"{args.threads} threads (shared machine: read the ratios)"
    )
    print(f"questions ({QUESTION_TOKENS} tokens each): {questions}\n")
    if args.rounds:
        ttft_table(engine, pipeline, questions, args.rounds)
    bytes_table(engine)
    hit_rate_table(engine, [engine.processor.encode(q) for q in questions])


if __name__ == "__main__":
    main()
