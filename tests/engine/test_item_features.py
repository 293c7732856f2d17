"""An item's extra feature sets: a tower's output with the draft's joined, rows kept together,
and the draft's view of an item."""

import pytest
import torch

from stillcut.engine.multimodal import DRAFT, MultiModalItem, TowerOutput, select_rows


def _item(features) -> MultiModalItem:
    coords = torch.tensor([[0, 0, 0], [0, 0, 1], [1, 0, 0]])
    return MultiModalItem(
        "video", torch.arange(12.0).view(3, 4), coords, (2, 2, 4), features=features
    )


def test_the_draft_towers_output_joins_the_targets_under_its_prefix():
    target = TowerOutput(torch.zeros(3, 4), {"deepstack.0": torch.ones(3, 4)})
    draft = TowerOutput(torch.full((3, 2), 2.0), {"deepstack.0": torch.full((3, 2), 3.0)})
    joined = target.with_draft(draft)
    assert torch.equal(joined.embeds, target.embeds)
    assert sorted(joined.features) == ["deepstack.0", DRAFT, f"{DRAFT}/deepstack.0"]
    assert TowerOutput.of(target.embeds).features == {}
    item = _item(select_rows(joined.features, slice(None)))
    for_draft = item.for_draft()  # the draft model sees its own embeddings and feature sets
    assert torch.equal(for_draft.embeds, draft.embeds)
    assert list(for_draft.features) == ["deepstack.0"]
    assert torch.equal(for_draft.features["deepstack.0"], draft.features["deepstack.0"])


def test_rows_are_selected_together_and_must_match_the_embeddings():
    features = {"a": torch.arange(3.0)[:, None], "b": torch.arange(6.0).view(3, 2)}
    kept = select_rows(features, torch.tensor([0, 2]))
    assert kept["a"].flatten().tolist() == [0.0, 2.0] and kept["b"].tolist() == [[0, 1], [4, 5]]
    with pytest.raises(AssertionError):
        _item({"a": torch.zeros(2, 4)})  # two rows for three tokens
    with pytest.raises(ValueError, match=r"lacks the feature sets \['b'\]"):
        _item({"a": torch.zeros(3, 1)}).check_features(["a", "b"])
