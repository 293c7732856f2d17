"""The offline-trained tiny tokenizers of several families: one `TrainedTokenizer` each, trained
on the one built-in `CORPUS`, written as the files a checkpoint folder gets, and named by a
recipe that changes whenever those files would."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stillcut.disk_cache import short_hash

CORPUS = (
    "A person walks a brown dog along the river in the early morning light.",
    "Two children play football on a green field while their parents watch from the side.",
    "The camera pans slowly across a busy city street full of cars, buses and bicycles.",
    "A cat sleeps on a red sofa next to an open window; the curtains move in the wind.",
    "What happens in this video? Describe the scene in one short sentence, please.",
    "The chef cuts onions, tomatoes and peppers, then puts them into a hot pan.",
    "Snow falls on the mountains. A skier turns left, then right, and stops near a tree.",
    "How many people are in the picture? There are three people and one horse.",
    "The traffic light changes from red to yellow to green at 12:45 on Monday, 3 March 2025.",
    "Rain drops hit the glass; a small boat sails past the lighthouse at sunset.",
    "A woman in a blue jacket opens the door, looks around, and carries a box inside.",
    "Is anything moving in the background? Yes: a train crosses the bridge from left to right.",
    "The kitchen is quiet. Nothing changes for several seconds, then the kettle starts to boil.",
    "An old man feeds pigeons in the square while tourists take photographs of the fountain.",
    "Summarize the video: a delivery van stops, the driver unloads parcels and drives away.",
    "Which colour is the car that overtakes the truck? It is silver, with a black roof.",
    "The goalkeeper jumps to the right but the ball flies into the top left corner of the net.",
    "Workers in orange helmets lift steel beams with a crane on a construction site.",
    "A lecture hall: the speaker points at a chart while students write notes on laptops.",
    "Waves break against the rocks; seagulls circle above the harbour under a grey sky.",
    "Count the birds on the wire. I can see seven birds, and two of them fly away.",
    "The dancer spins four times, stops, bows to the audience, and leaves the stage.",
    "At night the shop windows glow; a cyclist with a bright lamp rides through the puddles.",
    "Explain what the robot arm does: it picks up each bottle and places it in a crate.",
    "The baby laughs when the puppy licks her hand, and her brother claps his hands.",
    "Fog covers the valley at dawn, and slowly the sun reveals farms, fences and cows.",
    "A referee blows the whistle; the players shake hands and walk off the pitch.",
    "Where is the remote control? It lies under the newspaper on the wooden table.",
    "The video shows a laboratory where a scientist pours a blue liquid into a flask.",
    "Firefighters unroll a hose, climb a ladder and spray water onto the burning roof.",
    "Describe the weather: cloudy at first, heavy rain after ten minutes, sunshine at the end.",
    "A queue of passengers boards the plane; a flight attendant checks every ticket.",
    "The painter mixes yellow and white paint, then covers the wall with quick strokes.",
    "Please answer briefly. Did the door close before the alarm rang? No, it closed after.",
    "Horses gallop across the meadow, jump over a stream and disappear behind the hill.",
    "In the market, a vendor weighs apples, oranges and grapes for a customer.",
    "The security camera records an empty corridor; at 02:17 a light flickers twice.",
    "Children build a sandcastle with towers, walls and a moat filled with seawater.",
    "The pianist plays a slow melody while the violinist waits for her entrance.",
    "List the objects on the desk: a lamp, a mug, three pens, a phone and a notebook.",
)


@dataclass(frozen=True)
class TrainedTokenizer:
    """A tiny tokenizer trained offline on `CORPUS`: `build_backend()` trains it (a
    `tokenizers.Tokenizer` whose first ids are `added` in order); `config` is its
    tokenizer_config.json beside the added tokens, of which those in `special` are special.
    `name` and `version` (bump it when the training changes) name its recipe."""

    name: str
    version: int
    added: tuple[str, ...]
    special: frozenset[str]
    vocab_size: int
    chat_template: str
    config: Mapping[str, Any]
    build_backend: Callable[[], Any]

    def recipe_name(self) -> str:
        """`name-<hash>` of everything that shapes the files, the tokenizers version included."""
        import tokenizers

        recipe = {
            "version": self.version,
            "corpus": CORPUS,
            "added": self.added,
            "special": sorted(self.special),
            "vocab_size": self.vocab_size,
            "template": self.chat_template,
            "config": self.tokenizer_config(),
            "tokenizers": tokenizers.__version__,
        }
        return f"{self.name}-{short_hash(recipe)}"

    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json: `config` and the added tokens' decoder entries."""
        added = {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": token in self.special,
            }
            for token_id, token in enumerate(self.added)
        }
        return {"added_tokens_decoder": added, **self.config}

    def write(self, folder: Path) -> None:
        """Train the tokenizer; write tokenizer.json, tokenizer_config.json and
        chat_template.jinja into `folder`."""
        self.build_backend().save(str(folder / "tokenizer.json"))
        text = json.dumps(self.tokenizer_config(), indent=2, ensure_ascii=False)
        (folder / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
        (folder / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
