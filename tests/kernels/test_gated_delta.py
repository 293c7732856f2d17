"""The gated delta rule (`kernels.gated_delta`) against transformers' own torch forms of it,
and its Triton kernel (`kernels.gated_delta_triton`, under the interpreter on CPU) against it.

transformers' `torch_chunk_gated_delta_rule` (Qwen3.5's prompt form) and
`torch_recurrent_gated_delta_rule` (its decode form), L2-normalising q and k inside, take the
same random inputs in float32 as ours: chunk sizes that divide the sequence and that do not,
from zeros and from a stored state, with more value heads than key heads. Outputs and states
agree within 1e-5. The Triton kernel takes small tiles (16-wide heads, chunks of 16): the
interpreter is slow.
"""

import pytest
import torch

from stillcut.kernels.gated_delta import (
    chunked_gated_delta,
    gated_delta_step,
    gated_delta_with_states,
    normalized_qk,
)

ATOL = RTOL = 1e-5
NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM = 2, 4, 16, 8


def _inputs(length: int, seed: int, with_state: bool):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    query, key = draw(length, NUM_K_HEADS, K_DIM), draw(length, NUM_K_HEADS, K_DIM)
    value = draw(length, NUM_V_HEADS, V_DIM)
    g = -torch.rand(length, NUM_V_HEADS, generator=generator) * 2  # log decays <= 0
    beta = torch.rand(length, NUM_V_HEADS, generator=generator)
    state = draw(NUM_V_HEADS, K_DIM, V_DIM) if with_state else None
    return query, key, value, g, beta, state


def _transformers(form: str, query, key, value, g, beta, state, **options):
    """transformers' rule on one sequence: y `[L, H, Dv]` and the final state."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    rule = getattr(qwen3_5, f"torch_{form}_gated_delta_rule")
    y, final = rule(
        *(x[None] for x in (query, key, value)),
        g=g[None],
        beta=beta[None],
        initial_state=None if state is None else state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **options,
    )
    return y[0], final[0]


@pytest.mark.parametrize(
    ("length", "chunk_size", "with_state"),
    [(64, 16, False), (64, 64, True), (50, 16, True), (37, 64, False), (5, 8, True)],
)
def test_the_chunked_rule_equals_transformers_chunked_and_recurrent_forms(
    length, chunk_size, with_state
):
    query, key, value, g, beta, state = _inputs(length, seed=length, with_state=with_state)
    q, k = normalized_qk(query, key, NUM_V_HEADS)
    ours = chunked_gated_delta(q, k, value, g, beta, chunk_size, state)
    chunked = _transformers("chunk", query, key, value, g, beta, state, chunk_size=chunk_size)
    recurrent = _transformers("recurrent", query, key, value, g, beta, state)
    for expected in (chunked, recurrent):
        torch.testing.assert_close(ours[0], expected[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(ours[1], expected[1], atol=ATOL, rtol=RTOL)


def test_one_token_steps_equal_transformers_recurrent_form():
    query, key, value, g, beta, state = _inputs(12, seed=7, with_state=True)
    q, k = normalized_qk(query, key, NUM_V_HEADS)
    expected_y, expected_state = _transformers("recurrent", query, key, value, g, beta, state)
    current, ys = state[None], []
    for t in range(12):
        y, current = gated_delta_step(current, q[t, None], k[t, None], value[t, None], g[t, None],
                                      beta[t, None])  # fmt: skip
        ys.append(y[0])
    torch.testing.assert_close(torch.stack(ys), expected_y, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(current[0], expected_state, atol=ATOL, rtol=RTOL)


def test_a_sequence_split_where_states_are_saved_resumes_from_each_of_them():
    query, key, value, g, beta, _ = _inputs(70, seed=3, with_state=False)
    q, k = normalized_qk(query, key, NUM_V_HEADS)
    whole_y, whole_state = chunked_gated_delta(q, k, value, g, beta, 64, None)
    y, states = gated_delta_with_states(q, k, value, g, beta, 64, None, [16, 48, 70])
    assert len(states) == 4
    torch.testing.assert_close(y, whole_y, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(states[-1], whole_state, atol=ATOL, rtol=RTOL)
    after = slice(16, 70)  # resumed from the state saved after 16 tokens
    rest = chunked_gated_delta(q[after], k[after], value[after], g[after], beta[after], 64,
                               states[0])  # fmt: skip
    torch.testing.assert_close(rest[0], whole_y[after], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(rest[1], whole_state, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("length", "with_state"), [(37, True), (32, False)])
def test_the_triton_kernel_equals_the_torch_rule(length, with_state):
    from stillcut.kernels.gated_delta_triton import chunked_gated_delta_triton

    generator = torch.Generator().manual_seed(length)
    num_heads, k_dim, v_dim = 2, 16, 32
    query, key = (torch.randn(length, 1, k_dim, generator=generator) for _ in range(2))
    q, k = normalized_qk(query, key, num_heads)
    value = torch.randn(length, num_heads, v_dim, generator=generator)
    g = -torch.rand(length, num_heads, generator=generator) * 2
    beta = torch.rand(length, num_heads, generator=generator)
    state = torch.randn(num_heads, k_dim, v_dim, generator=generator) if with_state else None
    ours = chunked_gated_delta_triton(q, k, value, g, beta, 16, state)
    expected = chunked_gated_delta(q, k, value, g, beta, 16, state)
    torch.testing.assert_close(ours[0], expected[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours[1], expected[1], atol=ATOL, rtol=RTOL)
