"""The checkpoint factory: demo and test checkpoints in Hugging Face layout.

Apart from the engine's core: nothing under `stillcut.engine` imports it except through one
lazy import of the demo checkpoint. `checkpoints` builds and caches a random-weight checkpoint
per spec; each family's presets, configs and offline tokenizer live in their own module here.
`demo` holds the trained demo model (shipped with the package), its synthetic video task and
its trainer.
"""

from stillcut.demo import demo_checkpoint
from stillcut.engine.factory.checkpoints import (
    CheckpointSpec,
    build_checkpoint,
    cache_dir,
    cached_checkpoint,
    checkpoint_spec,
    hf_config,
    random_demo_checkpoint,
)

__all__ = [
    "CheckpointSpec",
    "build_checkpoint",
    "cache_dir",
    "cached_checkpoint",
    "checkpoint_spec",
    "demo_checkpoint",
    "hf_config",
    "random_demo_checkpoint",
]
