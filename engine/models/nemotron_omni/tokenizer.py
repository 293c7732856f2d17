"""A tiny Nemotron-style tokenizer, trained offline, for random-weight Nemotron 3 Nano Omni
checkpoints.

The real tokenizer (131k byte-level BPE pieces) cannot be fetched offline, so the factory
trains a small byte-level BPE on the built-in corpus, in its shape: the special tokens the
family's chat template and processor use (`<|im_start|>`, `<|im_end|>`, `<img>`, `</img>`,
`<image>`, `<video>`), `<think>` / `</think>` as ordinary added tokens (decoded as text, so a
reasoning parser sees them), the 256 byte pieces, then the learned pieces. The chat template
is ChatML with Nemotron 3's thinking switch: the assistant header opens `<think>\\n` unless
`enable_thinking` is false, which closes it at once (`<think></think>`). Training is
deterministic and takes milliseconds.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from stillcut.engine.factory import trained_tokenizer
from stillcut.engine.factory.trained_tokenizer import CORPUS

RECIPE_VERSION = 1  # bump when the corpus, tokens or `_build_backend` change
SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<image>",
    "<video>",
)
THINK_TOKENS = ("<think>", "</think>")  # added tokens, but not special: they decode to text
UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
IM_START_ID, IM_END_ID = 3, 4
IMG_START_ID, IMG_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 5, 6, 7, 8
THINK_START_ID, THINK_END_ID = 9, 10
NUM_BYTE_TOKENS = 256
VOCAB_SIZE = 1024  # added tokens + bytes + learned pieces

CHAT_TEMPLATE = (
    "{% set enable_thinking = enable_thinking if enable_thinking is defined else true %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking %}{{ '<think>\n' }}{% else %}{{ '<think></think>' }}{% endif %}"
    "{% endif %}"
)


def _build_backend() -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    added = (*SPECIAL_TOKENS, *THINK_TOKENS)
    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(added),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["\n".join(CORPUS)], trainer)
    assert backend.get_vocab_size() == VOCAB_SIZE, backend.get_vocab_size()
    assert [backend.token_to_id(t) for t in added] == list(range(len(added)))
    # Training added them all as special; <think> and </think> decode to text.
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return backend


TOKENIZER = trained_tokenizer.TrainedTokenizer(
    name="nemotron-tiny",
    version=RECIPE_VERSION,
    added=(*SPECIAL_TOKENS, *THINK_TOKENS),
    special=frozenset(SPECIAL_TOKENS),
    vocab_size=VOCAB_SIZE,
    chat_template=CHAT_TEMPLATE,
    config=MappingProxyType(
        {
            "bos_token": "<s>",
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "extra_special_tokens": {
                "image_token": "<image>",
                "video_token": "<video>",
                "image_start_token": "<img>",
                "image_end_token": "</img>",
            },
            "model_max_length": 262144,
            "pad_token": "<unk>",
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>",
        }
    ),
    build_backend=_build_backend,
)
