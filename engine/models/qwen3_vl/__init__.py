"""Qwen3-VL: dense and MoE language models, a DeepStack vision tower, timestamped tubelets."""
