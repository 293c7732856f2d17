"""Nemotron 3 Nano Omni: config readers (`config`, `text_config`), the hybrid language model
(`model`, with `blocks`, `mamba`, `moe`), RADIO tower (`tower`), media preprocessing
(`preprocess`, `media`), prompt format (`prompt`), test checkpoints and tokenizer
(`checkpoint`, `tokenizer`) and the registry entry (`entry`)."""
