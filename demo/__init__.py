"""The trained demo: a tiny Qwen2.5-VL that tells the truth about the synthetic task's clips.

The task (`scenes`, `render`, `clips`, `questions`) is coloured shapes that move, appear or
disappear on plain or textured ground, filmed with camera noise and H.264 compression, with
templated questions and true answers. `train` trains the model (`architecture`, `tokenizer`,
`training_data`, `sequences`) from scratch on the CPU. Its result ships with the package in
`checkpoint/` and is the default model of `stillcut describe`, `describe_video` and
`VideoLLM`; it is never trained at first use.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoint"


def demo_checkpoint() -> Path:
    """The trained demo checkpoint's folder, shipped with the package."""
    if not (CHECKPOINT_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the trained demo checkpoint is missing from {CHECKPOINT_DIR}: this installation "
            "of stillcut is incomplete (reinstall it), or pass a model folder instead"
        )
    return CHECKPOINT_DIR
