"""EVS (Efficient Video Sampling): drop video tokens that did not change since the last tubelet.

`prune` handles a whole clip in `rate` mode (vLLM's published retention rule, mask for mask) or
`threshold` mode (causal, content-adaptive); `ThresholdPruner` runs threshold mode on a live
stream, tubelet by tubelet. Survivors keep their original (t, h, w) coordinates.
"""

from stillcut.kernels.evs.api import prune
from stillcut.kernels.evs.config import EVSConfig
from stillcut.kernels.evs.result import EVSResult
from stillcut.kernels.evs.threshold import ThresholdPruner

__all__ = ["EVSConfig", "EVSResult", "ThresholdPruner", "prune"]
