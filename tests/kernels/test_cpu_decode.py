"""The native CPU decode step against the model's own torch layers, and its fallbacks.

For Qwen2.5-VL, Gemma 3 (with and without a score soft cap), Qwen3-VL (q/k head norms,
interleaved M-RoPE) and Qwen3-VL-MoE (softmax-routed gated experts beside a dense layer; its
experts float32, bfloat16 and int8 per expert and output channel), the tiny checkpoint's norms,
biases and weights are redrawn in place (the kernel keeps their addresses; an int8 weight keeps
its values and gets scales to match), so a dropped bias, a norm read from the wrong layer, a
swapped projection or a wrongly routed expert shows; Qwen's decode positions differ
between the three M-RoPE rows, and Gemma's contexts outgrow its local layers' window of 8.
Requests sit in scattered blocks, with contexts ending inside and exactly at block boundaries.
A model whose weights become other tensors (`.to()`, a swapped layer, new parameters,
`param.data`) or a copy of it decodes with those; and a stack of blocks in no family's order
matches a torch reading of the same description (a plain biased relu² MLP among them), with
its weights float32, bfloat16, float16 or int8 (per-column scales; an int8 embedding scaled per
row) and float32 or bfloat16 KV caches: the kernel widens what is stored exactly as the torch
path does (the hybrid kinds in a model: `test_cpu_decode_hybrid`). Where CI sets
`STILLCUT_REQUIRE_NATIVE_DECODE`, a kernel that does not build fails here instead of skipping.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import pickle

import pytest
import torch
import torch.nn.functional as F

from stillcut.engine.factory import cached_checkpoint
from stillcut.engine.models.gemma3.model import Gemma3LanguageModel
from stillcut.engine.models.matmul import head_layout, vocab_logits
from stillcut.engine.models.qwen2_vl.model import Qwen2LanguageModel
from stillcut.engine.models.qwen3_vl.model import Qwen3LanguageModel
from stillcut.engine.models.qwen3_vl.moe_model import Qwen3MoeLanguageModel
from stillcut.engine.models.rotary import fused_qkv_attention, rotary_tables
from stillcut.engine.models.weights import embedding_rows
from stillcut.engine.quantization import WeightFormat, dense, quantize_int8
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.cpu import decoder as native_decoder
from stillcut.kernels.cpu import library
from stillcut.kernels.cpu.packing import is_quads, pack_quads, unpacked
from stillcut.kernels.cpu.stack import Activation, Attention, Block, GatedMlp, Kind, Mlp, Stack

BLOCK_SIZE = 4
# 17 short requests, then one long one (request 17) whose keys get split across threads
PROMPT_LENS = [1, 3, 4, 7, 8, 13, 16, 2, 5, 9, 11, 12, 15, 6, 10, 14, 3, 301]
BLOCK_COUNTS = [6] * 17 + [80]  # room for each prompt and six decode steps
NUM_BLOCKS = sum(BLOCK_COUNTS)
SCATTERED = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
LONG = 17
TOLERANCE = 1e-5


QWEN3_MOE = {"family": "qwen3_vl_moe", "seed": 1}
FAMILIES = {
    "qwen2_5_vl": (Qwen2LanguageModel, {"family": "qwen2_5_vl"}),
    "gemma3": (Gemma3LanguageModel, {"family": "gemma3"}),
    "gemma3 soft cap": (
        Gemma3LanguageModel,
        {"family": "gemma3", "text": {"attn_logit_softcapping": 2.0}},
    ),
    "qwen3_vl": (Qwen3LanguageModel, {"family": "qwen3_vl", "seed": 1}),
    "qwen3_vl_moe": (Qwen3MoeLanguageModel, QWEN3_MOE),
}
NARROW_EXPERTS = {
    "bfloat16": WeightFormat(torch.bfloat16),
    "int8": WeightFormat(quantization="int8"),
}


def _redrawn(model_class, spec: dict, weight_format: WeightFormat = WeightFormat()):
    """The tiny checkpoint's model with its weights redrawn in place (an int8 one keeps its
    values and gets scales to match)."""
    if library.load() is None:
        if os.environ.get("STILLCUT_REQUIRE_NATIVE_DECODE"):
            pytest.fail("the native CPU decode kernel did not build here")
        pytest.skip("no C compiler: the native CPU decode kernel is not built")
    model = model_class.from_checkpoint(cached_checkpoint("tiny", **spec), weight_format)
    assert model.cpu_decoder is not None
    generator = torch.Generator().manual_seed(3)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if name == "lm_head" or name.endswith("_scale"):
                continue  # the (tied) embedding: random already, and read as it is
            if param.dtype == torch.int8:
                scale = params[f"{name}_scale"]
                noise = torch.randn(scale.shape, generator=generator)
                scale.copy_(0.3 / param.float().std() * (1 + 0.1 * noise))
                continue
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise)  # in place
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return _redrawn(*FAMILIES[request.param])


@pytest.fixture(scope="module", params=list(NARROW_EXPERTS))
def narrow_moe(request):
    """The MoE model with its experts (and every other matrix) stored narrow."""
    return _redrawn(Qwen3MoeLanguageModel, QWEN3_MOE, NARROW_EXPERTS[request.param])


def _blocks(request: int) -> list[int]:
    """Scattered block ids of one request, disjoint from every other request's."""
    start = sum(BLOCK_COUNTS[:request])
    return SCATTERED[start : start + BLOCK_COUNTS[request]]


def _metadata(requests: list[int], cached: list[int], new: list[int]) -> AttentionMetadata:
    starts = [0]
    for count in new:
        starts.append(starts[-1] + count)
    seq_lens = [c + n for c, n in zip(cached, new, strict=True)]
    slots = [
        _blocks(r)[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for r, c, n in zip(requests, cached, new, strict=True)
        for p in range(c, c + n)
    ]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(
            [_blocks(r) + [0] * (max(BLOCK_COUNTS) - len(_blocks(r))) for r in requests],
            dtype=torch.int32,
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def _positions(model, starts: list[int], spread: bool = False) -> torch.Tensor:
    """Positions [rows, N]: 1-D, or M-RoPE's t = h = w, or (`spread`) M-RoPE's three rows
    apart, so that a frequency read from the wrong row shows."""
    rows = model.num_position_rows
    positions = torch.tensor(starts).expand(rows, -1)
    return positions + torch.tensor([[0], [5], [11]]) if spread and rows == 3 else positions


@torch.inference_mode()
def _prefilled(model, requests: list[int]) -> list[torch.Tensor]:
    """KV caches holding each request's prompt, prefilled by the torch layers."""
    kv_caches = [torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)) for _ in model.layers]
    lens = [PROMPT_LENS[r] for r in requests]
    ids = torch.cat([torch.arange(n) * 7 % 300 + r for r, n in zip(requests, lens, strict=True)])
    positions = torch.cat([_positions(model, list(range(n))) for n in lens], dim=1)
    model(ids, positions, kv_caches, _metadata(requests, [0] * len(lens), lens))
    return kv_caches


@torch.inference_mode()
def _decode(model, requests, kv_caches, steps: int, native: bool) -> list[torch.Tensor]:
    """`steps` decode steps of every request: the final hidden states of each step."""
    kept, outputs = model.cpu_decoder, []
    model.cpu_decoder = kept if native else None
    try:
        for step in range(steps):
            cached = [PROMPT_LENS[r] + step for r in requests]
            metadata = _metadata(requests, cached, [1] * len(requests))
            if native:
                assert kept.supports(torch.zeros(len(requests), 1), kv_caches, metadata)
            ids = torch.tensor([(41 * r + step) % 300 for r in requests])
            outputs.append(model(ids, _positions(model, cached, spread=True), kv_caches, metadata))
    finally:
        model.cpu_decoder = kept
    return outputs


@pytest.mark.parametrize(
    "requests", [[0], [0, 1], list(range(5)), list(range(16)), [LONG], [LONG, 3]], ids=str
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_decode_matches_the_torch_layers(model, requests, threads):
    """Six decode steps; with one or two requests and three threads a request's keys are
    split between threads (the long one's in slices that do not end at block boundaries)."""
    _assert_native_matches_torch(model, requests, threads)


@pytest.mark.parametrize("requests", [[0], list(range(5)), list(range(16))], ids=str)
def test_narrow_experts_decode_natively_as_the_torch_layers(narrow_moe, requests):
    moe = next(layer.moe for layer in narrow_moe.layers if layer.moe is not None)
    assert moe.experts_gate_up.dtype in (torch.bfloat16, torch.int8)
    _assert_native_matches_torch(narrow_moe, requests, threads=2)


def _assert_native_matches_torch(model, requests: list[int], threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native_caches = _prefilled(model, requests)
        torch_caches = [cache.clone() for cache in native_caches]
        native = _decode(model, requests, native_caches, steps=6, native=True)
        reference = _decode(model, requests, torch_caches, steps=6, native=False)
    finally:
        torch.set_num_threads(before)
    for ours, theirs in zip(native, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
    # the new tokens' keys and values went to the same slots, and nothing else was written
    for ours, theirs in zip(native_caches, torch_caches, strict=True):
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
    assert not torch.equal(native[0], native[1])  # the steps really differ


def test_a_native_step_makes_the_logits_of_its_rows(model):
    """The native step computes its rows' logits in the same call; `compute_logits` of the very
    hidden states it returned gives them (once), of any other tensor the head's product."""
    requests = [0, 1, 2]
    kv_caches = _prefilled(model, requests)
    cached = [PROMPT_LENS[r] for r in requests]
    metadata = _metadata(requests, cached, [1] * 3)
    with torch.inference_mode():
        hidden = model(torch.tensor([5, 6, 7]), _positions(model, cached), kv_caches, metadata)
        made = model.step_logits
        assert made is not None and made[0] is hidden
        logits = model.compute_logits(hidden)
        assert model.step_logits is None  # taken
        expected = vocab_logits(hidden, model.head_matrices)
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap is not None:
            expected = torch.tanh(expected / cap) * cap
        torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(model.compute_logits(hidden[:2]), expected[:2])


def test_native_decode_takes_only_small_decode_steps(model):
    decoder = model.cpu_decoder
    kv_caches = [torch.zeros(model.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)) for _ in model.layers]
    rows = torch.zeros(16, 1)
    assert decoder.supports(rows, kv_caches, _metadata(list(range(16)), [3] * 16, [1] * 16))
    too_many = _metadata(list(range(17)), [3] * 17, [1] * 17)
    assert not decoder.supports(torch.zeros(17, 1), kv_caches, too_many)
    mixed = _metadata([0, 1], [3, 0], [1, 4])  # a decode beside a prefill chunk
    assert not decoder.supports(torch.zeros(5, 1), kv_caches, mixed)
    half = [cache.half() for cache in kv_caches]
    assert not decoder.supports(rows, half, _metadata(list(range(16)), [3] * 16, [1] * 16))


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """`library.load` with its memo cleared and an empty cache folder; cleared again after."""
    monkeypatch.setenv("STILLCUT_CACHE", str(tmp_path))
    library.load.cache_clear()
    yield tmp_path
    library.load.cache_clear()


def test_without_a_compiler_the_torch_layers_run(fresh_load, monkeypatch, tiny_checkpoint):
    """A model loaded where nothing compiles decodes through its torch layers, and gives the
    tokens (and, within the kernel's tolerance, the logits) of one that has the native step."""
    monkeypatch.setenv("CC", str(fresh_load / "no-such-compiler"))
    assert library.load() is None
    fallback = Qwen2LanguageModel.from_checkpoint(tiny_checkpoint)
    assert fallback.cpu_decoder is None
    monkeypatch.undo()  # the real compiler and the session's cache, where the kernel is built
    library.load.cache_clear()
    native = Qwen2LanguageModel.from_checkpoint(tiny_checkpoint)
    if native.cpu_decoder is None:
        if os.environ.get("STILLCUT_REQUIRE_NATIVE_DECODE"):
            pytest.fail("the native CPU decode kernel did not build here")
        pytest.skip("no C compiler: nothing to compare the fallback with")
    requests = list(range(5))
    logits = []
    for model, is_native in ((fallback, False), (native, True)):
        steps = _decode(model, requests, _prefilled(model, requests), steps=3, native=is_native)
        with torch.inference_mode():
            logits.append(torch.stack([model.compute_logits(hidden) for hidden in steps]))
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))  # [steps, requests]
    torch.testing.assert_close(logits[0], logits[1], atol=TOLERANCE, rtol=TOLERANCE)


def test_a_failed_compile_leaves_nothing_behind(fresh_load, monkeypatch):
    compiler = fresh_load / "broken-cc"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\necho broken >&2; exit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    assert library.load() is None
    assert not any((fresh_load / "native").iterdir())  # no partial library left


def test_it_can_be_switched_off(fresh_load, monkeypatch):
    monkeypatch.setenv("STILLCUT_NATIVE_DECODE", "0")
    assert library.load() is None
    assert not (fresh_load / "native").exists()


def test_the_library_is_built_once_into_the_cache(fresh_load):
    if library.load() is None:
        pytest.skip("no C compiler")
    (built,) = (fresh_load / "native").iterdir()
    assert built.suffix == ".so"
    library.load.cache_clear()
    modified = built.stat().st_mtime_ns
    assert library.load() is not None
    assert built.stat().st_mtime_ns == modified  # found, not compiled again


def test_a_copied_model_makes_its_own_decoder(model):
    """The kernel holds the weights' addresses: a deep copy must not read the original's; it
    makes its own decoder on its first step."""
    copied = copy.deepcopy(model)
    assert copied.cpu_decoder is None and model.cpu_decoder is not None
    with torch.no_grad():
        for param in copied.parameters():
            param.mul_(0.5)
    requests = [0, 1, 2]
    native_caches = _prefilled(copied, requests)  # its first step: the copy's own decoder
    assert copied.cpu_decoder is not None and copied.cpu_decoder is not model.cpu_decoder
    torch_caches = [cache.clone() for cache in native_caches]
    (ours,) = _decode(copied, requests, native_caches, steps=1, native=True)
    (theirs,) = _decode(copied, requests, torch_caches, steps=1, native=False)
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
    (original,) = _decode(model, requests, _prefilled(model, requests), steps=1, native=True)
    assert not torch.allclose(ours, original, atol=1e-3)
    assert pickle.loads(pickle.dumps(model)).cpu_decoder is None


def _swap_first_layer(model) -> None:
    model.layers[0] = copy.deepcopy(model.layers[1])


def _replace_parameters(model) -> None:
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().clone(), requires_grad=False))


def _repoint_data(model) -> None:
    for param in model.parameters():
        param.data = param.data.clone()


CHANGES = {  # name: (change, whether the decoder must be made again)
    "in place": (lambda model: None, False),
    "dtype round trip": (lambda model: model.to(torch.float64).to(torch.float32), True),
    "swapped layer": (_swap_first_layer, True),
    "new parameters": (_replace_parameters, True),
    "param.data": (_repoint_data, True),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_native_step_reads_the_weights_the_model_holds_now(model, change):
    """After each change the weights are halved in place: a decoder still reading the tensors
    it was made from (or their freed memory) differs from the torch layers."""
    changed = copy.deepcopy(model)
    requests = [0, 1, 2]
    _prefilled(changed, requests)
    decoder = changed.cpu_decoder
    apply, rebuilds = CHANGES[change]
    apply(changed)
    gc.collect()
    with torch.no_grad():
        for param in changed.parameters():
            param.mul_(0.5)
    native_caches = _prefilled(changed, requests)
    assert (changed.cpu_decoder is not decoder) == rebuilds
    torch_caches = [cache.clone() for cache in native_caches]
    native = _decode(changed, requests, native_caches, steps=2, native=True)
    reference = _decode(changed, requests, torch_caches, steps=2, native=False)
    for ours, theirs in zip(native, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)


def test_weights_the_kernel_cannot_read_fall_back_to_the_torch_layers(model):
    changed = copy.deepcopy(model).to(torch.float64)
    requests = [0, 1]
    metadata = _metadata(requests, [3, 3], [1, 1])
    kv_caches = [torch.zeros(changed.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE)) for _ in model.layers]
    ids, positions = torch.tensor([5, 6]), _positions(changed, [3, 3])
    assert changed.native_decode(ids, positions, kv_caches, metadata, None) is None
    assert changed.cpu_decoder is None


HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, EPS = 64, 4, 2, 16, 96, 300, 1e-6


def _weight(generator, num_in: int, num_out: int, out_in: bool) -> torch.Tensor:
    """A random `[in, out]` weight, stored as a contiguous `[out, in]` when `out_in`."""
    if out_in:
        return (0.2 * torch.randn(num_out, num_in, generator=generator)).T
    return 0.2 * torch.randn(num_in, num_out, generator=generator)


def _mixed_stack() -> Stack:
    """Blocks in no family's order, each kind with and without its options, both layouts."""
    generator = torch.Generator().manual_seed(11)

    def norm(*shape):
        return 1 + 0.2 * torch.randn(*shape, generator=generator)

    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM

    def attention(cache, out_in, **options):
        return Attention(
            _weight(generator, HIDDEN, qkv_width, out_in),
            _weight(generator, HEADS * HEAD_DIM, HIDDEN, not out_in),
            HEADS,
            KV_HEADS,
            cache=cache,
            scale=HEAD_DIM**-0.5,
            **options,
        )

    def mlp(activation, out_in):
        return GatedMlp(
            _weight(generator, HIDDEN, 2 * INTERMEDIATE, out_in),
            _weight(generator, INTERMEDIATE, HIDDEN, not out_in),
            activation,
        )

    blocks = [
        Block(norm(HIDDEN), attention(0, False, qkv_bias=0.2 * torch.randn(qkv_width))),
        Block(norm(HIDDEN), mlp(Activation.GELU_TANH, False), out_norm=norm(HIDDEN)),
        Block(norm(HIDDEN), mlp(Activation.SILU, True)),
        Block(
            norm(HIDDEN),
            attention(
                2, True, qk_norm=norm(HEADS + KV_HEADS, HEAD_DIM), window=5, table=1, soft_cap=3.0
            ),
            out_norm=norm(HIDDEN),
        ),  # fmt: skip
        Block(norm(HIDDEN), attention(1, False)),
        Block(norm(HIDDEN), mlp(Activation.SILU, False), out_norm=norm(HIDDEN)),
        Block(
            norm(HIDDEN),
            Mlp(
                _weight(generator, HIDDEN, INTERMEDIATE, False),
                _weight(generator, INTERMEDIATE, HIDDEN, True),
                Activation.RELU2,
                up_bias=0.2 * torch.randn(INTERMEDIATE, generator=generator),
                down_bias=0.2 * torch.randn(HIDDEN, generator=generator),
            ),
            out_norm=norm(HIDDEN),
        ),  # a plain MLP (a hybrid's), biased, its down projection [out, in] in float32
    ]
    exponent = torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM
    return Stack(
        blocks,
        embedding=torch.randn(VOCAB, HIDDEN, generator=generator),
        final_norm=norm(HIDDEN),
        inv_freqs=[1.0 / 10000.0**exponent, 1.0 / 1e6**exponent],
        section=torch.tensor([0, 0, 1, 1, 1, 2, 2, 2]),  # M-RoPE rows of the 8 frequencies
        eps=EPS,
        embedding_scale=1.5,
    )


def _torch_reading(stack: Stack, ids, positions, kv_caches, metadata) -> torch.Tensor:
    """What the stack means, in torch ops: [N] ids -> final-normed hidden [N, hidden]."""
    table, scales = stack.embedding, stack.embedding_scales
    hidden = embedding_rows(ids, table, scales, torch.float32) * stack.embedding_scale
    angles = positions[stack.section].T.float()  # [N, D/2]
    tables = [rotary_tables(angles * inv_freq, torch.float32) for inv_freq in stack.inv_freqs]
    for block in stack.blocks:
        x, mixer = F.rms_norm(hidden, (HIDDEN,), block.norm, EPS), block.mixer
        if isinstance(mixer, Attention):
            qkv = x @ mixer.qkv_weight
            qkv = qkv if mixer.qkv_bias is None else qkv + mixer.qkv_bias
            qk_norm = mixer.qk_norm
            attended = fused_qkv_attention(
                qkv,
                HEADS,
                KV_HEADS,
                *tables[mixer.table],
                kv_caches[mixer.cache],
                metadata,
                qk_transform=None
                if qk_norm is None
                else lambda qk, scale=qk_norm: F.rms_norm(qk, (HEAD_DIM,), eps=EPS) * scale,
                scale=mixer.scale,
                sliding_window=mixer.window or None,
                logits_soft_cap=mixer.soft_cap or None,
            )
            out = attended @ mixer.o_weight
        elif isinstance(mixer, Mlp):
            hidden_mlp = (x @ mixer.up_weight + mixer.up_bias).relu().square()
            out = hidden_mlp @ mixer.down_weight + mixer.down_bias
        else:
            gate, up = (x @ mixer.gate_up_weight).chunk(2, dim=-1)
            tanh = mixer.activation == Activation.GELU_TANH
            activated = F.gelu(gate, approximate="tanh") if tanh else F.silu(gate)
            out = (activated * up) @ mixer.down_weight
        if block.out_norm is not None:
            out = F.rms_norm(out, (HIDDEN,), block.out_norm, EPS)
        hidden = hidden + out
    return F.rms_norm(hidden, (HIDDEN,), stack.final_norm, EPS)


def _in_format(stack: Stack, dtype: torch.dtype, quads: bool = False) -> tuple[Stack, Stack]:
    """`stack` with its weights stored as `dtype` (int8: quantized per output channel, narrow
    formats as contiguous `[in, out]`; with `quads`, int8 projections as quad panels), and the
    same stack with those weights widened back to float32: what the stored one means."""
    if dtype == torch.float32:
        return stack, stack

    def store(weight: torch.Tensor, axis: int):
        if dtype == torch.int8:
            quantized, scale = quantize_int8(weight, axis)
            if quads and axis == 1:
                return pack_quads(quantized), scale
            return quantized.contiguous(), scale
        return weight.to(dtype).contiguous(), None

    stored, widened = [], []
    for block in stack.blocks:
        mixer, narrow, wide = block.mixer, {}, {}
        for name in ("qkv", "o", "gate_up", "up", "down"):
            if hasattr(mixer, f"{name}_weight"):
                weight, scale = store(getattr(mixer, f"{name}_weight"), 1)
                narrow[f"{name}_weight"], narrow[f"{name}_scale"] = weight, scale
                wide[f"{name}_weight"] = dense(unpacked(weight), scale, 1, torch.float32)
        stored.append(dataclasses.replace(block, mixer=dataclasses.replace(mixer, **narrow)))
        widened.append(dataclasses.replace(block, mixer=dataclasses.replace(mixer, **wide)))
    table, scales = store(stack.embedding, 0)
    return (
        dataclasses.replace(stack, blocks=stored, embedding=table, embedding_scales=scales),
        dataclasses.replace(
            stack, blocks=widened, embedding=dense(table, scales, 0, torch.float32)
        ),
    )


def _mlps_only(stack: Stack) -> Stack:
    return dataclasses.replace(
        stack, blocks=[b for b in stack.blocks if isinstance(b.mixer, GatedMlp | Mlp)]
    )


STORED = {  # name: (blocks, weight format, KV cache dtype, threads)
    "mixed, 1 thread": ("mixed", torch.float32, torch.float32, 1),
    "mixed, 3 threads": ("mixed", torch.float32, torch.float32, 3),
    "MLPs only": ("MLPs only", torch.float32, torch.float32, 3),
    "bfloat16 weights": ("mixed", torch.bfloat16, torch.float32, 3),
    "float16 weights, bfloat16 KV": ("mixed", torch.float16, torch.bfloat16, 2),
    "int8 weights": ("mixed", torch.int8, torch.float32, 3),
    "int8 weights, bfloat16 KV": ("mixed", torch.int8, torch.bfloat16, 1),
    "int8 quad panels": ("mixed", "quads", torch.float32, 3),
    "int8 quad panels, 1 thread": ("mixed", "quads", torch.float32, 1),
}


@pytest.mark.parametrize("case", list(STORED))
def test_a_stack_of_any_blocks_matches_its_torch_reading(case):
    """The kernel follows the description block by block, whatever the order of the kinds,
    their options and activations, the caches they use (none without attention), and the
    formats its weights and caches are stored in."""
    if library.load() is None:
        pytest.skip("no C compiler: the native CPU decode kernel is not built")
    blocks, weight_dtype, kv_dtype, threads = STORED[case]
    stack = _mixed_stack() if blocks == "mixed" else _mlps_only(_mixed_stack())
    quads = weight_dtype == "quads"
    stack, meaning = _in_format(stack, torch.int8 if quads else weight_dtype, quads)
    if quads:
        assert all(
            is_quads(b.mixer.o_weight) for b in stack.blocks if b.mixer.kind == Kind.ATTENTION
        )
    tolerance = TOLERANCE if kv_dtype == torch.float32 else BFLOAT16_KV_TOLERANCE
    # the LM head, stored as the loader stores it: a float32 vocabulary of 300 row-major, one
    # of whole panels as panels (int8 on a CPU with VNNI: quad panels)
    head_vocab = VOCAB if weight_dtype == torch.float32 and blocks == "mixed" else 320
    head = torch.randn(head_vocab, HIDDEN, generator=torch.Generator().manual_seed(4))
    if weight_dtype in (torch.int8, "quads"):
        head, head_scales = quantize_int8(head, 0)
        head_meaning = dense(head, head_scales, 0, torch.float32)
    else:
        head = head.to(weight_dtype)
        head_scales, head_meaning = None, head.float()
    stack = dataclasses.replace(stack, head=head_layout(head), head_scales=head_scales)
    decoder = native_decoder.bind(stack)
    assert decoder is not None and decoder.vocab == head_vocab
    requests = [0, 1, LONG]
    lens = [PROMPT_LENS[r] for r in requests]
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    native_caches = [torch.zeros(shape, dtype=kv_dtype) for _ in range(3)]
    ids = torch.cat([torch.arange(n) * 7 % VOCAB for n in lens])
    positions = torch.cat([torch.arange(n).expand(3, -1) for n in lens], dim=1)
    with torch.inference_mode():
        _torch_reading(meaning, ids, positions, native_caches, _metadata(requests, [0] * 3, lens))
    torch_caches = [cache.clone() for cache in native_caches]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(3):
            cached = [n + step for n in lens]
            metadata = _metadata(requests, cached, [1] * 3)
            ids = torch.tensor([(13 * r + step) % VOCAB for r in requests])
            positions = torch.tensor(cached) + torch.tensor([[0], [5], [11]])
            assert decoder.supports(ids, native_caches, metadata)
            with torch.inference_mode():
                ours, logits = decoder.decode(ids, positions, native_caches, metadata, True)
                theirs = _torch_reading(meaning, ids, positions, torch_caches, metadata)
            torch.testing.assert_close(ours, theirs, atol=tolerance, rtol=tolerance)
            # the step's logits: its hidden states through the head, in the same call
            torch.testing.assert_close(logits, ours @ head_meaning.T, atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(before)
    for ours, theirs in zip(native_caches, torch_caches, strict=True):
        if kv_dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=TOLERANCE)
        else:  # rounded to nearest even as torch rounds: a key a hair apart may round apart,
            # and one near zero is a hair apart in absolute terms (fp32 sums in another order)
            torch.testing.assert_close(ours.float(), theirs.float(), atol=TOLERANCE, rtol=2**-7)
            assert (ours != theirs).float().mean() < 1e-3


# A key or value that differs by float32 rounding may round to the neighbouring bfloat16.
BFLOAT16_KV_TOLERANCE = 1e-3


def test_a_stack_that_does_not_fit_together_is_refused_with_its_reason():
    stack = _mixed_stack()
    attention = stack.blocks[0].mixer
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dataclasses.replace(attention, num_kv_heads=3)
    with pytest.raises(ValueError, match="qkv_bias has shape"):
        dataclasses.replace(attention, qkv_bias=torch.zeros(5))
    with pytest.raises(ValueError, match="gate_up_weight has shape"):
        GatedMlp(torch.zeros(HIDDEN, 10), torch.zeros(INTERMEDIATE, HIDDEN), Activation.SILU)
    with pytest.raises(ValueError, match="is not a valid Activation"):
        dataclasses.replace(stack.blocks[1].mixer, activation=7)
    with pytest.raises(ValueError, match="rotary table 2 of 2"):
        blocks = [Block(stack.blocks[0].norm, dataclasses.replace(attention, table=2))]
        dataclasses.replace(stack, blocks=blocks)
    with pytest.raises(ValueError, match="KV cache 0 is used by two attention blocks"):
        native_decoder.CpuDecoder(library.load(), dataclasses.replace(
            stack, blocks=[stack.blocks[0], stack.blocks[0]]))  # fmt: skip
