"""Errors a caller can cause by handing us a video.

Every failure that comes from the input (its bytes, its size, its length, the requested time
range) is a `VideoError`, so a service can turn the whole family into a client error. Each
message says what was wrong and what is allowed. The `VideoLimitExceeded` branch marks inputs
that are well formed but over a configured limit; the `UnreadableVideo` branch marks bytes that
FFmpeg cannot make sense of.
"""


class VideoError(ValueError):
    """Base class: the supplied video cannot be used; the message says why."""


class EmptyVideo(VideoError):
    """The input holds zero bytes."""


class UnreadableVideo(VideoError):
    """The bytes are not a supported container, or the file cannot be read at all."""


class TruncatedVideo(UnreadableVideo):
    """The container declares more data than the input holds (an upload cut short)."""


class CorruptVideo(UnreadableVideo):
    """The container opened, but the decoder rejected the coded data."""


class NotAVideo(VideoError):
    """The input is a still image (PNG, JPEG, ...), not a video."""


class NoVideoStream(VideoError):
    """The container has no video stream (for example, audio only)."""


class UnsupportedCodec(VideoError):
    """The video stream's codec or pixel format cannot be decoded by this build."""


class NoFrames(VideoError):
    """The video stream yielded no decodable frame."""


class InvalidTimeRange(VideoError):
    """The requested `start` / `end` do not describe a range inside the clip."""


class VideoLimitExceeded(VideoError):
    """The input is well formed but exceeds a configured limit."""


class VideoTooLarge(VideoLimitExceeded):
    """The input has more bytes than `max_bytes`."""


class VideoTooLong(VideoLimitExceeded):
    """The clip lasts longer than `max_duration_s`."""


class FrameTooLarge(VideoLimitExceeded):
    """A frame has more pixels than `max_pixels`."""


class TooManyFrames(VideoLimitExceeded):
    """Decoding would take more frames than `max_decoded_frames`."""


class NotAnImage(VideoError):
    """An image input that is not a readable PNG, JPEG or WebP image."""


class ImageTooLarge(VideoLimitExceeded):
    """An image whose header declares more pixels than `max_image_pixels`."""
