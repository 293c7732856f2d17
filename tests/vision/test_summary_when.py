"""Questions about when something happens, answered from a timeline of captions.

The subject must be named word for word in one clause (a red square beside a blue circle is
not a red circle); presence verbs ask for every mention, other verbs narrow them; neighbouring
chunks merge into one span; what no caption says is answered as such.
"""

import pytest

from stillcut.vision.summary.prompts import TimedCaption
from stillcut.vision.summary.when import answer_when, check_when_question

TIMELINE = (
    TimedCaption(0.0, 4.0, "A yellow cross stands still."),
    TimedCaption(4.0, 8.0, "A yellow cross stands still; then a red square moves to the left."),
    TimedCaption(8.0, 12.0, "A red square moves to the left."),
    TimedCaption(12.0, 16.0, "A red square and a blue circle stand still."),
    TimedCaption(16.0, 20.0, "The blue circle disappears."),
    TimedCaption(20.0, 24.0, "A green triangle appears and moves up."),
    TimedCaption(24.0, 28.0, "The red squares move to the left."),
)


def test_an_appearance_is_the_first_mention_and_every_mention_is_listed():
    answer = answer_when(TIMELINE, "When does the red square appear?")
    assert answer.subject == "red square" and answer.event == ""
    assert answer.spans == ((4.0, 16.0), (24.0, 28.0))
    assert answer.first_s == 4.0
    assert "first appears at 4.0s" in answer.text
    shown = answer_when(TIMELINE, "when is the green triangle visible")
    assert shown.spans == ((20.0, 24.0),) and shown.event == ""


def test_other_verbs_narrow_the_mentions_to_the_clauses_that_say_them():
    moves = answer_when(TIMELINE, "when does the red square move to the left?")
    assert moves.spans == ((4.0, 12.0), (24.0, 28.0))  # not while it stands still
    leaves = answer_when(TIMELINE, "When did the blue circle disappear?")
    assert leaves.spans == ((16.0, 20.0),) and leaves.first_s == 16.0
    up = answer_when(TIMELINE, "when does the green triangle move up")
    assert up.spans == ((20.0, 24.0),)
    # a shape that is also a verb is still a shape where the subject starts
    assert answer_when(TIMELINE, "when does the yellow cross stand still?").spans == ((0.0, 8.0),)


def test_words_of_two_objects_in_one_clause_are_not_one_object():
    answer = answer_when(TIMELINE, "when does the red circle appear?")
    assert answer.spans == () and answer.first_s is None
    assert answer.text == 'No caption names "red circle".'
    assert answer_when(TIMELINE, "when does the purple cow appear?").text == (
        'No caption names "purple cow".'
    )


def test_what_the_timeline_never_says_is_answered_as_such():
    answer = answer_when(TIMELINE, "when does the yellow cross disappear?")
    assert answer.spans == ()
    assert answer.text == (
        'No caption says "yellow cross disappear"; the yellow cross is named from 0.0s to 8.0s.'
    )


def test_a_question_must_ask_when():
    for question in ("what is red?", "", "when?", "when does the"):
        with pytest.raises(ValueError, match="question="):
            check_when_question(question)
    check_when_question("When does the red square appear?")
    assert answer_when(TIMELINE, "when does the red square appear?").to_dict()["first_s"] == 4.0
