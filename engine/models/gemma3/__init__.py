"""Gemma 3: config readers (`config`, `text_config`), language model (`model`), SigLIP tower
and projector (`tower`), media preprocessing (`preprocess`, `media`), positions (`positions`),
test checkpoints and tokenizer (`checkpoint`, `tokenizer`) and the registry entry (`entry`)."""
