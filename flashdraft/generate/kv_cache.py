"""The one static KV cache of the decoding engines (docs/decoding.md, "The static KV cache").

Both the regeneration engine (`static.py`) and the fast speculative engine (`fast.py`) keep the target's
keys and values in per-layer buffers `[rows, KV heads, width, head dim]`, allocated once and written in
place, and hand them to the model as its cache. transformers' attention layers (5.17 and 5.24) call
`cache.update(key, value, layer_idx, ...)` and attend to what it returns when the caller passes explicit
position ids and a ready 4-D mask; nothing else of the cache is read.

- **Prefill**: inside `prefilling(rows, columns)` a row range's prompt keys go to a column range (the
  regeneration engine left-pads a chunk so that every prompt ends at one column; the fast engine writes
  one row's prompt at columns 0..P-1) and the prompt attends to its own keys alone.
- **Step**: each row's new keys go to its own columns, `columns` [rows, queries] (a device tensor the
  engine updates in place, so a CUDA graph replays at the current columns); attention sees the first
  `visible` columns (rounded up to a bucket by the engine, one graph per bucket).
- **Rollback**: nothing to undo for attention. A rejected draft's keys sit past its row's committed
  length: the next step's mask hides them and the row's next verify overwrites them.
- **Masks** (`step_masks`): a query sees every column up to its own position; in sliding-window layers
  only the last `window` of them (transformers' rule: query - key < window), so sliding layers keep every
  key and their mask does the windowing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from flashdraft.model.target import text_config

ATTENTION_KINDS = ("full_attention", "sliding_attention")


def attention_layers(config) -> list[int]:
    """Indices of the layers that keep keys and values (every layer unless `layer_types` names others)."""
    text = text_config(config)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers)
    return [i for i, kind in enumerate(kinds) if kind in ATTENTION_KINDS]


def step_masks(columns: Tensor, positions: Tensor, window: int | None) -> Tensor | dict[str, Tensor]:
    """Boolean masks [rows, 1, queries, columns] (True: attend) for queries at `positions` [rows, q] over
    cache `columns` [C] that hold positions 0..C-1: a query sees every key up to its own position; with a
    sliding `window`, one mask per layer type, the sliding one seeing only the last `window` positions."""
    queries = positions[:, None, :, None]
    full = columns[None, None, None, :] <= queries
    if window is None:
        return full
    return {"full_attention": full, "sliding_attention": full & (columns > queries - window)}


class StaticKVCache:
    """Every attention layer's keys and values, `[rows, KV heads, width, head dim]`, written in place (see
    the module doc). `queries`: how many keys a step writes per row (1 for plain decoding, B for a
    speculative verify)."""

    def __init__(
        self,
        config,
        rows: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        queries: int = 1,
        layer_views: bool = False,
    ):
        text = text_config(config)
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        shape = (rows, heads, width, head_dim)
        layers = int(text.num_hidden_layers)
        kept = set(attention_layers(config))
        self.keys: list[Tensor | None] = [
            torch.zeros(shape, dtype=dtype, device=device) if i in kept else None for i in range(layers)
        ]
        self.values: list[Tensor | None] = [
            torch.zeros(shape, dtype=dtype, device=device) if i in kept else None for i in range(layers)
        ]
        self.rows, self.width = rows, width
        self.columns = torch.zeros(rows, queries, dtype=torch.long, device=device)
        self.row_index = torch.arange(rows, device=device)[:, None]  # [rows, 1]: each row's own columns
        self.visible = width
        # a tensor whose length is the attended width (`LayerKV`); a view of it costs no kernel
        self._width_carrier = torch.empty(width, dtype=torch.bool, device=device)
        self._prefill: tuple[slice, slice] | None = None
        self.layer_views = layer_views

    @contextmanager
    def prefilling(self, rows: slice, columns: slice) -> Iterator[StaticKVCache]:
        """Within the block, `update` writes a prompt chunk of `rows` at `columns` and returns its own keys."""
        self._prefill = (rows, columns)
        try:
            yield self
        finally:
            self._prefill = None

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            raise ValueError(f"layer {layer_idx} is not an attention layer: it keeps no keys")
        if self._prefill is not None:
            rows, columns = self._prefill
            keys[rows, :, columns] = key
            values[rows, :, columns] = value
            return key, value
        return self._step_view(layer_idx).update(key, value)

    def _step_view(self, layer_idx: int) -> LayerKV:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        return LayerKV(keys, values, self.row_index, self.columns, self._width_carrier[: self.visible])

    def layer_view(self, layer_idx: int) -> LayerKV | None:
        """In a step, the cache of one attention layer for a compiled decoder layer (distributed/parallelize.py,
        `compile_for_decoding`); None when prefilling or when views are off (the layer then runs eagerly)."""
        if not self.layer_views or self._prefill is not None or self.keys[layer_idx] is None:
            return None
        return self._step_view(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly


class LayerKV:
    """One attention layer's keys and values in a step: its buffers, the columns the step writes (every
    row's, an idle row's too, whose columns may lie past the attended width) and `attended`, a tensor whose
    length is the attended width. `update` ignores the layer index it is given, so a compiled decoder
    layer reads no per-layer integer and one graph serves every layer of a kind; the width comes as a
    tensor's length, not an int, because dynamo makes a tensor's size dynamic when it changes (one graph
    then serves every width) but keeps an int attribute constant (docs/decoding.md, "Compiled steps")."""

    def __init__(self, keys: Tensor, values: Tensor, rows: Tensor, columns: Tensor, attended: Tensor):
        self.keys, self.values, self.attended = keys, values, attended
        self.rows, self.columns = rows, columns  # [rows, 1] and [rows, queries]: where the new keys go

    def update(self, key: Tensor, value: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # an indexed write in place (index_put_): compiled, it writes into the buffer itself, where a
        # scatter_ compiles to a copy of the whole buffer and a write back
        self.keys[self.rows, :, self.columns] = key.transpose(1, 2)
        self.values[self.rows, :, self.columns] = value.transpose(1, 2)
        width = self.attended.shape[0]
        return self.keys[:, :, :width], self.values[:, :, :width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
