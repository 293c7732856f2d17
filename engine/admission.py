"""The checks a request passes before the scheduler takes it, and their errors.

Mistakes in a request are `ValueError` subclasses the service answers with 400/413; a pool too
full of held prefixes is `ResourceExhausted`, which clears once a live session releases its
prefix, so the service answers 503 (or closes a WebSocket with 1008) and the client may retry.
"""

from __future__ import annotations

from collections.abc import Sequence

from stillcut.engine.config import SchedulerConfig
from stillcut.engine.multimodal import MultiModalItem


class RequestTooLong(ValueError):
    """The prompt plus the tokens to generate exceed the model's context or the KV cache."""


class TooManyVisualTokens(ValueError):
    """The request's images and videos hold more placeholder tokens than a request may."""


class BidirectionalItemTooLong(ValueError):
    """A bidirectional item cannot be split across steps, so it must fit one step's budget."""


class ResourceExhausted(RuntimeError):
    """The engine cannot take this now (held prefixes pin their share of the KV cache)."""


def check_request_size(
    num_prompt_tokens: int,
    max_tokens: int,
    items: Sequence[MultiModalItem],
    config: SchedulerConfig,
    *,
    num_blocks: int,
    block_size: int,
    held_share: float,
    hold: bool,
    num_earlier_visual_tokens: int = 0,
) -> None:
    """Raise if a prompt (with `max_tokens` still to generate; 0 for a held prefix) can never
    be served by this engine. `items` are the new ones (all of a new request; an append's own),
    after `num_earlier_visual_tokens` the request already holds; `hold`: a live request,
    which pins its blocks.

    Held prefixes together may pin `held_share` of the pool; an ordinary request must fit in
    the rest, or it could preempt itself forever while sessions hold their share.
    """
    num_tokens = num_prompt_tokens + max_tokens
    if num_tokens > config.max_model_len:
        raise RequestTooLong(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
            f"max_model_len={config.max_model_len}"
        )
    num_blocks_needed = -(-num_tokens // block_size)
    held_limit = held_block_limit(num_blocks, held_share)
    max_blocks = held_limit if hold else num_blocks - held_limit
    if num_blocks_needed > max_blocks:
        raise RequestTooLong(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
            f"{num_blocks_needed} KV blocks of {block_size} tokens; "
            f"{'a held prefix' if hold else 'a request'} may use at most {max_blocks} "
            f"(num_blocks={num_blocks}, held_share={held_share})"
        )
    num_visual = num_earlier_visual_tokens + sum(item.num_tokens for item in items)
    if num_visual > config.max_visual_tokens_per_request:
        raise TooManyVisualTokens(
            f"the request's {num_visual} visual tokens exceed "
            f"max_visual_tokens_per_request={config.max_visual_tokens_per_request}"
        )
    for index, item in enumerate(items):
        if item.bidirectional and item.num_tokens > config.max_num_batched_tokens:
            raise BidirectionalItemTooLong(
                f"mm item {index} ({item.kind}) has {item.num_tokens} tokens attending "
                f"bidirectionally, more than max_num_batched_tokens="
                f"{config.max_num_batched_tokens}; it cannot be split across prefill chunks"
            )


def held_block_limit(num_blocks: int, held_share: float) -> int:
    """How many blocks held prefixes may pin together."""
    return int(held_share * num_blocks)


def check_held_share(
    num_held_blocks: int, num_new_blocks: int, *, num_blocks: int, held_share: float
) -> None:
    """Raise `ResourceExhausted` if held prefixes would pin more than `held_share` of the pool.

    `num_held_blocks` counts the blocks every held prefix needs for its whole prompt, so a
    prefix still being prefilled already counts in full.
    """
    limit = held_block_limit(num_blocks, held_share)
    if num_held_blocks + num_new_blocks > limit:
        raise ResourceExhausted(
            f"held prefixes would pin {num_held_blocks + num_new_blocks} of {num_blocks} KV "
            f"blocks, over held_share={held_share} ({limit} blocks); release a held prefix "
            "or retry later"
        )
