"""The DFlash fields of a drafter config.json, read and checked the way z-lab, SGLang and vLLM read them.

A field may live in `dflash_config` or at the top level, as z-lab's `_draft_value` reads it
(docs/dflash.md §2); `dflash_config` wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from flashdraft.errors import FlashdraftError
from flashdraft.model.attention import LayerKind

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES.values())
# Fields of newer drafters that change the math; we implement output_multiplier and DFlash2's, and refuse
# the rest rather than silently computing something else (softcapping, scaled input embeddings).
UNSUPPORTED_FIELDS = ("final_logit_softcapping", "input_embedding_scale")
# DFlash2's dflash_config fields (docs/drafters.md §3) and the defaults `flashdraft init --arch dflash2` writes.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
LAYER_TYPE_NAMES = {"S": "sliding_attention", "F": "full_attention"}
DEFAULT_SLIDING_WINDOW = 2048


def parse_layer_types(items: list[str], where: str) -> list[str]:
    """HF `layer_types` from S/F shorthands or the full names; `where` names the flag or config field."""
    types = []
    for i, item in enumerate(items):
        name = LAYER_TYPE_NAMES.get(item.strip().upper(), item.strip())
        if name not in LAYER_TYPE_NAMES.values():
            raise FlashdraftError(
                f"{where}: entry {i} is {item!r}; expected S (sliding_attention) or F (full_attention)"
            )
        types.append(name)
    if not types:
        raise FlashdraftError(f"{where}: needs one entry per drafter layer")
    return types


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The paper's rule (docs/dflash.md §1): ids spread uniformly from layer 1 to layer L-3 (0-based, inclusive)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def default_gamma(block_size: int) -> float:
    """Loss decay γ of the paper (docs/dflash.md §3): 7 for B=16, 5 for B=10, 4 for B=8; scaled linearly otherwise."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 7.0 * block_size / 16))


def draft_value(config: Any, name: str, default: Any = None) -> Any:
    dflash = getattr(config, "dflash_config", None) or {}
    if name in dflash:
        return dflash[name]
    return getattr(config, name, default)


@dataclass(frozen=True)
class DFlashSpec:
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    output_multiplier: float = 1.0
    arch: str = "dflash"  # a key of ARCHITECTURES
    dflash2: dict[str, int] | None = None  # DFLASH2_FIELDS, for arch dflash2

    @classmethod
    def from_config(cls, config: PretrainedConfig, source: str = "drafter config") -> DFlashSpec:
        archs = getattr(config, "architectures", None) or []
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise FlashdraftError(
                f"{source}: architectures={archs} is not a DFlash drafter ({' or '.join(SUPPORTED_ARCHITECTURES)})"
            )
        arch = "dflash2" if ARCHITECTURES["dflash2"] in archs else "dflash"
        dflash2 = None
        if arch == "dflash2":
            dflash2 = {}
            for name in DFLASH2_FIELDS:
                value = draft_value(config, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise FlashdraftError(
                        f"{source}: DFlash2 drafter needs 'dflash_config.{name}' as a positive integer, got {value!r}"
                    )
                dflash2[name] = value
            if config.hidden_size % dflash2["conv_group_size"]:
                raise FlashdraftError(
                    f"{source}: 'dflash_config.conv_group_size'={dflash2['conv_group_size']} does not divide "
                    f"hidden_size={config.hidden_size}"
                )
            vocab = getattr(config, "vocab_size", None)
            if vocab is not None and dflash2["selector_top_k"] > vocab:
                raise FlashdraftError(
                    f"{source}: 'dflash_config.selector_top_k'={dflash2['selector_top_k']} exceeds vocab_size={vocab}"
                )
        else:
            for name in DFLASH2_FIELDS:
                if draft_value(config, name) is not None:
                    raise FlashdraftError(
                        f"{source}: field '{name}' belongs to DFlash2 drafters, but architectures={archs or '[]'}"
                    )
        for name in UNSUPPORTED_FIELDS:
            value = draft_value(config, name)
            if value not in (None, 1, 1.0, 0, 0.0):
                raise FlashdraftError(
                    f"{source}: field '{name}'={value!r} is not supported by flashdraft yet"
                )
        num_layers = getattr(config, "num_hidden_layers", None)
        num_target_layers = draft_value(config, "num_target_layers")
        if not isinstance(num_target_layers, int) or num_target_layers < 1:
            raise FlashdraftError(
                f"{source}: 'num_target_layers' is missing or not a positive integer ({num_target_layers!r})"
            )
        layer_ids = draft_value(config, "target_layer_ids")
        if layer_ids is None:
            layer_ids = build_target_layer_ids(num_target_layers, num_layers)
        if (
            not isinstance(layer_ids, (list, tuple))
            or not layer_ids
            or not all(isinstance(i, int) for i in layer_ids)
        ):
            raise FlashdraftError(
                f"{source}: 'dflash_config.target_layer_ids' must be a non-empty list of integers, got {layer_ids!r}"
            )
        bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
        if bad:
            raise FlashdraftError(
                f"{source}: 'dflash_config.target_layer_ids' has {bad}, outside the target's {num_target_layers} layers (0..{num_target_layers - 1})"
            )
        mask_token_id = draft_value(config, "mask_token_id")
        if not isinstance(mask_token_id, int):
            raise FlashdraftError(
                f"{source}: 'dflash_config.mask_token_id' is missing or not an integer ({mask_token_id!r})"
            )
        vocab = getattr(config, "vocab_size", None)
        if vocab is not None and not 0 <= mask_token_id < vocab:
            raise FlashdraftError(
                f"{source}: 'dflash_config.mask_token_id'={mask_token_id} is outside the vocabulary (0..{vocab - 1})"
            )
        block_size = draft_value(config, "block_size", 16)
        if not isinstance(block_size, int) or block_size < 2:
            raise FlashdraftError(f"{source}: 'block_size' must be an integer >= 2, got {block_size!r}")
        multiplier = draft_value(config, "output_multiplier", 1.0)
        return cls(
            block_size,
            mask_token_id,
            tuple(layer_ids),
            num_target_layers,
            float(multiplier or 1.0),
            arch,
            dflash2,
        )


def layer_kinds(config: PretrainedConfig, source: str = "drafter config") -> list[LayerKind]:
    """Per-layer attention kind (docs/dflash.md §1): full layers are non-causal; sliding layers are causal unless the
    config sets `is_causal`, and use `sliding_window`."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    if len(types) != n:
        raise FlashdraftError(f"{source}: 'layer_types' has {len(types)} entries for num_hidden_layers={n}")
    explicit_causal = getattr(config, "is_causal", None)
    kinds = []
    for i, t in enumerate(types):
        if t == "full_attention":
            causal = bool(explicit_causal) if explicit_causal is not None else False
            kinds.append(LayerKind(causal=causal, window=None))
        elif t == "sliding_attention":
            window = getattr(config, "sliding_window", None)
            if not isinstance(window, int) or window < 1:
                raise FlashdraftError(
                    f"{source}: layer {i} is 'sliding_attention' but 'sliding_window' is {window!r}"
                )
            causal = True if explicit_causal is None else bool(explicit_causal)
            kinds.append(LayerKind(causal=causal, window=window))
        else:
            raise FlashdraftError(
                f"{source}: 'layer_types[{i}]'={t!r}; expected full_attention or sliding_attention"
            )
    return kinds
