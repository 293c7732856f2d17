"""The native CPU decode step of a hybrid model against the model's own torch layers: Nemotron
(Mamba2, MoE, relu² MLP, rotary-free attention) and Qwen3.5 (Gated DeltaNet, gated attention
with partial interleaved M-RoPE and q / k head norms, SwiGLU MLP; Qwen3.5-MoE's softmax-routed
experts with a shared expert behind a sigmoid gate).

The tiny Nemotron 3 Nano Omni checkpoint (every layer kind, grouped top-2 routing with a
correction bias, a scaling factor and a shared expert), as stored (float32), in bfloat16 (with
a bfloat16 KV pool) and int8, and a variant with biases everywhere and latent experts; the
tiny Qwen3.5 and Qwen3.5-MoE checkpoints as stored, in bfloat16 (with a bfloat16 KV pool) and
int8 (Qwen3.5-MoE's routed experts stay in the compute dtype, its shared expert is int8). Requests
sit in scattered K/V blocks and in scattered state rows whose slots start out holding noise;
after a torch prefill, five batched decode-shaped steps run natively and through the torch
layers from identical copies: a request joins fresh in the middle of the batch (its slot's noise
must not leak in), another's last prompt tokens arrive one per step (dt's prompt-only floor
applies to them and not after), and one step saves a snapshot of a row. Each step's logits,
and after the steps every recurrent state (Mamba2's conv and SSM states, the DeltaNet's conv
and delta-rule states), every K/V cache and the snapshot, agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from stillcut.engine.cache_groups import attention_groups, recurrent_groups
from stillcut.engine.checkpoint import load_model_config
from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.quantization import WeightFormat
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu import library
from stillcut.kernels.cpu.packing import is_packed, pack_matrix, unpacked
from stillcut.kernels.mamba2 import RecurrentMetadata

BLOCK_SIZE = 4
NUM_BLOCKS = 48
NUM_SLOTS = 8  # state rows of the runner
SCATTERED = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
TOLERANCE = 1e-5
# Qwen3.5-MoE's: the softmax-routed kind's expert products split their inputs among threads,
# so their sums' order moves with the thread count, and at this redrawn scale (experts and a
# shared expert in every layer) what follows them moves with it: the kernel's logits with 1
# thread against 3 differ by up to 9.5e-6, against the torch layers by up to 2e-5
MOE_TOLERANCE = 5e-5
BFLOAT16_KV_TOLERANCE = 1e-3  # a key a hair apart may round to the neighbouring bfloat16
NUM_STEPS = 5
CAPTURE = (2, 1, 3)  # at step 2, request 1's state goes to snapshot slot 3

VARIANTS = {  # name: (family, checkpoint overrides, weight format, KV dtype, threads)
    "float32": ("nemotron_h_omni", {}, WeightFormat(), torch.float32, 3),
    "float32, 1 thread": ("nemotron_h_omni", {}, WeightFormat(), torch.float32, 1),
    "bfloat16, bfloat16 KV": (
        "nemotron_h_omni", {}, WeightFormat(torch.bfloat16), torch.bfloat16, 2,
    ),
    "int8": ("nemotron_h_omni", {}, WeightFormat(quantization="int8"), torch.float32, 2),
    "biases, latent experts": (
        "nemotron_h_omni",
        {"mlp_bias": True, "use_bias": True, "moe_latent_size": 24},
        WeightFormat(),
        torch.float32,
        3,
    ),
    "qwen3_5 float32": ("qwen3_5", {}, WeightFormat(), torch.float32, 3),
    "qwen3_5 bfloat16, bfloat16 KV": (
        "qwen3_5", {}, WeightFormat(torch.bfloat16), torch.bfloat16, 2,
    ),
    "qwen3_5 int8": ("qwen3_5", {}, WeightFormat(quantization="int8"), torch.float32, 2),
    "qwen3_5_moe float32": ("qwen3_5_moe", {}, WeightFormat(), torch.float32, 3),
    "qwen3_5_moe bfloat16, bfloat16 KV": (
        "qwen3_5_moe", {}, WeightFormat(torch.bfloat16), torch.bfloat16, 2,
    ),
    "qwen3_5_moe int8": ("qwen3_5_moe", {}, WeightFormat(quantization="int8"), torch.float32, 2),
}  # fmt: skip


@pytest.fixture(scope="module")
def models():
    """Each variant's model and its cache groups, loaded once (variants share checkpoints)."""
    if library.load() is None:
        if os.environ.get("STILLCUT_REQUIRE_NATIVE_DECODE"):
            pytest.fail("the native CPU decode kernel did not build here")
        pytest.skip("no C compiler: the native CPU decode kernel is not built")
    loaded = {}

    def load(name: str):
        family, text, weight_format, _, _ = VARIANTS[name]
        key = repr((family, text, weight_format))
        if key not in loaded:
            path = cached_checkpoint("tiny", seed=1, family=family, text=text)
            config = load_model_config(path)
            model = config.family.language_model_class().from_checkpoint(path, weight_format)
            assert model.cpu_decoder is not None, f"{name}: the kernel declined the model"
            _redraw(model, torch.Generator().manual_seed(3))
            loaded[key] = model, config.cache_groups
        return loaded[key]

    return load


@torch.no_grad()
def _redraw(model, generator: torch.Generator) -> None:
    """Weights of std 0.3 and norms around one, redrawn in place (the kernel keeps their
    addresses): at the checkpoint's init scale a dropped term, such as dt's prompt-only
    floor, would hide below the tolerance. An int8 weight keeps its values and gets scales to
    match; the tables and the recurrent layers' time-step biases and decays stay; the columns
    of `in_proj` that give the decays (Mamba2's dt, the DeltaNet's a) shrink, so that the time
    steps stay spread across `time_step_min` and a DeltaNet's state is not forgotten at once."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        leaf = name.rsplit(".", 1)[-1]
        tables = ("embeddings", "embed_tokens", "lm_head", "dt_bias", "A")
        if leaf in tables or leaf.endswith("_scale"):
            continue
        if param.dtype == torch.int8:
            scale = params[f"{name}_scale"]
            noise = torch.randn(scale.shape, generator=generator)
            scale.copy_(0.3 / param.float().std() * (1 + 0.1 * noise))
            continue
        noise = torch.randn(param.shape, generator=generator)
        param.copy_(1 + 0.2 * noise if "norm" in leaf else 0.3 * noise)
    for name, param in params.items():
        if name.endswith(".in_proj") and name.replace(".in_proj", ".dt_bias") in params:
            _shrink_last_columns(param, params.get(f"{name}_scale"), len(params[
                name.replace(".in_proj", ".dt_bias")
            ]))  # fmt: skip


def _shrink_last_columns(weight, scale, count: int) -> None:
    """The last `count` columns of an `[in, out]` weight (or its int8 scales) times 0.05, in
    place, in the layout it is stored in."""
    if weight.dtype == torch.int8:
        scale[-count:].mul_(0.05)
        return
    shrunk = unpacked(weight)
    shrunk[:, -count:].mul_(0.05)
    weight.copy_(pack_matrix(shrunk) if is_packed(weight) else shrunk)


@dataclass
class Request:
    """A request's prompt, its scattered K/V blocks, its state slot, and its progress."""

    index: int
    prompt_len: int
    slot: int
    computed: int = 0
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [(37 * self.index + 11 * t) % 900 + 5 for t in range(self.prompt_len + 9)]

    @property
    def blocks(self) -> list[int]:
        return SCATTERED[8 * self.index : 8 * self.index + 8]


def _requests() -> list[Request]:
    # request 3's last two prompt tokens come one per step; request 4 joins at step 1, fresh
    return [
        Request(0, 5, 6),
        Request(1, 9, 1),
        Request(2, 3, 4),
        Request(3, 7, 2),
        Request(4, 1, 0),
    ]


def _metadata(scheduled, states, snapshots, captures=None) -> AttentionMetadata:
    """The step of `scheduled` (request, new tokens) pairs, as the runner builds it."""
    starts, prompt, slots = [0], [], []
    for request, count in scheduled:
        starts.append(starts[-1] + count)
        for p in range(request.computed, request.computed + count):
            prompt.append(p < request.prompt_len)
            slots.append(request.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    seq_lens = [r.computed + n for r, n in scheduled]
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([r.blocks for r, _ in scheduled], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(n for _, n in scheduled),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    metadata.recurrent = RecurrentMetadata(
        states=states,
        state_rows_cpu=[r.slot for r, _ in scheduled],
        fresh=[r.computed == 0 for r, _ in scheduled],
        query_start_loc_cpu=starts,
        prompt_token_mask=torch.tensor(prompt),
        snapshots=snapshots,
        captures=captures or [[] for _ in scheduled],
    )
    return metadata


def _ids(scheduled) -> torch.Tensor:
    return torch.tensor([t for r, n in scheduled for t in r.tokens[r.computed : r.computed + n]])


def _run(model, scheduled, caches, captures=None) -> torch.Tensor:
    """One step through `model.forward`; the requests advance. Returns its last rows' logits."""
    kv_caches, states, snapshots = caches
    metadata = _metadata(scheduled, states, snapshots, captures)
    ids = _ids(scheduled)
    positions = torch.tensor([p for r, n in scheduled for p in range(r.computed, r.computed + n)])
    positions = positions.expand(model.num_position_rows, -1)  # text: t = h = w
    with torch.inference_mode():
        hidden = model(ids, positions, kv_caches, metadata)
        logits = model.compute_logits(hidden)
    for request, count in scheduled:
        request.computed += count
    return logits


def _caches(model, groups, kv_dtype: torch.dtype, generator: torch.Generator):
    """K/V caches (one per attention layer, in layer order), and per recurrent layer its state
    rows, full of noise (a fresh request must not read what its slot held), and its snapshot
    slots."""
    kv_shapes = {
        layer: group.layer_cache_shape(NUM_BLOCKS, BLOCK_SIZE)
        for group in attention_groups(groups)
        for layer in group.layer_ids
    }
    kv_caches = [torch.zeros(kv_shapes[layer], dtype=kv_dtype) for layer in sorted(kv_shapes)]
    shapes = {
        layer: group.state_shapes for group in recurrent_groups(groups) for layer in group.layer_ids
    }
    states = {
        layer: tuple(torch.randn(NUM_SLOTS, *shape, generator=generator) for shape in layer_shapes)
        for layer, layer_shapes in shapes.items()
    }
    snapshots = {
        layer: tuple(torch.zeros(4, *shape) for shape in layer_shapes)
        for layer, layer_shapes in shapes.items()
    }
    return kv_caches, states, snapshots


def _copy(caches):
    kv_caches, states, snapshots = caches
    return (
        [cache.clone() for cache in kv_caches],
        {layer: tuple(t.clone() for t in tensors) for layer, tensors in states.items()},
        {layer: tuple(t.clone() for t in tensors) for layer, tensors in snapshots.items()},
    )


def _decode_steps(model, requests, caches, native: bool) -> list[torch.Tensor]:
    """`NUM_STEPS` steps of one token per running request, natively or through the torch
    layers; each step's logits."""
    kept, logits = model.cpu_decoder, []
    model.cpu_decoder = kept if native else None
    try:
        for step in range(NUM_STEPS):
            running = [requests[0], requests[4], requests[1], requests[3], requests[2]]
            scheduled = [(r, 1) for r in running if step >= 1 or r.index != 4]
            captures = [[] for _ in scheduled]
            if step == CAPTURE[0]:
                row = [r.index for r, _ in scheduled].index(CAPTURE[1])
                captures[row] = [(1, CAPTURE[2])]
            if native:
                metadata = _metadata(scheduled, caches[1], caches[2])
                assert kept.supports(_ids(scheduled), caches[0], metadata)
            logits.append(_run(model, scheduled, caches, captures))
    finally:
        model.cpu_decoder = kept
    return logits


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_hybrid_steps_match_the_torch_layers(models, variant):
    model, groups = models(variant)
    _, _, _, kv_dtype, threads = VARIANTS[variant]
    caches = _caches(model, groups, kv_dtype, torch.Generator().manual_seed(7))
    requests = _requests()
    prefill = [(requests[0], 5), (requests[1], 9), (requests[2], 3), (requests[3], 5)]
    _run(model, prefill, caches)  # torch layers: a step of prompt chunks
    native_caches, torch_caches = caches, _copy(caches)
    native_requests, torch_requests = requests, _requests()
    for request, twin in zip(native_requests, torch_requests, strict=True):
        twin.computed = request.computed
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = _decode_steps(model, native_requests, native_caches, native=True)
        theirs = _decode_steps(model, torch_requests, torch_caches, native=False)
    finally:
        torch.set_num_threads(before)
    tolerance = MOE_TOLERANCE if VARIANTS[variant][0] == "qwen3_5_moe" else TOLERANCE
    for step, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(mine, reference, atol=tolerance, rtol=tolerance, msg=str(step))
    assert not torch.allclose(ours[1], ours[2])  # the steps really differ
    # every state row (fresh ones included), and the snapshot and nothing else; float32 sums
    # in another order are apart by their largest terms' rounding, not the smallest result's
    for kept in (1, 2):
        for layer, tensors in native_caches[kept].items():
            for mine, reference in zip(tensors, torch_caches[kept][layer], strict=True):
                scale = tolerance * reference.abs().max()
                torch.testing.assert_close(mine, reference, atol=scale, rtol=tolerance)
                assert kept == 1 or mine[CAPTURE[2]].abs().sum() > 0
    for mine, reference in zip(native_caches[0], torch_caches[0], strict=True):
        if kv_dtype == torch.float32:  # as the states: apart by their largest terms' rounding
            scale = tolerance * max(reference.abs().max(), 1)
            torch.testing.assert_close(mine, reference, atol=scale, rtol=tolerance)
        else:
            torch.testing.assert_close(
                mine.float(), reference.float(), atol=BFLOAT16_KV_TOLERANCE, rtol=2**-7
            )
            assert (mine != reference).float().mean() < 1e-3


def test_the_hybrid_step_needs_its_recurrent_states(models):
    """A step without recurrent metadata, or with states of another dtype or shape, is not
    the native step's: the model then runs its torch layers."""
    model, groups = models("float32")
    decoder = model.cpu_decoder
    generator = torch.Generator().manual_seed(0)
    kv_caches, states, snapshots = _caches(model, groups, torch.float32, generator)
    requests = _requests()
    for request in requests:
        request.computed = request.prompt_len
    scheduled = [(r, 1) for r in requests]
    ids = _ids(scheduled)
    assert decoder.supports(ids, kv_caches, _metadata(scheduled, states, snapshots))
    missing = _metadata(scheduled, states, snapshots)
    missing.recurrent = None
    assert not decoder.supports(ids, kv_caches, missing)
    halves = {layer: tuple(t.half() for t in tensors) for layer, tensors in states.items()}
    assert not decoder.supports(ids, kv_caches, _metadata(scheduled, halves, snapshots))
    short = {layer: (conv[:, :-1], ssm) for layer, (conv, ssm) in states.items()}
    assert not decoder.supports(ids, kv_caches, _metadata(scheduled, short, snapshots))
