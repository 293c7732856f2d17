"""Qwen3.5 and Qwen3.5-MoE: a Gated DeltaNet / gated-attention hybrid language model (`model`,
with `delta_net`, `attention`, `mlp`), its config and cache groups (`config`), test
checkpoints (`checkpoint`) and the registry entries (`entry`); the vision tower, media
preprocessing and timestamped prompt are Qwen3-VL's."""
