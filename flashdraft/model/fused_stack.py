"""The target's whole forward for a decoding step through its fused layers (docs/decoding.md, "Fused
stack").

Run through transformers' model forward, a step of fused layers (model/fused_decoder.py) still pays, per
layer, one kernel for the layer's last residual add (each layer's graph ends with it) and one for its
mask (each layer's attention converts the bool mask to an additive one and pads it), and, outside the
layers, some sixty small eager kernels: the embedding, RoPE's tables, the masks, the final norm. Run here,
the step is one loop over the layers with three functions a compile can take whole:

- `stack_prologue`: the embedding, RoPE's tables and each layer kind's additive mask
  (`grouped_attention_bias`), once a step;
- `fused_layer_step` per layer, carried: a layer hands on its attention output and its MLP output
  unsummed, and the next layer's graph adds them inside its first norm's kernel;
- `stack_epilogue`: the last add, the final norm and the LM head.

The features are those transformers' forward hooks capture: each chosen layer's output, the last layer's
after the final norm. Only a target whose model forward does nothing else is run here (`stack_refusal`);
the fast engine checks the two forwards against each other before the first step, on an fp32 copy of the
target's first layers (`stack_twin`, `stack_difference`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from flashdraft.model.fused_decoder import FusedProjections, fused_layer_step, grouped_attention_bias
from flashdraft.model.target import TargetModel

# config fields with which a model's forward scales its embedding, its residual stream or its logits
# (Granite, MiniCPM, Cohere, Gemma 2), which the loop here does not
_SCALING_CONFIG = (
    "embedding_multiplier",
    "scale_emb",
    "residual_multiplier",
    "logits_scaling",
    "logit_scale",
    "final_logit_softcapping",
)
_LAYER_KINDS = {"full_attention", "sliding_attention"}


def _decoder(target: TargetModel) -> nn.Module | None:
    model = target.model
    return model.get_decoder() if hasattr(model, "get_decoder") else None


def stack_refusal(target: TargetModel) -> str | None:
    """Why the target's step forward is not `FusedStack.step`'s loop, or None: its decoder must hold the
    embedding, the layers, RoPE and the final norm as `embed_tokens`, `layers`, `rotary_emb` and `norm`,
    its LM head be a plain linear layer, its layers full or sliding attention, and its config scale
    nothing (`_SCALING_CONFIG`)."""
    decoder = _decoder(target)
    if decoder is None or getattr(decoder, "layers", None) is not target.layers:
        return "its decoder layers are not its decoder's `layers`"
    missing = [
        n
        for n in ("embed_tokens", "rotary_emb", "norm")
        if not isinstance(getattr(decoder, n, None), nn.Module)
    ]
    if missing:
        return f"its decoder has no {', '.join(missing)} module"
    if type(target.model.get_output_embeddings()) is not nn.Linear:
        return "its LM head is not a plain nn.Linear"
    kinds = set(layer_kinds(target)) - _LAYER_KINDS
    if kinds:
        return f"its layers are {', '.join(sorted(kinds))}"
    scaling = [n for n in _SCALING_CONFIG if getattr(target.config, n, None) not in (None, 1, 1.0, False)]
    if scaling:
        return f"its config sets {', '.join(scaling)}"
    return None


def layer_kinds(target: TargetModel) -> list[str]:
    """Each layer's attention kind, as the model picks its mask by (`config.layer_types`)."""
    return list(getattr(target.config, "layer_types", None) or ["full_attention"] * target.num_layers)


def stack_prologue(
    embed: nn.Module,
    rotary: nn.Module,
    input_ids: Tensor,
    positions: Tensor,
    masks: dict[str, Tensor],
    groups: int,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor], dict[str, Tensor]]:
    """The step's embedding, a zero update for the first layer's carried add, RoPE's (cos, sin) and each
    mask kind's additive mask for `groups` query heads per KV head."""
    hidden = embed(input_ids)
    cos, sin = rotary(hidden, positions)
    biases = {kind: grouped_attention_bias(mask, groups, hidden.dtype) for kind, mask in masks.items()}
    return hidden, torch.zeros_like(hidden), (cos, sin), biases


def stack_epilogue(
    norm: nn.Module, lm_head: nn.Module, residual: Tensor, update: Tensor
) -> tuple[Tensor, Tensor]:
    """The logits of the last layer's output (`residual + update`) and that output after the final norm."""
    normed = norm(residual + update)
    return lm_head(normed), normed


class FusedStack:
    """`step(input_ids, positions, masks, cache)`: the target's logits and features for a decoding step,
    every layer as `fused_layer_step` with its `FusedProjections`. `prologue`, `layer_step` and
    `epilogue` are the module's eager functions until a compile replaces them
    (distributed/parallelize.py::compile_for_decoding)."""

    def __init__(self, target: TargetModel, projections: list[FusedProjections]):
        decoder = _decoder(target)
        self.target, self.projections = target, projections
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.lm_head = target.model.get_output_embeddings()
        self.kinds = layer_kinds(target)
        config = target.config
        groups = config.num_attention_heads // (
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        )
        # the additive masks' rows: one a token for the split kernels, one a query head for SDPA's
        self.mask_groups = 1 if projections[0].kernels.split_attention else groups
        self.prologue: Any = stack_prologue
        self.layer_step: Any = fused_layer_step
        self.epilogue: Any = stack_epilogue

    def step(
        self, input_ids: Tensor, positions: Tensor, masks: Tensor | dict[str, Tensor], cache: Any
    ) -> tuple[Tensor, Tensor]:
        """Logits [rows, queries, vocab] and features [rows, queries, n_feat * hidden] of `input_ids` at
        `positions` [rows, queries], with the step's bool masks (one, or one per layer kind) over a static
        cache that gives each layer a view of its own (`cache.layer_view(index)`)."""
        masks = masks if isinstance(masks, dict) else {"full_attention": masks}
        residual, update, rotary, biases = self.prologue(
            self.embed, self.rotary, input_ids, positions, masks, self.mask_groups
        )
        wanted, captured = set(self.target.layer_ids), {}
        for index, layer in enumerate(self.target.layers):
            layer_input, residual, update = self.layer_step(
                layer,
                self.projections[index],
                residual,
                update,
                biases[self.kinds[index]],
                rotary,
                cache.layer_view(index),
            )
            if index - 1 in wanted:
                captured[index - 1] = layer_input
        logits, normed = self.epilogue(self.norm, self.lm_head, residual, update)
        captured[len(self.target.layers) - 1] = normed  # as the capture hook keeps the last layer's
        return logits, torch.cat([captured[i] for i in self.target.layer_ids], dim=-1)


def stack_twin(target: TargetModel, layers: int = 2) -> TargetModel:
    """An fp32 copy of `target` cut to its first `layers` decoder layers (the embedding, RoPE, the final
    norm and the LM head whole), every one of them feature layers: what `stack_difference` compares the
    stack's loop and the model's forward on. fp32, since in bf16 the two differ by more than a missing
    scale would: a real model's first token carries activations of 20,000 and more (the real SmolLM2's
    middle layers), whose bf16 rounding (a step of 128 there) moves them by some 10% between two orders
    of the same sums. The target itself, and any routing installed on its layers, stay as they were."""
    decoder = _decoder(target)
    kept = decoder.layers
    cut = nn.ModuleList(list(kept)[:layers])
    routes = [layer.__dict__.pop("forward", None) for layer in cut]  # routing objects stay out of the copy
    decoder.layers = cut
    try:
        model = copy.deepcopy(target.model).float()
    finally:
        decoder.layers = kept
        for layer, route in zip(cut, routes, strict=True):
            if route is not None:
                layer.forward = route
    model.config.num_hidden_layers = len(cut)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = list(model.config.layer_types)[: len(cut)]
    return TargetModel(model, list(range(len(cut))), name=f"{target.name} (fp32, {len(cut)} layers)")


def stack_difference(reference: tuple[Tensor, Tensor], stacked: tuple[Tensor, Tensor]) -> float:
    """How far `FusedStack.step`'s (logits, features) are from the model forward's: the larger of the two
    relative L2 errors."""
    return max(
        float((ours.float() - theirs.float()).norm() / theirs.float().norm().clamp(min=1e-12))
        for ours, theirs in zip(stacked, reference, strict=True)
    )


# The `stack_difference` a correct loop stays under on the fp32 twin (`stack_twin`): fp32 rounding (1e-6
# or so) against a missing scale or norm, which is off by the scale itself.
STACK_TOLERANCE = 1e-3
