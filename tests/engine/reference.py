"""What the parity tests compare: transformers' greedy tokens (with a Qwen prompt's media as
transformers' inputs), and our logits at every prompt position from one prefill laid out as the
runner lays it out."""

from __future__ import annotations

import torch

from stillcut.kernels.attention_metadata import AttentionMetadata


def hf_greedy(reference, inputs: dict, num_new_tokens: int) -> list[int]:
    """transformers' `generate`: exactly `num_new_tokens` greedy tokens, EOS not stopping it."""
    return hf_greedy_with_margins(reference, inputs, num_new_tokens)[0]


def hf_greedy_with_margins(
    reference, inputs: dict, num_new_tokens: int
) -> tuple[list[int], list[float]]:
    """`hf_greedy`'s tokens and the top-2 logit margin of each step."""
    with torch.inference_mode():
        out = reference.generate(
            **inputs,
            max_new_tokens=num_new_tokens,
            min_new_tokens=num_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, [float(step[0].topk(2).values.diff().abs()) for step in out.logits]


def qwen_hf_inputs(pipeline, prompt, specs, family: str) -> dict:
    """Inputs for transformers' Qwen-VL models: for each of `specs` (the `VideoInput`s and
    `ImageInput`s of `prompt`'s items, EVS off) our patches, equal to its processor's (Qwen3-VL:
    its video processor's, built by hand, of frames at a size it keeps)."""
    image_token_id = pipeline.model_config.image_token_id
    video_token_id = pipeline.model_config.video_token_id
    from stillcut.vision.pipeline import VideoInput

    videos, grids, seconds, images, image_grids = [], [], [], [], []
    for spec in specs:
        is_video = isinstance(spec, VideoInput)
        patches, grid, second = _qwen_patches(pipeline, spec, is_video, family)
        (videos if is_video else images).append(patches)
        (grids if is_video else image_grids).append(grid)
        if is_video:
            seconds.append(second)
    input_ids = torch.tensor([prompt.token_ids])
    # transformers computes M-RoPE positions only when told which tokens are media (1: image,
    # 2: video); without them it places every token as text
    token_types = torch.zeros_like(input_ids)
    token_types[input_ids == image_token_id] = 1
    token_types[input_ids == video_token_id] = 2
    inputs = {"input_ids": input_ids, "mm_token_type_ids": token_types}
    if videos:
        inputs |= {"pixel_values_videos": torch.cat(videos), "video_grid_thw": torch.tensor(grids)}
        if family == "qwen2_5_vl":  # Qwen2-VL counts tubelets, not seconds
            inputs["second_per_grid_ts"] = torch.tensor(seconds)
    if images:
        inputs |= {"pixel_values": torch.cat(images), "image_grid_thw": torch.tensor(image_grids)}
    return inputs


def _qwen_patches(pipeline, spec, is_video: bool, family: str):
    """(patches, grid, seconds per grid step) of one video or image, as `qwen_hf_inputs`."""
    if family.startswith("qwen3_vl"):
        from .models.qwen3_vl.qwen3_reference import hand_pixels

        frames = spec.source if is_video else spec.source[None]
        return (*hand_pixels(frames), None)
    from stillcut.engine.models.qwen2_vl.preprocess import preprocess_image, preprocess_video

    if is_video:
        prepared = preprocess_video(spec.source, spec.frames_fps, pipeline.video_preprocess)
    else:
        prepared = preprocess_image(spec.source, pipeline.image_preprocess)
    return prepared.patches, prepared.grid_thw, prepared.second_per_grid_ts


def prefill_logits(model, prompt) -> torch.Tensor:
    """Our logits [L, vocab] at every prompt position, from one prefill as the runner makes it."""
    ids = torch.tensor(prompt.token_ids)
    num_tokens, block_size = ids.numel(), 16
    num_blocks = -(-num_tokens // block_size)
    positions, _ = model.prompt_positions(ids, prompt.items, prompt.mm_positions)
    ranges = [
        (0, place.offset, place.end)
        for item, place in zip(prompt.items, prompt.mm_positions, strict=True)
        if item.bidirectional
    ]
    mm_mask = torch.zeros(num_tokens, dtype=torch.bool)  # [L]
    for place in prompt.mm_positions:
        mm_mask[place.offset : place.end] = True
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(num_tokens),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        mm_ranges=torch.tensor(ranges, dtype=torch.int32) if ranges else None,
        prefill_dtype=model.prefill_dtype,
    )
    kv_caches = [torch.zeros(model.kv_cache_shape(num_blocks, block_size)) for _ in model.layers]
    embeds = torch.cat([item.embeds for item in prompt.items]) if prompt.items else None
    # the feature sets the model consumes (DeepStack's), row for row with the embeddings
    features = {
        name: torch.cat([item.features[name] for item in prompt.items])
        for name in (model.mm_feature_names if prompt.items else ())
    }
    with torch.inference_mode():
        hidden = model(
            ids,
            positions,
            kv_caches,
            metadata,
            mm_embeds=embeds,
            mm_mask=mm_mask if prompt.items else None,
            mm_features=features or None,
        )
        return model.compute_logits(hidden)
