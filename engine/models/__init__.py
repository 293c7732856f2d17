"""The language models the runner drives, one folder per family, and the registry that names
them.

`registry` defines an entry (`ModelFamily`) and `families` lists the built-in ones; each
family's folder holds its config reader, language model, vision tower, media preprocessing,
positions, prompt format, test-checkpoint recipe and entry (`<family>/entry.py`), imported on
first use of its `model_type`. What several families share stands here: `base` (what the
runner asks of a language model), `matmul` and `weights` (weight layout, products, loading),
`rotary`, `vit` (vision-transformer blocks), `pixels` and `frame_resize` (media
preprocessing).
"""
