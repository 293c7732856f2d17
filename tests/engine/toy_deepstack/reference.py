"""A plain reference of the toy family: transformers' Qwen2.5-VL over the whole sequence, the
deepstack features added by forward hooks after the first layers, greedy, no cache."""

from pathlib import Path

import torch
from safetensors import safe_open

from toy_deepstack import FEATURES


class Reference:
    """The checkpoint at `folder` as transformers computes it, plus the deepstack sums."""

    def __init__(self, folder: Path) -> None:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        config = Qwen2_5_VLConfig.from_pretrained(folder)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, config=config)
        self.model.eval()
        with safe_open(folder / "model.safetensors", "pt") as weights:
            names = {
                name.rsplit("deepstack.", 1)[1]: name
                for name in weights.keys()
                if "deepstack." in name
            }
            self.projections = [
                weights.get_tensor(names[f"{k}.weight"]) for k in range(len(FEATURES))
            ]

    def video_embeddings(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The tower's dense embeddings [t * h/2 * w/2, hidden] of one video's patches."""
        with torch.inference_mode():
            output = self.model.model.get_video_features(
                pixel_values_videos=patches, video_grid_thw=torch.tensor([grid])
            )
        return output.pooler_output[0]

    def deepstack(self, embeds: torch.Tensor) -> list[torch.Tensor]:
        """The extra feature sets of `embeds` [M, hidden], in layer order."""
        return [embeds @ projection.T for projection in self.projections]

    def logits(self, token_ids, positions, visual, embeds, features) -> torch.Tensor:
        """Logits [L, vocab] of the sequence; `visual` (bool [L]) marks the rows whose
        embeddings are `embeds`; feature k is added there after layer k (zeros: none)."""
        language_model = self.model.model.language_model

        def adder(feature):
            def add(module, args, output):
                hidden = output[0] if isinstance(output, tuple) else output
                hidden[0, visual] += feature
                return output

            return add

        hooks = [
            language_model.layers[k].register_forward_hook(adder(feature))
            for k, feature in enumerate(features)
        ]
        try:
            with torch.inference_mode():
                inputs = language_model.embed_tokens(torch.tensor([token_ids]))  # [1, L, hidden]
                inputs[0, visual] = embeds
                out = self.model.model(inputs_embeds=inputs, position_ids=positions[:, None, :])
                return self.model.lm_head(out.last_hidden_state[0])
        finally:
            for hook in hooks:
                hook.remove()

    def greedy(self, token_ids, positions, next_position, visual, embeds, features, max_tokens):
        """Greedy tokens after the prompt: each step recomputes the whole sequence. Sampled
        tokens are text: their (t, h, w) positions all count on from `next_position`."""
        token_ids, out = list(token_ids), []
        for k in range(max_tokens):
            after = torch.arange(next_position, next_position + k).expand(3, -1)
            logits = self.logits(
                token_ids + out,
                torch.cat([positions, after], dim=1),
                torch.cat([visual, torch.zeros(k, dtype=torch.bool)]),
                embeds,
                features,
            )
            out.append(int(logits[-1].argmax()))
        return out
