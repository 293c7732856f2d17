"""What the web page draws of a described video: small frame thumbnails and, per tubelet, which
merged-grid tokens EVS kept.

The item does not keep its frames, so the thumbnails come from decoding the upload again with
the same sampling (on the encode worker, so it counts against its bound); the decode is
deterministic, so frame k here is frame k the model saw, and it holds the frames at thumbnail
size. There are as many as the sampling took, so the server's frame ceiling caps them too.
Frame k belongs to grid step k // frames_per_tubelet, read off the item: a tubelet may cover
two frames (the last one padded) or one step may be one frame.
"""

from __future__ import annotations

import base64
import io

import torch
from PIL import Image

from stillcut.engine.models.frame_resize import FrameResize
from stillcut.engine.multimodal import MultiModalItem
from stillcut.vision.decode import DecodeConfig, decode_video
from stillcut.vision.work import VisionWork

THUMBNAIL_WIDTH = 160
THUMBNAIL_QUALITY = 70
_THUMBNAIL_RESIZE = FrameResize(
    lambda height, width: (max(1, round(height * THUMBNAIL_WIDTH / width)), THUMBNAIL_WIDTH),
    Image.Resampling.BILINEAR,
)


def retention_masks(item: MultiModalItem) -> list[list[list[int]]]:
    """Per tubelet, a `[h][w]` grid of 1 (kept) / 0 (pruned) over the merged grid."""
    t, h, w = item.llm_grid
    mask = torch.zeros(t, h, w, dtype=torch.int64)  # [t, h, w]
    coords = item.coords.long()  # [num_kept, 3]
    mask[coords[:, 0], coords[:, 1], coords[:, 2]] = 1
    return mask.tolist()


def thumbnails(data: bytes, config: DecodeConfig, video: dict, work: VisionWork) -> list[str]:
    """Base64 JPEG thumbnails of the frames `video` (VideoInput's decode options) samples."""
    decoded = decode_video(
        data,
        config.with_sampling(video["fps"], video["max_frames"], video.get("num_frames")),
        start=video["start"],
        end=video["end"],
        resize=_THUMBNAIL_RESIZE,
        work=work,
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
    height, width = _THUMBNAIL_RESIZE.size(*frame.shape[:2])  # frame: [H, W, 3] uint8
    image = Image.fromarray(_THUMBNAIL_RESIZE.apply(frame, (height, width)))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=THUMBNAIL_QUALITY)
    return base64.b64encode(buffer.getvalue()).decode()
