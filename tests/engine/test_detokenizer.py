"""Incremental detokenization: deltas add up to the one-shot decode, never carry half a
character, and stop strings end the text exactly before them without ever being shown."""

import random

import pytest
from tokenizers import Tokenizer

from stillcut.engine.detokenizer import IncrementalDetokenizer, detokenize, find_stop

IM_END, VIDEO_PAD, TOOL_CALL = 151645, 151656, 151657
PROMPT_END = [151644, 77091, 198]  # <|im_start|>assistant\n
PIECES = (
    " the", " video", " shows", " a", " red", " ball", ".", "\n", " 42", ",", " ok",
    "你好", "世界", "视频", "里", "有", "一个", "红色的", "球", "。",
    "🎉", "👍🏽", "🇯🇵", "👨‍👩‍👧", "🦀", "🫠", "龘", "𝄞", "é", "ß", "Ω", " naïve", "…", "∑",
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))


def random_text(rng: random.Random, num_pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(num_pieces))


def random_chunks(rng: random.Random, token_ids: list[int]) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(token_ids):
        size = rng.randint(1, 4)
        chunks.append(token_ids[start : start + size])
        start += size
    return chunks


def stream(tokenizer, chunks, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Push `chunks` in order, then flush; every delta, the flush's last."""
    detokenizer = IncrementalDetokenizer(tokenizer, PROMPT_END, **kwargs)
    deltas = [detokenizer.push(chunk) for chunk in chunks]
    return deltas + [detokenizer.flush()], detokenizer


@pytest.mark.parametrize("chunked", [False, True])
def test_deltas_add_up_to_decode_without_broken_characters(tokenizer, chunked):
    rng = random.Random(1234 + chunked)
    num_split_tokens = 0
    for _ in range(40):
        text = random_text(rng, rng.randint(1, 25))
        token_ids = tokenizer.encode(text, add_special_tokens=False).ids
        num_split_tokens += sum("\ufffd" in tokenizer.decode([t]) for t in token_ids)
        chunks = random_chunks(rng, token_ids) if chunked else token_ids
        deltas, detokenizer = stream(tokenizer, chunks)
        assert "".join(deltas) == text == tokenizer.decode(token_ids, skip_special_tokens=True)
        assert detokenizer.text == text == detokenize(tokenizer, token_ids)
        assert not any("\ufffd" in delta for delta in deltas)
        assert deltas[-1] == ""  # nothing held back from valid text without stop strings
    assert num_split_tokens > 20  # the streams really did split characters across tokens


def test_invalid_utf8_from_random_tokens_still_matches_decode(tokenizer):
    rng = random.Random(7)
    for _ in range(60):
        token_ids = [rng.randrange(151643) for _ in range(rng.randint(1, 12))]
        deltas, _ = stream(tokenizer, random_chunks(rng, token_ids))
        assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_a_character_cut_off_at_the_end_is_flushed_as_decode_renders_it(tokenizer):
    melting_face = tokenizer.encode("🫠", add_special_tokens=False).ids  # three tokens
    token_ids = tokenizer.encode("ok ", add_special_tokens=False).ids + melting_face[:2]
    deltas, detokenizer = stream(tokenizer, token_ids)
    assert deltas[-1] == "\ufffd" and "\ufffd" not in "".join(deltas[:-1])
    assert detokenizer.text == "ok \ufffd" == tokenizer.decode(token_ids)


def test_special_tokens_are_skipped_unless_asked(tokenizer):
    token_ids = [IM_END] + tokenizer.encode("Hi 你好", add_special_tokens=False).ids
    token_ids += [VIDEO_PAD, TOOL_CALL, IM_END]
    skipped, _ = stream(tokenizer, token_ids)
    assert "".join(skipped) == "Hi 你好<tool_call>"  # <tool_call> is an added, not special, token
    kept, _ = stream(tokenizer, token_ids, skip_special_tokens=False)
    assert "".join(kept) == "<|im_end|>Hi 你好<|video_pad|><tool_call><|im_end|>"
    assert "".join(kept) == tokenizer.decode(token_ids, skip_special_tokens=False)


def pieces_of(tokenizer, text: str) -> list[str]:
    return [tokenizer.decode([t]) for t in tokenizer.encode(text, add_special_tokens=False).ids]


def test_stop_spanning_tokens_is_never_shown(tokenizer):
    text = "Hello world, stop here please"
    assert pieces_of(tokenizer, text)[:4] == ["Hello", " world", ",", " stop"]
    token_ids = tokenizer.encode(text, add_special_tokens=False).ids
    deltas, detokenizer = stream(tokenizer, token_ids, stop=("ld, st",))
    # " world" ends in "ld", which may start the stop, so it waits; "," keeps it waiting.
    assert deltas[:4] == ["Hello", " wor", "", ""]
    assert "".join(deltas) == "Hello wor" == detokenizer.text
    assert detokenizer.finished and detokenizer.stop_reason == "ld, st"
    assert detokenize(tokenizer, token_ids, stop=("ld, st",)) == "Hello wor"


def test_held_text_is_released_once_it_cannot_start_a_stop(tokenizer):
    token_ids = tokenizer.encode("Hello world, fine", add_special_tokens=False).ids
    deltas, detokenizer = stream(tokenizer, token_ids, stop=("ld, st",))
    assert "".join(deltas) == "Hello world, fine" and not detokenizer.finished
    assert deltas[1:4] == [" wor", "", "ld, fine"]


def test_stop_at_the_very_start(tokenizer):
    token_ids = tokenizer.encode("END of the answer", add_special_tokens=False).ids
    deltas, detokenizer = stream(tokenizer, token_ids, stop=("END",))
    assert set(deltas) == {""} and detokenizer.text == ""
    assert detokenizer.finished and detokenizer.stop_reason == "END"


def test_earliest_stop_wins(tokenizer):
    token_ids = tokenizer.encode("one two three four", add_special_tokens=False).ids
    stops = ("four", "three", "two")
    deltas, detokenizer = stream(tokenizer, [token_ids], stop=stops)  # all in one push
    assert "".join(deltas) == "one " and detokenizer.stop_reason == "two"
    assert detokenize(tokenizer, token_ids, stop=stops) == "one "
    # A stop that completes first wins over a longer one that started earlier.
    assert find_stop("abcd", ("abcd", "bc")) == (1, "bc")
    assert find_stop("abcd", ("cd", "abcd")) == (0, "abcd")  # same end: the earlier start


def test_stop_inside_a_split_character(tokenizer):
    text = "看这个🫠好看吗"  # 🫠 is three byte-level tokens
    token_ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)
    deltas, detokenizer = stream(tokenizer, token_ids, stop=("🫠好",))
    assert "".join(deltas) == "看这个" and detokenizer.stop_reason == "🫠好"
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("seed", range(3))
def test_random_streams_with_stops_emit_text_before_the_stop_exactly_once(tokenizer, seed):
    rng = random.Random(seed)
    for _ in range(30):
        text = random_text(rng, rng.randint(1, 20))
        stops = tuple(random_text(rng, rng.randint(1, 2)) for _ in range(2)) + ("红色的球",)
        token_ids = tokenizer.encode(text, add_special_tokens=False).ids
        deltas, detokenizer = stream(tokenizer, random_chunks(rng, token_ids), stop=stops)
        expected = detokenize(tokenizer, token_ids, stop=stops)
        assert "".join(deltas) == expected == detokenizer.text
        assert detokenizer.finished == (expected != text)
        if detokenizer.finished:
            assert text[len(expected) :].startswith(detokenizer.stop_reason)


def test_flush_releases_a_possible_stop_prefix(tokenizer):
    token_ids = tokenizer.encode("The end is EN", add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, stop=("END",))
    assert detokenizer.push(token_ids) == "The end is "
    assert detokenizer.flush() == "EN" and not detokenizer.finished
    assert detokenizer.text == "The end is EN"


def test_pushes_after_a_stop_are_ignored(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, stop=("stop",))
    ids = tokenizer.encode("go stop", add_special_tokens=False).ids
    assert detokenizer.push(ids) == "go " and detokenizer.finished
    assert detokenizer.push(ids) == "" and detokenizer.flush() == ""
    assert detokenizer.text == "go "


def test_empty_stop_strings_are_rejected(tokenizer):
    with pytest.raises(ValueError, match="stop=.* must hold non-empty strings only"):
        IncrementalDetokenizer(tokenizer, stop=("ok", ""))
