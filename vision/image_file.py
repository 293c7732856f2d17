"""Still images from bytes: PNG, JPEG and WebP only, their size checked from the header.

Pillow identifies a file by trying every format it knows, some of which hand the bytes to
other programs (EPS runs Ghostscript) or allocate before they look (its own pixel cap is a
warning up to 178 M pixels). An upload gets neither: only three plugins are tried, and the
pixel count is checked from the header before anything is decoded.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from stillcut.vision.errors import ImageTooLarge, NotAnImage
from stillcut.vision.work import VisionWork

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def image_size(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) an image declares; `NotAnImage` or `ImageTooLarge` before decoding."""
    with _open(data, max_pixels) as image:
        return image.size


def decode_image(data: bytes, max_pixels: int, work: VisionWork | None = None) -> np.ndarray:
    """An upright RGB image [H, W, 3] uint8 (EXIF orientation applied)."""
    with _open(data, max_pixels) as image:
        try:
            pixels = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
        except (OSError, ValueError, SyntaxError) as error:  # Pillow's "broken data stream"
            raise NotAnImage(f"the image could not be decoded ({error})") from None
    if work is not None:
        work.frames_decoded += 1
    return pixels


def _open(data: bytes, max_pixels: int) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        # Pillow's message names the BytesIO object (a heap address); it adds nothing else
        raise NotAnImage("the image is not a readable PNG, JPEG or WebP file") from None
    except Image.DecompressionBombError:
        raise ImageTooLarge(f"the image declares more than max_image_pixels={max_pixels}") from None
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise ImageTooLarge(
            f"the image declares {width}x{height} = {width * height} pixels, "
            f"over max_image_pixels={max_pixels}"
        )
    return image
