"""NemotronH's Mamba2 and MoE blocks equal transformers' modules, at the tensor level.

Greedy tokens of a random model barely depend on a Mamba2 layer's scan (its skip term and the
gated norm dominate) or on a routing detail, so these tests compare the blocks themselves
with weights scaled until the scan dominates: transformers' `NemotronHBlock` run over a whole
prompt (its chunked scan, dt clamped at `time_step_min`) and then token by token through its
cache (the one-step update, no clamp), against our block over the runner's flat batches, with
a prompt split across steps, a second request joining, rows that held another request's
state, and decode steps batched. The MoE block is compared with group-limited routing, the
correction bias, scaling and the latent projections.
"""

import pytest
import torch
from torch import nn

from stillcut.engine.models.nemotron_omni.mamba import Mamba2Block
from stillcut.engine.models.nemotron_omni.moe import MoEBlock
from stillcut.engine.models.nemotron_omni.text_config import NemotronTextConfig
from stillcut.kernels.attention_metadata import AttentionMetadata
from stillcut.kernels.mamba2 import RecurrentMetadata

HIDDEN = 32
TEXT = {
    "vocab_size": 64,
    "hidden_size": HIDDEN,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "ssm_state_size": 8,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
    "time_step_min": 0.05,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 24,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
}
HF_NAMES = {
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "num_experts": "n_routed_experts",
}


def _configs(kind: str, **overrides):
    from transformers import NemotronHConfig

    fields = {**TEXT, **overrides}
    ours = NemotronTextConfig(layer_kinds=(kind, "attention"), **fields)
    hf_fields = {HF_NAMES.get(k, k): v for k, v in fields.items()}
    return ours, NemotronHConfig(layers_block_type=[kind, "attention"], **hf_fields)


def _hf_block(config, seed: int):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    torch.manual_seed(seed)
    block = NemotronHBlock(config, 0).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.3)
        if hasattr(block.mixer, "A_log"):
            mixer = block.mixer
            mixer.A_log.uniform_(-1.0, 1.0)
            mixer.D.uniform_(-0.1, 0.1)  # small skip: the scan dominates the output
            dt = torch.exp(torch.empty(config.mamba_num_heads).uniform_(-5.0, 0.0))
            mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        else:
            block.mixer.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return block


def _metadata(query_lens, rows, fresh, num_prompt, states, **snapshots) -> AttentionMetadata:
    """`snapshots`: `snapshots=` the snapshot tensors and `captures=` per request, if any."""
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    count = len(query_lens)
    prompt_token_mask = torch.zeros(starts[-1], dtype=torch.bool)
    for start, length in zip(starts, num_prompt, strict=False):
        prompt_token_mask[start : start + length] = True
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(query_lens, dtype=torch.int32),
        block_tables=torch.zeros(count, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
        query_start_loc_cpu=starts,
        recurrent=RecurrentMetadata(
            states=states,
            state_rows_cpu=rows,
            fresh=fresh,
            query_start_loc_cpu=starts,
            prompt_token_mask=prompt_token_mask,
            **snapshots,
        ),
    )


def _hf_mamba_outputs(block, config, prompt, decodes):
    """transformers' block: the whole prompt in one pass, then one token at a time."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    with torch.no_grad():
        outputs = [block(prompt[None], cache=cache, use_cache=True)[0]]
        for token in decodes:
            outputs.append(block(token[None, None], cache=cache, use_cache=True)[0])
    return torch.cat(outputs)


def test_mamba2_block_over_split_prompts_and_batched_decodes_equals_transformers():
    ours_config, hf_config = _configs("mamba")
    block = _hf_block(hf_config, seed=0)
    ours = Mamba2Block(block, ours_config, layer_id=0)
    conv_shape = (ours_config.conv_dim, ours_config.conv_kernel - 1)
    ssm_shape = (4, 8, 8)
    # rows 1 and 2 hold garbage from earlier requests: a fresh request must not read them
    states = {0: (torch.randn(3, *conv_shape), torch.randn(3, *ssm_shape))}
    generator = torch.Generator().manual_seed(1)
    prompt_a, prompt_b = (torch.randn(n, HIDDEN, generator=generator) for n in (21, 5))
    decodes = torch.randn(3, 2, HIDDEN, generator=generator)  # step, request a / b

    # step 1: a's first 13 tokens (fresh); step 2: a's last 8 (resumed) and all of b (fresh)
    first = ours(prompt_a[:13], _metadata([13], [2], [True], [13], states), None)
    second = ours(
        torch.cat([prompt_a[13:], prompt_b]),
        _metadata([8, 5], [2, 1], [False, True], [8, 5], states),
        None,
    )
    steps = [
        ours(decodes[i], _metadata([1, 1], [2, 1], [False, False], [0, 0], states), None)
        for i in range(3)
    ]
    ours_a = torch.cat([first, second[:8], *(s[:1] for s in steps)])
    ours_b = torch.cat([second[8:], *(s[1:] for s in steps)])

    expected_a = _hf_mamba_outputs(block, hf_config, prompt_a, decodes[:, 0])
    expected_b = _hf_mamba_outputs(block, hf_config, prompt_b, decodes[:, 1])
    torch.testing.assert_close(ours_a, expected_a, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours_b, expected_b, atol=2e-5, rtol=1e-4)

    # The case is sensitive: clamping the decode steps too (or no step) would show.
    block.mixer.time_step_limit = (0.0, float("inf"))
    unclamped = _hf_mamba_outputs(block, hf_config, prompt_a, decodes[:, 0])
    assert (unclamped[:21] - expected_a[:21]).abs().max() > 1e-2


def test_mamba2_states_saved_mid_chunk_and_after_a_step_restart_to_the_same_outputs():
    ours_config, hf_config = _configs("mamba")
    ours = Mamba2Block(_hf_block(hf_config, seed=0), ours_config, layer_id=0)
    shapes = ((ours_config.conv_dim, ours_config.conv_kernel - 1), (4, 8, 8))
    states = {0: tuple(torch.zeros(2, *shape) for shape in shapes)}
    saved = {"snapshots": {0: tuple(torch.zeros(3, *shape) for shape in shapes)}}
    generator = torch.Generator().manual_seed(1)
    prompt, decode = torch.randn(21, HIDDEN, generator=generator), torch.randn(1, HIDDEN)
    # after tokens 8 (mid-chunk), 15 (2 into a resumed chunk: the conv state still holds
    # inputs from before it) and 22 (a one-token step), into slots 0, 1 and 2
    first = ours(
        prompt[:13], _metadata([13], [0], [True], [13], states, captures=[[(8, 0)]], **saved), None
    )
    second = ours(
        prompt[13:], _metadata([8], [0], [False], [8], states, captures=[[(2, 1)]], **saved), None
    )
    step = ours(
        decode, _metadata([1], [0], [False], [0], states, captures=[[(1, 2)]], **saved), None
    )
    cold = torch.cat([first, second, step])
    for slot, start in ((0, 8), (1, 15), (2, 22)):
        for tensor, snapshot in zip(states[0], saved["snapshots"][0], strict=True):
            tensor[1] = snapshot[slot]
        rest = torch.cat([prompt, decode])[start:]
        if len(rest):
            warm = ours(rest, _metadata([len(rest)], [1], [False], [21 - start], states), None)
            torch.testing.assert_close(warm, cold[start:], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(states[0][1][1], states[0][1][0])  # the same final state
    # the case is sensitive: the same tokens from a zero state differ
    from_zero = ours(prompt[8:], _metadata([13], [1], [True], [13], states), None)
    assert (cold[8:21] - from_zero).abs().max() > 1e-3


@pytest.mark.parametrize("latent", [None, 12])
def test_moe_block_equals_transformers(latent):
    ours_config, hf_config = _configs("moe", moe_latent_size=latent)
    block = _hf_block(hf_config, seed=2)
    ours = MoEBlock(_stored_moe(block), ours_config)
    hidden = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = block(hidden[None])[0]
        _, weights, experts = block.mixer.gate(block.norm(hidden))
    got_experts, got_weights = ours.route(ours_normed(ours, hidden))
    order, got_order = experts.sort(-1), got_experts.sort(-1)
    assert torch.equal(order.values, got_order.values)
    torch.testing.assert_close(
        got_weights.gather(1, got_order.indices), weights.gather(1, order.indices)
    )
    torch.testing.assert_close(ours(hidden, None, None), expected, atol=1e-5, rtol=1e-4)


def _stored_moe(block: nn.Module) -> nn.Module:
    """transformers' in-memory MoE block in the checkpoint's layout: one module per expert."""
    experts = block.mixer.experts
    stored = nn.Module()
    stored.norm, stored.mixer = block.norm, nn.Module()
    for name in ("gate", "shared_experts", "fc1_latent_proj", "fc2_latent_proj"):
        setattr(stored.mixer, name, getattr(block.mixer, name))
    stored.mixer.experts = nn.ModuleList()
    for up, down in zip(experts.up_proj, experts.down_proj, strict=True):
        expert = nn.Module()
        expert.up_proj, expert.down_proj = nn.Module(), nn.Module()
        expert.up_proj.weight, expert.down_proj.weight = up, down
        stored.mixer.experts.append(expert)
    return stored


def ours_normed(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    from stillcut.engine.models.nemotron_omni.blocks import rms_norm

    return rms_norm(hidden, block.norm, block.eps)
