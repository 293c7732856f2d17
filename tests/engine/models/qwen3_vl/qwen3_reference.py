"""What the Qwen3-VL tests feed transformers: pixels as its video processor builds them, and a
greedy loop over its language model for prompts whose video EVS pruned (which
`get_rope_index` cannot place)."""

import numpy as np
import torch


def random_frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    """`count` random RGB frames [T, H, W, 3] uint8."""
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), np.uint8)


def hand_pixels(frames: np.ndarray, patch: int = 16, merge: int = 2, temporal: int = 2):
    """transformers' Qwen3-VL video processor on frames at their target size: rescale and
    normalise (mean = std = 0.5), pad to whole tubelets with the last frame, patchify. Returns
    the patches [t*h*w, 3*2*16*16] and the patch grid (t, h, w)."""
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).float()  # [T, C, H, W]
    video = (video * (1 / 255) - 0.5) / 0.5
    if pad := -video.shape[0] % temporal:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    num_frames, channels, height, width = video.shape
    grid = (num_frames // temporal, height // patch, width // patch)
    patches = video.view(
        grid[0], temporal, channels, grid[1] // merge, merge, patch, grid[2] // merge, merge, patch
    )
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid[0] * grid[1] * grid[2], -1), grid


def pruned_greedy(
    model, dense_ids, mm_types, video_grid, kept, embeds, deepstack, max_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (and the first one's logits) of transformers' Qwen3-VL language model on a
    prompt whose video tokens EVS pruned.

    `dense_ids` [L] is the unpruned prompt, `mm_types` [L] its modality types; `kept` (bool
    [L]) marks the tokens the pruned prompt keeps (all text, the kept video tokens), whose
    video rows take `embeds` and the DeepStack sets `deepstack` (one [kept, hidden] each).
    Positions are `get_rope_index`'s of the unpruned prompt, selected; generated tokens count on
    from the unpruned prompt's next position, as transformers' `rope_deltas` place them.
    """
    from transformers import DynamicCache

    language_model = model.model.language_model
    ids = torch.as_tensor(dense_ids)[None]
    dense_positions, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=torch.as_tensor(mm_types)[None], video_grid_thw=video_grid
    )  # [3, 1, L]
    positions = dense_positions[:, :, kept]
    next_position = int(dense_positions.max()) + 1
    visual = (torch.as_tensor(mm_types)[kept] != 0)[None]  # [1, kept L]
    cache = DynamicCache(config=language_model.config)
    tokens, first_logits = [], None
    with torch.inference_mode():
        inputs = language_model.embed_tokens(ids[:, kept])
        inputs[visual] = embeds
        out = language_model(
            inputs_embeds=inputs,
            position_ids=positions,
            visual_pos_masks=visual,
            deepstack_visual_embeds=deepstack,
            cache=cache,
            use_cache=True,
        )
        for step in range(max_tokens):
            logits = model.lm_head(out.last_hidden_state[0, -1])
            first_logits = logits if first_logits is None else first_logits
            tokens.append(int(logits.argmax()))
            if step + 1 == max_tokens:
                break
            position = torch.full((3, 1, 1), next_position + step)
            out = language_model(
                inputs_embeds=language_model.embed_tokens(torch.tensor([[tokens[-1]]])),
                position_ids=position,
                cache=cache,
                use_cache=True,
            )
    return tokens, first_logits


def engine_answer(engine, prompt, max_tokens: int = 8):
    """The engine's greedy output for `prompt` and the logits it sampled the first token from."""
    from stillcut.engine.request import SamplingParams

    seen = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: seen.append(compute(hidden)) or seen[-1]
    try:
        (output,) = engine.generate(
            [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
    finally:
        del engine.model.compute_logits
    return output, seen[0][-1]
