"""A tiny Gemma-style tokenizer, trained offline, for random-weight Gemma 3 checkpoints.

Real Gemma 3 tokenizers (262k SentencePiece pieces) cannot be fetched offline, so the factory
trains a small byte-fallback BPE on the built-in corpus below, in Gemma's shape: the special
tokens Gemma 3's processor and chat template use, the 256 `<0xNN>` byte pieces (any text
encodes, nothing maps to `<unk>`), then the learned pieces. The pipeline is the one
transformers' `GemmaTokenizer` rebuilds from the vocabulary (spaces become `▁`, no
pre-splitting, a `<bos>` prepended), so `tokenizers` and transformers give the same ids.
Training is deterministic and takes milliseconds.
"""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

from stillcut.engine.factory import trained_tokenizer
from stillcut.engine.factory.trained_tokenizer import CORPUS

RECIPE_VERSION = 1  # bump when the corpus or `_build_backend` changes
# Ids 0-9 in this order; real Gemma 3 has the first four at the same ids.
SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
PAD_TOKEN_ID, EOS_TOKEN_ID, BOS_TOKEN_ID = 0, 1, 2
START_OF_TURN_ID, END_OF_TURN_ID = 5, 6
BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID = 7, 8, 9
NUM_BYTE_TOKENS = 256
VOCAB_SIZE = 1024  # specials + bytes + 758 learned pieces
SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Gemma 3's chat template: turns are `<start_of_turn>{user|model}\n...<end_of_turn>\n`, a system
# message is prefixed to the first user turn, and an image part is `<start_of_image>` (the
# processor expands it to the image's soft tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% endif %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _learned_pieces() -> tuple[list[str], list[tuple[str, str]]]:
    """BPE pieces (in training order) and merges learned from the corpus, within words."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    trainer_tokenizer = Tokenizer(BPE())
    trainer_tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    # Training splits before each space so pieces never span words, as SentencePiece's do.
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Split(SPACE, behavior="merged_with_next")
    num_learned = VOCAB_SIZE - len(SPECIAL_TOKENS) - NUM_BYTE_TOKENS
    trainer = BpeTrainer(vocab_size=num_learned, show_progress=False)
    trainer_tokenizer.train_from_iterator(["\n".join(CORPUS)], trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    pieces = sorted(model["vocab"], key=model["vocab"].get)
    assert len(pieces) == num_learned, f"the corpus yields {len(pieces)} of {num_learned} pieces"
    return pieces, [tuple(merge) for merge in model["merges"]]


def _build_backend() -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    pieces, merges = _learned_pieces()
    byte_pieces = [f"<0x{value:02X}>" for value in range(NUM_BYTE_TOKENS)]
    vocab = {piece: i for i, piece in enumerate((*SPECIAL_TOKENS, *byte_pieces, *pieces))}
    backend = Tokenizer(BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_TOKEN_ID)]
    )
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return backend


TOKENIZER = trained_tokenizer.TrainedTokenizer(
    name="gemma3-tiny",
    version=RECIPE_VERSION,
    added=SPECIAL_TOKENS,
    special=frozenset(SPECIAL_TOKENS),
    vocab_size=VOCAB_SIZE,
    chat_template=CHAT_TEMPLATE,
    config=MappingProxyType(
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<bos>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "<eos>",
            # Gemma 3's processor reads these three by name.
            "extra_special_tokens": {
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
            "mask_token": "<mask>",
            "model_max_length": 131072,
            "pad_token": "<pad>",
            "processor_class": "Gemma3Processor",
            "spaces_between_special_tokens": False,
            "tokenizer_class": "GemmaTokenizer",
            "unk_token": "<unk>",
        }
    ),
    build_backend=_build_backend,
)
