"""The demo task's questions, their true answers, and how an answer is scored.

Six question types: the colour and the shape of what moves, which way it moves, how many
objects there are, whether anything changes, and a one-sentence description (the answer to
`stillcut describe`'s default prompt). Each type has a canonical prompt, the one the accuracy
bench asks, and a few rewordings that training draws from. Answers are templates filled in from
the scene. Scoring reads keywords: an answer is right when it holds every true keyword and no
wrong one of the same kind ("It is red or blue." is a wrong colour answer). A description must
name every object's colour and shape, what the subject does, that the others stand still, and
the ground, and nothing the scene does not hold. It lists every object in a fixed colour order
(`scenes.listing_order`) and the ground, then says what the subject does and that the others
stay still; the scorer does not check the order: any order of the right words is right. (Task
version 5 named the subject first and then the others: a model had to leave the subject out
of the second list, and a third of its wrong descriptions named it there again.)
"""

from __future__ import annotations

import re

from stillcut.demo.scenes import COLOURS, SHAPES, Scene, SceneObject, listing_order

QUESTION_TYPES = ("colour", "shape", "direction", "count", "change", "describe")
PROMPTS: dict[str, tuple[str, ...]] = {
    "colour": (
        "What colour is the object that moves?",
        "What color is the moving object?",
        "Which colour is the thing that moves?",
    ),
    "shape": (
        "What shape is the object that moves?",
        "What shape is the moving object?",
        "Which shape moves?",
    ),
    "direction": (
        "Which way does the object move?",
        "In which direction does it move?",
        "Where does the moving object go?",
    ),
    "count": (
        "How many objects are there?",
        "How many shapes are in the video?",
        "Count the objects.",
    ),
    "change": (
        "Does anything change?",
        "Does anything happen?",
        "Is anything moving or changing?",
    ),
    "describe": (
        "Describe this video.",
        "What happens in this video?",
        "What is happening?",
        "What moves?",
    ),
}
DIRECTIONS = ("left", "right", "up", "down")
NUMBERS = ("one", "two", "three")
EVENTS = ("appears", "disappears")
GROUNDS = ("flat", "textured")
DIRECTION_PHRASES = {"left": "to the left", "right": "to the right", "up": "up", "down": "down"}
NOTHING_MOVES = "Nothing moves."


def answer(scene: Scene, question_type: str) -> str:
    """The true answer to a question of `question_type` about `scene`."""
    subject = scene.subject_object
    moving = scene.motion != "none"
    if question_type == "colour":
        return f"It is {subject.colour}." if moving else NOTHING_MOVES
    if question_type == "shape":
        return f"It is a {subject.shape}." if moving else NOTHING_MOVES
    if question_type == "direction":
        return f"It moves {DIRECTION_PHRASES[scene.motion]}." if moving else NOTHING_MOVES
    if question_type == "count":
        count = len(scene.objects)
        verb, noun = ("is", "object") if count == 1 else ("are", "objects")
        return f"There {verb} {NUMBERS[count - 1]} {noun}."
    if question_type == "change":
        return "No, nothing changes." if subject is None else f"Yes, {_happening(scene, 'the')}."
    if question_type == "describe":
        return _description(scene)
    raise ValueError(f"question_type={question_type!r}: allowed {QUESTION_TYPES}")


def is_correct(scene: Scene, question_type: str, text: str) -> bool:
    """Whether `text` answers the question right: every true keyword, no wrong one."""
    if question_type == "change":
        first = re.match(r"\W*([a-z]+)", text.lower())
        return first is not None and first.group(1) == ("no" if scene.subject is None else "yes")
    return keywords_match(text, *_keywords(scene, question_type))


def keywords_match(text: str, required: set[str], kinds: list[tuple[str, ...]]) -> bool:
    """Whether `text` holds every word of `required` and no other word of any of `kinds`."""
    words = set(re.findall(r"[a-z]+", text.lower()))
    wrong = {word for kind in kinds for word in kind} - required
    return required <= words and not words & wrong


def _keywords(scene: Scene, question_type: str) -> tuple[set[str], list[tuple[str, ...]]]:
    """The words a right answer holds, and the kinds of word that must not be wrong."""
    subject = scene.subject_object
    moving = scene.motion != "none"
    if question_type == "count":
        return {NUMBERS[len(scene.objects) - 1]}, [NUMBERS]
    if question_type in ("colour", "shape", "direction"):
        if not moving:
            return {"nothing"}, [tuple(COLOURS), SHAPES, DIRECTIONS]
        word = {"colour": subject.colour, "shape": subject.shape}.get(question_type, scene.motion)
        kind = {"colour": tuple(COLOURS), "shape": SHAPES}.get(question_type, DIRECTIONS)
        return {word}, [kind, ("nothing",)]
    if question_type != "describe":
        raise ValueError(f"question_type={question_type!r}: allowed {QUESTION_TYPES}")
    required = {scene.ground, *(o.colour for o in scene.objects), *(o.shape for o in scene.objects)}
    if subject is None:
        required |= {"still", "nothing"}
    else:
        required |= {scene.motion} if moving else set()
        required |= {scene.event} if scene.event != "none" else set()
        required |= {"still"} if scene.bystanders else set()
    kinds = [tuple(COLOURS), SHAPES, GROUNDS, DIRECTIONS, EVENTS, ("still",), ("nothing",)]
    return required, kinds


def _happening(scene: Scene, article: str, event_article: str = "a") -> str:
    """What the subject does: "the red circle moves up", "a blue cross appears" (an
    appearing subject takes `event_article`), ..."""
    subject = scene.subject_object
    name = named(subject, event_article if scene.event == "appears" else article)
    motion = f"moves {DIRECTION_PHRASES[scene.motion]}" if scene.motion != "none" else ""
    if scene.event == "appears":
        return f"{name} appears" + (f" and {motion}" if motion else "")
    if scene.event == "disappears":
        return f"{name} " + (f"{motion} and disappears" if motion else "disappears")
    return f"{name} {motion}"


def _description(scene: Scene) -> str:
    """Every object in listing order and the ground, then what the subject does and that the
    others stay still (or that nothing changes)."""
    names = listed([named(o, "a") for o in listing_order(scene.objects)])
    ground = f"on a {scene.ground} background"
    if scene.subject is None:
        verb = "stands" if len(scene.objects) == 1 else "stand"
        return capitalised(f"{names} {verb} still {ground}; nothing changes.")
    sentence = f"{names} {ground}: {_happening(scene, 'the', event_article='the')}"
    others = len(scene.bystanders)
    if others:
        sentence += "; the other stays still" if others == 1 else "; the others stay still"
    return capitalised(sentence + ".")


def named(obj: SceneObject, article: str) -> str:
    """ "a red circle", "an orange cross", "the blue square"."""
    if article == "a" and obj.colour[0] in "aeiou":
        article = "an"
    return f"{article} {obj.colour} {obj.shape}"


def listed(names: list[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def capitalised(text: str) -> str:
    """`text` with its first letter upper case."""
    return text[0].upper() + text[1:]
