"""What the web page draws of a described video: small frame thumbnails and, per tubelet, which
merged-grid tokens EVS kept.

The item does not keep its frames, so the thumbnails come from decoding the upload again with
the same sampling; the decode is deterministic, so frame k here is frame k the model saw. Frame
k belongs to grid step k // frames_per_tubelet, read off the item: Qwen's tubelets cover two
frames (the last one padded), Gemma 3's grid has one step per frame.
"""

from __future__ import annotations

import base64
import dataclasses
import io

import torch
from PIL import Image

from stillcut.engine.multimodal import MultiModalItem
from stillcut.vision.decode import DecodeConfig, decode_video

THUMBNAIL_WIDTH = 160
THUMBNAIL_QUALITY = 70


def retention_masks(item: MultiModalItem) -> list[list[list[int]]]:
    """Per tubelet, a `[h][w]` grid of 1 (kept) / 0 (pruned) over the merged grid."""
    t, h, w = item.llm_grid
    mask = torch.zeros(t, h, w, dtype=torch.int64)  # [t, h, w]
    coords = item.coords.long()  # [num_kept, 3]
    mask[coords[:, 0], coords[:, 1], coords[:, 2]] = 1
    return mask.tolist()


def thumbnails(data: bytes, config: DecodeConfig, video: dict) -> list[str]:
    """Base64 JPEG thumbnails of the frames `video` (VideoInput's decode options) samples."""
    overrides = {k: video[k] for k in ("fps", "max_frames") if video.get(k) is not None}
    decoded = decode_video(
        data, dataclasses.replace(config, **overrides), start=video["start"], end=video["end"]
    )
    return [_jpeg_base64(frame) for frame in decoded.frames]


def frames_view(item: MultiModalItem, thumbs: list[str]) -> dict:
    """The `frames` part of a describe result asked for with `include_frames=true`."""
    t, h, w = item.llm_grid
    return {
        "grid": [t, h, w],
        "frames_per_tubelet": -(-len(thumbs) // t),  # ceil: a padded last tubelet counts
        "thumbnails": thumbs,
        "retention": retention_masks(item),
    }


def _jpeg_base64(frame) -> str:
    image = Image.fromarray(frame)  # frame: [H, W, 3] uint8
    height = max(1, round(image.height * THUMBNAIL_WIDTH / image.width))
    image = image.resize((THUMBNAIL_WIDTH, height), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=THUMBNAIL_QUALITY)
    return base64.b64encode(buffer.getvalue()).decode()
