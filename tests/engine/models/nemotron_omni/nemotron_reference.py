"""transformers' side of the Nemotron 3 Nano Omni tests: its tokenizer and chat template, its
video processor and its processor's prompt text, its model's `generate`.

transformers' processor class needs its image processor, which imports torchvision (not
installed here), so the processor's own `replace_video_token` writes the tubelet labels from
the video processor's output, and images are written as its `replace_image_token` writes them.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

from stillcut.vision.decode import DecodeConfig, decode_video


class NemotronReference:
    """transformers' model, tokenizer and video processor of one checkpoint."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer, NemotronH_Omni_Reasoning_V3
        from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
            NemotronH_Omni_Reasoning_V3VideoProcessor as VideoProcessor,
        )

        self.model = NemotronH_Omni_Reasoning_V3.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.video_processor = VideoProcessor.from_pretrained(path)

    def video(self, clip: Path, decode_config: DecodeConfig) -> dict[str, Any]:
        """Media inputs of a clip decoded as stillcut decodes it (the frames and their source
        indices): transformers' video processor output and its prompt text."""
        from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import (
            NemotronH_Omni_Reasoning_V3Processor as Processor,
        )
        from transformers.video_utils import VideoMetadata

        decoded = decode_video(clip, decode_config)
        metadata = VideoMetadata(
            total_num_frames=len(decoded.frames),
            fps=decoded.source_fps,
            frames_indices=decoded.source_indices,
        )
        frames = torch.from_numpy(decoded.frames).permute(0, 3, 1, 2)
        inputs = self.video_processor(
            videos=[frames],
            video_metadata=[metadata],
            return_metadata=True,
            do_convert_rgb=False,
            do_sample_frames=False,
            return_tensors="pt",
        )
        writer = types.SimpleNamespace(
            image_start_token="<img>",
            image_token="<image>",
            image_end_token="</img>",
            video_processor=self.video_processor,
            video_temporal_patch_dim=2,
        )
        replacement = Processor.replace_video_token(writer, inputs, 0)
        return {"text": ("<video>", replacement), "pixel_values_videos": inputs.pixel_values_videos}

    def image(self, pixel_values: torch.Tensor, grid: tuple[int, int]) -> dict[str, Any]:
        """Media inputs of one image already preprocessed to `pixel_values` [1, 3, H, W]."""
        from stillcut.engine.models.gemma3.tower import image_patches

        rows, cols = grid
        return {
            "text": ("<image>", f"<img>{'<image>' * (rows * cols // 4)}</img>"),
            "pixel_values": image_patches(pixel_values, 16)[0],
            "image_grid_hw": torch.tensor([[rows, cols]]),
        }

    def prompt_ids(self, messages: list[dict], media: dict | None = None, **template) -> list[int]:
        """The prompt transformers builds: its chat template, then the media's text."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template
        )
        if media:
            marker, replacement = media["text"]
            text = text.replace(marker, replacement, 1)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def retention(self, media: dict, rate: float) -> list[bool]:
        """transformers' EVS mask of a video's tokens at pruning `rate`."""
        from transformers.models.nemotron_h_omni.modeling_nemotron_h_omni import (
            compute_retention_mask,
        )

        pixels = media["pixel_values_videos"]
        with torch.inference_mode():
            (embeds,) = self.model.get_video_features(pixels).pooler_output
        return compute_retention_mask(embeds, pixels.shape[1], rate).tolist()

    def greedy(
        self, input_ids: list[int], media: dict | None, pruning_rate: float, num_tokens: int
    ) -> list[int]:
        """`generate`'s greedy tokens; the model prunes videos at `pruning_rate` itself."""
        self.model.video_pruning_rate = pruning_rate
        inputs = {k: v for k, v in (media or {}).items() if k != "text"}
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=torch.tensor([input_ids]),
                **inputs,
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, -num_tokens:].tolist()
