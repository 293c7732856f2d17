"""EVS over a whole clip that arrives a window of tubelets at a time, holding only what may be
kept: the same tokens `prune` keeps on the whole clip, in bounded memory.

Rate mode ranks the whole clip, but the number it keeps is known up front from the clip's
tubelet count (`num_retained_tokens`). So each window's tokens are scored against the tubelet
before them (the previous window's last tubelet is carried over), merged with the candidates
kept so far, and cut back to that number in `prune`'s order (dissimilarity descending, ties
to the lower index). A token cut once can never come back, so the end result is exact; what
is held is the kept count of candidate rows plus one window. Threshold mode is causal and
simply pushes each window through a `ThresholdPruner`. With EVS off every token is kept.
Extra row sets (a draft tower's embeddings) follow the same selection. With `hold_rows=False`
only the scores and positions are held (EVS before the tower scores a clip's pixels first and
encodes the kept tokens after).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stillcut.kernels.evs.config import MAX_DISSIMILARITY, EVSConfig, num_retained_tokens
from stillcut.kernels.evs.ops import Backend, check_embeds, pair_dissimilarity
from stillcut.kernels.evs.threshold import ThresholdPruner


@dataclass(frozen=True)
class ClipKept:
    """What survived a clip: rows in ascending flat (t, h, w) order."""

    rows: tuple[torch.Tensor, ...]  # per row set: [num_kept_tokens, dim]
    kept_coords: torch.Tensor  # [num_kept_tokens, 3] long, (t, h, w)
    kept_per_tubelet: torch.Tensor  # [num_tubelets] long


class ClipPruner:
    """Prunes `num_tubelets` tubelets of `grid_hw` tokens pushed in windows (`config` None or
    off: keeps everything); `hold_rows=False` keeps no rows, only which tokens survive."""

    def __init__(
        self,
        config: EVSConfig | None,
        grid_hw: tuple[int, int],
        num_tubelets: int,
        *,
        backend: Backend = "auto",
        hold_rows: bool = True,
    ) -> None:
        self.config = None if config is None or config.is_off else config
        self.grid_hw = grid_hw
        self.num_tubelets = num_tubelets
        self.backend = backend
        self.hold_rows = hold_rows
        self._tokens_per_tubelet = grid_hw[0] * grid_hw[1]
        self._num_pushed = 0  # tubelets pushed so far
        self._previous: torch.Tensor | None = None  # [h*w, dim] the last tubelet pushed
        self._score = torch.empty(0)  # [num candidates] float32
        self._index = torch.empty(0, dtype=torch.long)  # [num candidates] flat positions
        self._rows: list[torch.Tensor] = []  # per row set: [num candidates, dim]
        self._threshold: ThresholdPruner | None = None
        if self.config is not None and self.config.mode == "rate":
            self._budget = num_retained_tokens(
                num_tubelets, self._tokens_per_tubelet, self.config.rate
            )
        else:
            self._budget = num_tubelets * self._tokens_per_tubelet

    def push(self, embeds: torch.Tensor, *extra: torch.Tensor) -> None:
        """The next window: `embeds` [n*h*w, dim] in flat (t, h, w) order, and any extra row
        sets with as many rows."""
        num_new = check_embeds(embeds, self._tokens_per_tubelet)
        assert self._num_pushed + num_new <= self.num_tubelets, (self._num_pushed, num_new)
        assert all(rows.shape[0] == embeds.shape[0] for rows in extra)
        first = self._num_pushed * self._tokens_per_tubelet
        index = torch.arange(first, first + embeds.shape[0], device=embeds.device)
        if self.config is None:
            score = torch.zeros(embeds.shape[0], device=embeds.device)
        elif self.config.mode == "rate":
            score = self._rate_scores(embeds.contiguous())
        else:
            score, keep = self._threshold_scores(embeds)
            index, extra, embeds = index[keep], [rows[keep] for rows in extra], embeds[keep]
            score = score[keep]
        self._num_pushed += num_new
        self._merge(score, index, (embeds, *extra) if self.hold_rows else ())

    def finish(self) -> ClipKept:
        """The kept rows, their coordinates and the count kept per tubelet."""
        assert self._num_pushed == self.num_tubelets, (self._num_pushed, self.num_tubelets)
        w = self.grid_hw[1]
        tubelet, spatial = (
            self._index // self._tokens_per_tubelet,
            self._index % self._tokens_per_tubelet,
        )
        coords = torch.stack((tubelet, spatial // w, spatial % w), dim=1)  # [num_kept, 3]
        per_tubelet = torch.bincount(coords[:, 0], minlength=self.num_tubelets)
        return ClipKept(tuple(self._rows), coords, per_tubelet)

    def _rate_scores(self, embeds: torch.Tensor) -> torch.Tensor:
        """`1 - cos` of each token to its location one tubelet earlier; the clip's first
        tubelet scores above every other (it is always kept)."""
        hw = self._tokens_per_tubelet
        score = torch.empty(embeds.shape[0], dtype=torch.float32, device=embeds.device)
        if self._previous is None:
            score[:hw] = MAX_DISSIMILARITY + 1  # above any dissimilarity: always kept
            if embeds.shape[0] > hw:
                pair_dissimilarity(embeds[hw:], embeds[:-hw], out=score[hw:], backend=self.backend)
        else:
            earlier = torch.cat((self._previous, embeds[:-hw]))  # one tubelet behind `embeds`
            pair_dissimilarity(embeds, earlier, out=score, backend=self.backend)
        self._previous = embeds[-hw:].clone()
        return score

    def _threshold_scores(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._threshold is None:
            self._threshold = ThresholdPruner(
                self.config, self.grid_hw, embeds.shape[1], embeds.device, embeds.dtype,
                backend=self.backend,
            )  # fmt: skip
        result = self._threshold.push(embeds)
        return result.dissimilarity, result.mask

    def _merge(self, score: torch.Tensor, index: torch.Tensor, rows: tuple) -> None:
        """Candidates so far plus the window's, cut back to the budget in `prune`'s order."""
        score = torch.cat((self._score.to(score.device), score))
        index = torch.cat((self._index.to(index.device), index))
        if self._rows:
            rows = tuple(torch.cat((old, new)) for old, new in zip(self._rows, rows, strict=True))
        if score.numel() > self._budget:
            # concatenation is in index order: a stable sort gives ties to the lower index
            order = torch.sort(score, descending=True, stable=True).indices[: self._budget]
            keep = torch.sort(order).values
            score, index, rows = score[keep], index[keep], tuple(r[keep] for r in rows)
        self._score, self._index, self._rows = score, index, list(rows)
