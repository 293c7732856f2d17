"""Qwen2.5-VL and Qwen2-VL: config reader (`config`), language model (`model`), vision towers
(`tower`, `tower_2_5`), media preprocessing (`preprocess`, `media`), M-RoPE positions
(`positions`), test checkpoints (`checkpoint`) and the registry entries (`entry`)."""
