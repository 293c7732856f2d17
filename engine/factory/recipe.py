"""What the shared checkpoint factory asks of a family: its presets and its `CheckpointRecipe`.

A family's recipe lives in its folder (`engine/models/<family>/checkpoint.py`) and is named by
its registry entry (`ModelFamily.checkpoints`); the factory (`checkpoints`) resolves a spec
through it, builds the model with transformers' own init (seeded) or writes it tensor by tensor
(`streamed`), and asks the recipe for the transformers config, the processor files and the
tokenizer. Nothing here knows a family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedConfig

    from stillcut.engine.factory.checkpoints import CheckpointSpec
    from stillcut.engine.factory.trained_tokenizer import TrainedTokenizer

Fields = Mapping[str, Any]  # config fields or options, by name

# The preset the speed benchmarks measure: the default family's random-weight model of the
# demo's shape.
RANDOM_DEMO = "random-demo"


@dataclass(frozen=True)
class Preset:
    """A named model size: the few text and vision config fields that matter, in the family's
    own keys. `tie_word_embeddings` is the default a spec may override. `streamed` presets are
    too large to build in memory: their weights are written tensor by tensor
    (`factory.streamed`)."""

    dtype: Literal["float32", "bfloat16"]
    text: Mapping[str, Any]
    vision: Mapping[str, Any]
    tie_word_embeddings: bool = True
    streamed: bool = False

    def __post_init__(self) -> None:
        # Read-only views: presets are shared by every caller.
        object.__setattr__(self, "text", MappingProxyType(dict(self.text)))
        object.__setattr__(self, "vision", MappingProxyType(dict(self.vision)))


class CheckpointRecipe(ABC):
    """One family's test checkpoints. A subclass sets the class attributes and implements
    `resolve`, `hf_config`, `processor_files`, `tokenizer_name` and `write_tokenizer`.

    `model_class` is the transformers class that builds the model; `option_names` the spec
    options the family takes besides `text` and `vision` (they land in `CheckpointSpec.options`);
    `generation_ids` the generation config's token ids; `tokenizer` the family's trained tiny
    tokenizer, if it writes one (else it overrides `tokenizer_name` and `write_tokenizer`).
    """

    model_class: str
    presets: Mapping[str, Preset]
    option_names: tuple[str, ...] = ()
    generation_ids: Mapping[str, Any] = MappingProxyType({})
    tokenizer: TrainedTokenizer | None = None

    @abstractmethod
    def resolve(self, preset: str, text: Fields, vision: Fields, options: Fields) -> dict[str, Any]:
        """The spec's full `text`, `vision` and `options` of `preset` with the caller's
        overrides (option names already checked against `option_names`)."""

    def check(self, spec: CheckpointSpec) -> None:
        """Raise ValueError, naming the field, for a spec transformers or we cannot use (an
        optional hook: by default every spec is usable)."""
        return

    @abstractmethod
    def hf_config(self, spec: CheckpointSpec) -> PreTrainedConfig:
        """The transformers config of `spec`."""

    @abstractmethod
    def processor_files(self, spec: CheckpointSpec) -> dict[str, dict[str, Any]]:
        """File name -> contents of the checkpoint's processor configs."""

    def tokenizer_name(self) -> str:
        """A name that changes whenever the tokenizer files `write_tokenizer` writes would (by
        default its trained `tokenizer`'s recipe name)."""
        return self.tokenizer.recipe_name()

    def write_tokenizer(self, folder: Path) -> None:
        """Write the tokenizer files into `folder` (by default its trained `tokenizer`'s)."""
        self.tokenizer.write(folder)

    def randomize(self, model: nn.Module) -> None:
        """Redraw, from torch's seeded global RNG, weights transformers initialises to constants
        (so that a norm or bias left out shows); by default nothing."""
        return


def random_marks(spec: CheckpointSpec) -> dict[str, Any]:
    """Top-level config fields that say the weights are random, and from which spec: the CLI
    tells its user that such a model's answers mean nothing."""
    return {
        "stillcut_random_weights": True,
        "stillcut_preset": spec.preset,
        "stillcut_seed": spec.seed,
    }
