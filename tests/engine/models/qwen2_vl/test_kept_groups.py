"""Qwen towers on kept merge groups only (EVS before the tower) against the whole input with the
dropped groups masked out as attention keys.

The reference is the tower's ordinary pass with its attention replaced by `masked_attention`:
per segment, a query attends only to kept keys (a dropped query also to itself, so that no row
turns NaN). Kept rows must agree within the tower tests' tolerance, on a tower with windows,
grids whose width is not a multiple of the window, windows left empty, a tubelet left empty and
an input with no mask in the same pass.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stillcut.engine.models.qwen2_vl import tower as qwen_tower
from stillcut.engine.models.qwen2_vl.config import VisionConfig
from stillcut.engine.models.qwen2_vl.tower import Qwen2VLVisionTower
from stillcut.engine.models.qwen2_vl.tower_2_5 import Qwen2_5_VLVisionTower, window_layout
from stillcut.engine.models.qwen3_vl.config import Qwen3VisionConfig
from stillcut.engine.models.qwen3_vl.tower import Qwen3VLVisionTower

TOLERANCE = 1e-4  # tests/vision/test_towers.py's, in fp32
COMMON = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=24)
# (t, h, w) in patches; windows are 4x4 merged tokens (8x8 patches)
GRIDS = [(3, 12, 10), (1, 8, 8), (2, 16, 18)]


def make_tower(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2_5_vl":
        config = VisionConfig(
            **COMMON, hidden_act="silu", window_size=112, fullatt_block_indexes=(1, 3)
        )
        tower = Qwen2_5_VLVisionTower(config)
    elif kind == "qwen2_vl":
        config = VisionConfig(**COMMON, hidden_act="quick_gelu", fullatt_block_indexes=(0, 1, 2, 3))
        tower = Qwen2VLVisionTower(config)
    else:
        config = Qwen3VisionConfig(
            **COMMON,
            hidden_act="gelu_pytorch_tanh",
            patch_size=16,
            fullatt_block_indexes=(0, 1, 2, 3),
            num_position_embeddings=64,
            deepstack_visual_indexes=(1, 2),
        )
        tower = Qwen3VLVisionTower(config)
    with torch.no_grad():
        for parameter in tower.parameters():
            if parameter.dim() > 1:  # matrices, as transformers initialises them
                parameter.normal_(0.0, 0.1)  # outputs O(1): a wrong position or segment shows
    return tower.eval()


def kept_masks(grids) -> list[torch.Tensor]:
    """The first tubelet of every input whole; in the first input the second tubelet loses
    its whole first window (and a few groups), and its third tubelet is left empty; the last
    input keeps a random third of its later groups."""
    generator = torch.Generator().manual_seed(3)
    masks = []
    for t, h, w in grids:
        rows, cols = h // 2, w // 2
        mask = torch.rand(t, rows, cols, generator=generator) < 0.35
        mask[0] = True
        masks.append(mask)
    first = masks[0]
    first[1] = True
    first[1, :4, :4] = False  # an empty window
    first[1, 5, 0] = False
    first[2] = False  # an empty tubelet
    return [mask.flatten() for mask in masks]


def masked_attention(key_kept: torch.Tensor):
    """`varlen_attention` where keys of dropped groups are masked out, per segment."""

    def attention(q, k, v, cu_seqlens):
        out = torch.zeros_like(q)  # [N, heads, head_dim]
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end == start:
                continue
            rows = slice(start, end)
            allowed = key_kept[rows][None, :] | torch.eye(end - start, dtype=torch.bool)
            q_, k_, v_ = (x[rows].transpose(0, 1) for x in (q, k, v))  # [heads, L, head_dim]
            out[rows] = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed).transpose(
                0, 1
            )
        return out

    return attention


def patch_mask_in_block_order(tower, grids, kept: torch.Tensor) -> torch.Tensor:
    """Per patch, in the order the blocks see rows: whether its group is kept."""
    config = tower.config
    if isinstance(tower, Qwen2_5_VLVisionTower) and config.has_windows:
        order, _ = window_layout(grids, config.spatial_merge_size, config.window_merged_tokens)
        kept = kept[order]
    return kept.repeat_interleave(config.spatial_merge_size**2)


def outputs(result) -> list[torch.Tensor]:
    """The embeddings and any DeepStack sets of a forward pass."""
    if isinstance(result, tuple):
        merged, deepstack = result
        return [merged, *deepstack]
    return [result]


def random_patches(tower, grids) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    num_patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(num_patches, tower.config.patch_dim, generator=generator)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
@torch.inference_mode()
def test_kept_groups_equal_the_masked_whole_input(kind, monkeypatch):
    tower = make_tower(kind)
    grids = GRIDS
    masks = kept_masks(grids)
    masks[1] = torch.ones_like(masks[1])  # an input without pruning, in the same pass
    kept = torch.cat(masks)
    patches, grid_thw = random_patches(tower, grids), torch.tensor(grids)

    pruned = outputs(tower(patches, grid_thw, kept))
    plain = outputs(tower(patches, grid_thw))
    key_kept = patch_mask_in_block_order(tower, grids, kept)
    monkeypatch.setattr(qwen_tower, "varlen_attention", masked_attention(key_kept))
    reference = outputs(tower(patches, grid_thw))

    assert pruned[0].shape[0] == int(kept.sum())
    for ours, theirs, unmasked in zip(pruned, reference, plain, strict=True):
        theirs = theirs[kept]
        assert theirs.abs().max() > 0.5  # the tolerance means something
        assert (ours - theirs).abs().max().item() < TOLERANCE
        # masking changed the kept rows: the reference is not the unpruned pass
        assert (unmasked[kept] - theirs).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
@torch.inference_mode()
def test_a_pass_mixing_pruned_and_whole_inputs_equals_each_alone(kind):
    tower = make_tower(kind)
    grids = [(3, 12, 10), (1, 8, 8)]
    masks = [kept_masks(grids)[0], None]
    generator = torch.Generator().manual_seed(2)
    patches = [
        torch.randn(t * h * w, tower.config.patch_dim, generator=generator) for t, h, w in grids
    ]
    together = tower.encode(patches, grids, masks)
    for i, grid in enumerate(grids):
        (alone,) = tower.encode([patches[i]], [grid], [masks[i]])
        ours = outputs_of(together[i])
        for a, b in zip(ours, outputs_of(alone), strict=True):
            assert (a - b).abs().max().item() < TOLERANCE
    assert outputs_of(together[0])[0].shape[0] == int(masks[0].sum())


def outputs_of(output) -> list[torch.Tensor]:
    """An `encode` result's tensors: embeddings, then feature sets by name."""
    if isinstance(output, torch.Tensor):
        return [output]
    return [output.embeds, *(output.features[name] for name in sorted(output.features))]


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
@torch.inference_mode()
def test_masks_keeping_every_group_take_the_ordinary_path_bit_for_bit(kind):
    tower = make_tower(kind)
    grids = [(2, 12, 10)]
    patches = random_patches(tower, grids)
    (plain,) = tower.encode([patches], grids)
    (masked,) = tower.encode([patches], grids, [torch.ones(2 * 6 * 5, dtype=torch.bool)])
    for a, b in zip(outputs_of(plain), outputs_of(masked), strict=True):
        assert torch.equal(a, b)


def test_a_mask_of_the_wrong_shape_is_refused():
    tower = make_tower("qwen2_5_vl")
    grids = [(1, 8, 8)]
    with pytest.raises(ValueError, match=r"a kept mask must be bool \[16\]"):
        tower.encode([random_patches(tower, grids)], grids, [torch.ones(15, dtype=torch.bool)])
