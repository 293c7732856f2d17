"""Counts of the expensive work a vision pipeline did: frames out of the decoder, tower passes.

They make "refused before any work" checkable from outside: the server exports them as
metrics, and a request refused from its headers must leave both where they were. Plain
integers bumped by the one thread that runs the pipeline at a time; readers may see them a
moment late, never torn.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VisionWork:
    """Running totals since the pipeline was built."""

    frames_decoded: int = 0  # video frames the decoder produced (sampled or not), images opened
    tower_passes: int = 0  # calls of the vision tower
