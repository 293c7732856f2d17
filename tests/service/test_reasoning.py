"""`--reasoning-parser think`: a leading thinking block becomes the reasoning, the rest the
content, the same whole or streamed in any pieces, and the prompt says where an answer starts."""

import pytest
from tokenizers import Tokenizer

from stillcut.engine.factory import cached_checkpoint
from stillcut.service.reasoning import ThinkSplitter

CASES = [
    # (starts inside the block, output text, reasoning, content)
    (True, "let me see\n</think>\n\nIt is a cat.", "let me see\n", "\n\nIt is a cat."),
    (True, "still thinking", "still thinking", ""),
    (True, "almost</thi", "almost</thi", ""),  # an unfinished tag at the end stays reasoning
    (False, "<think>hmm</think>Yes.", "hmm", "Yes."),
    (False, "  <think>a</think>b", "a", "b"),
    (False, "No thinking here.", "", "No thinking here."),
    (False, "Later <think>not leading</think>", "", "Later <think>not leading</think>"),
    (False, "<thin", "", "<thin"),
]


@pytest.mark.parametrize(("in_reasoning", "text", "reasoning", "content"), CASES)
def test_whole_and_streamed_split_agree(in_reasoning, text, reasoning, content):
    assert ThinkSplitter(in_reasoning).split(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1):
            splitter = ThinkSplitter(in_reasoning)
            pieces = [splitter.push(p) for p in (text[:cut], text[cut:cut2], text[cut2:])]
            pieces.append(splitter.flush())
            assert "".join(r for r, _ in pieces) == reasoning
            assert "".join(c for _, c in pieces) == content


def test_the_prompt_tells_whether_the_answer_starts_inside_the_block():
    path = cached_checkpoint("tiny", seed=1, family="nemotron_h_omni")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n").ids
    closed = tokenizer.encode("<|im_start|>assistant\n<think></think>").ids
    assert ThinkSplitter.for_prompt(tokenizer, opened).split("a</think>b") == ("a", "b")
    assert ThinkSplitter.for_prompt(tokenizer, closed).split("a</think>b") == ("", "a</think>b")
