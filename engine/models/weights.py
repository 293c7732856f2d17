"""Frozen parameters from a checkpoint: meta-built layers named like the stored tensors, their
projections fused into the `[in, out]` weights `linear` reads, the untied head, and embedding
rows from a table in any of its stored layouts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stillcut.engine.anon_memory import release_freed_memory
from stillcut.engine.checkpoint import CheckpointLike
from stillcut.engine.loader import checkpoint_tensors, load_weights
from stillcut.engine.models.matmul import head_layout, matmul_layout, packing, scale_of
from stillcut.engine.quantization import WeightFormat, matmul_weights, plan_formats
from stillcut.kernels.cpu.packing import panel_rows

LM_HEAD_PREFIX = "lm_head."
LANGUAGE_MODEL_PREFIX = "language_model."

Table = tuple[torch.Tensor, torch.Tensor | None]  # a weight and its int8 scales (or None)


def empty_weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised frozen parameter; `from_checkpoint` replaces it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def set_weight(
    module: nn.Module, name: str, tensor: torch.Tensor, scale: torch.Tensor | None = None
) -> None:
    """Replace `module.<name>` by a frozen parameter holding `tensor` (no copy), and its int8
    per-column scales `<name>_scale` by `scale` (removed when None)."""
    setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    if scale is not None:
        setattr(module, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
    elif hasattr(module, f"{name}_scale"):
        delattr(module, f"{name}_scale")


def embedding_rows(
    input_ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `[N, hidden]` of an embedding `table` `[vocab, hidden]` (any strides, or a tied
    head's panels, see `head_table`; int8 times its per-row `scale`) for `input_ids` `[N]`, in
    `dtype`."""
    if table.dim() != 2:
        rows = panel_rows(table, input_ids).to(dtype)
    else:
        rows = F.embedding(input_ids, table).to(dtype)
    return rows if scale is None else rows.mul_(scale[input_ids, None].to(dtype))


def load_head(
    folder: CheckpointLike,
    hidden_size: int,
    vocab_size: int,
    weight_format: WeightFormat,
    device: torch.device | str,
) -> nn.Module:
    """An untied checkpoint's `lm_head` as a (meta-built) `nn.Linear` holding its weight in
    its stored format, laid out for `head_layout` (and its int8 `weight_scale`)."""
    with torch.device("meta"):
        head = nn.Linear(hidden_size, vocab_size, bias=False)
    kept = () if weight_format.quantizes("lm_head") else ("weight",)
    formats = plan_formats(head, weight_format, {"weight": 0}, unquantized=kept, heads=("weight",))
    load_weights(head, folder, LM_HEAD_PREFIX, device=device, formats=formats)
    return head


def load_decoder(
    stored: nn.Module,
    folder: CheckpointLike,
    weight_format: WeightFormat,
    device: torch.device | str,
    *,
    table: str,
    tied: bool,
    unused: tuple[str, ...] = (),
    kept: str | None = None,
) -> tuple[Table | None, Table]:
    """Load a checkpoint's `language_model.*` tensors into `stored` (a meta-built layout whose
    token embedding is the `nn.Embedding` named `table`), strictly, each in its planned format
    (`plan_formats`; matrices whose names hold `kept` stay in the compute dtype, and tensors
    under `unused` are skipped, logged), and its LM head.

    Returns the embedding (and its int8 scales) and the head in `head_layout` (and its scales).
    A `tied` checkpoint that stores no head of its own uses its embedding as the head: the
    embedding returned is then None (the head is the table, see `head_table`)."""
    head_is_table = tied and f"{LM_HEAD_PREFIX}weight" not in checkpoint_tensors(folder)
    name = f"{table}.weight"
    matmuls = matmul_weights(stored, {name: 0})
    formats = plan_formats(
        stored,
        weight_format,
        {key: axis for key, axis in matmuls.items() if kept is None or kept not in key},
        unquantized=(name,) if head_is_table and not weight_format.quantizes("lm_head") else (),
        heads=(name,) if head_is_table else (),
    )
    load_weights(
        stored, folder, LANGUAGE_MODEL_PREFIX, device=device, unused=unused, formats=formats
    )
    embedding = getattr(stored, table)
    embedding = (embedding.weight, scale_of(embedding, "weight"))
    if head_is_table:
        return None, (head_layout(embedding[0]), embedding[1])
    hidden_size, vocab_size = embedding[0].shape[1], embedding[0].shape[0]
    head = load_head(folder, hidden_size, vocab_size, weight_format, device)
    return embedding, (head_layout(head.weight), scale_of(head, "weight"))


def checkpoint_layout(vocab_size: int, hidden_size: int, layers: list[nn.Module]) -> nn.Module:
    """Meta-device modules named like a checkpoint's `language_model.*` tensors: the embedding,
    the decoder `layers` (see `checkpoint_layer`) and the final norm."""
    with torch.device("meta"):
        root = nn.Module()
        root.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        root.layers = nn.ModuleList(layers)
        root.norm = nn.RMSNorm(hidden_size)
    return root


def checkpoint_layer(
    hidden_size: int,
    intermediate_size: int,
    q_width: int,
    kv_width: int,
    *,
    qkv_bias: bool,
    norms: tuple[str, ...],
) -> nn.Module:
    """A meta-device decoder layer named like a checkpoint's: `self_attn.{q,k,v,o}_proj`,
    `mlp.{gate,up,down}_proj` and one RMSNorm per name in `norms`."""
    with torch.device("meta"):
        attn = nn.Module()
        attn.q_proj = nn.Linear(hidden_size, q_width, bias=qkv_bias)
        attn.k_proj = nn.Linear(hidden_size, kv_width, bias=qkv_bias)
        attn.v_proj = nn.Linear(hidden_size, kv_width, bias=qkv_bias)
        attn.o_proj = nn.Linear(q_width, hidden_size, bias=False)
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        layer = nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        for name in norms:
            setattr(layer, name, nn.RMSNorm(hidden_size))
    return layer


def fused_weight(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `[in, out]` weight (`matmul_layout`) of checkpoint-named `nn.Linear`s side by side
    (their outputs one after another), and their int8 scales likewise (None unless int8)."""
    transposed = [p.weight.T for p in linears]  # [in, out_i] views
    num_out = sum(part.shape[1] for part in transposed)
    first = transposed[0]
    pack = packing(first.dtype, first.device, first.shape[0], num_out)
    if pack is not None:
        weight = pack(transposed)  # side by side as it packs: one copy
    else:
        weight = matmul_layout(first if len(linears) == 1 else torch.cat(transposed, dim=1))
    scales = [scale_of(p, "weight") for p in linears]
    return weight, None if scales[0] is None else torch.cat(scales)


def fuse_projections(layer: nn.Module, stored: nn.Module, mlp: bool = True) -> None:
    """Set `layer`'s fused `[in, out]` weights (and int8 scales) from a checkpoint-named layer:
    `qkv_weight` (q, k, v columns side by side), `o_weight`, and unless `mlp` is False (a
    mixture-of-experts layer) `gate_up_weight` (gate, up) and `down_weight`. The stored
    layer's linear weights are dropped (its biases stay)."""
    attn = stored.self_attn
    parts = {"qkv_weight": [attn.q_proj, attn.k_proj, attn.v_proj], "o_weight": [attn.o_proj]}
    if mlp:
        parts["gate_up_weight"] = [stored.mlp.gate_proj, stored.mlp.up_proj]
        parts["down_weight"] = [stored.mlp.down_proj]
    for name, linears in parts.items():
        set_weight(layer, name, *fused_weight(linears))
        for part in linears:  # released as soon as fused: one projection's copy at a time
            part.weight = None
            if hasattr(part, "weight_scale"):
                del part.weight_scale
        release_freed_memory()
