"""Each row's Gated DeltaNet state on the fast engine: static per-row buffers and an exact ragged rollback
after a verify (docs/decoding.md, "The fast engine").

A Gated DeltaNet layer (Qwen3.5, Qwen3.6, Qwen3-Next) keeps two states per sequence: its causal
convolution's last K projected inputs `[C, K]` and the delta rule's recurrent matrix per value head
`[H, dk, dv]`. A verify advances them over all B block positions of every row; after acceptance each row
must hold the state of exactly its own kept positions, and rows keep different counts. Both are settled in
one batched pass of fixed shape (a CUDA graph holds it), with no host sync:

- **conv state**: the verify hands the cache its block's projected inputs; the cache keeps the window
  [old K columns, B new columns] of each row, and the row's new state is that window's columns
  kept .. kept + K (a gather: exact).
- **recurrent state**: the verify's call of the chunked delta rule (the model module's
  `torch_chunk_gated_delta_rule`, which dispatches to fla's kernel on a GPU where it is installed) is
  recorded with its arguments; after acceptance it is called once more from the same initial state with
  the decay g and the write strength beta set to 0 at each row's positions past its kept count. A position
  with g = 0 and beta = 0 leaves the state as it is (multiplied by exp(0) = 1, written with strength 0),
  so each row ends with the state of exactly its kept positions: the same zero padding the chunked rule
  applies itself to fill its last chunk.

The cache speaks both transformers interfaces of these layers: 5.24's `get_conv_state` /
`get_recurrent_state` / `is_recording_past` and 5.17's `has_previous_state` / `cache.layers[i]`, and both
use `update_conv_state` / `update_recurrent_state`. During a row's prefill it answers "no previous state",
so the prompt runs exactly as on a fresh transformers cache, and the row's states are written whole.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashdraft.errors import FlashdraftError
from flashdraft.generate.kv_cache import StaticKVCache
from flashdraft.model.target import TargetModel, recurrent_mixer, text_config

DELTA_RULE = "torch_chunk_gated_delta_rule"  # the modeling module's chunked rule, replayed for rollback
_MIXER_SIZES = ("layer_idx", "conv_dim", "conv_kernel_size", "num_v_heads", "head_k_dim", "head_v_dim")


def linear_layers(config) -> list[int]:
    """Indices of the layers whose type is `linear_attention`."""
    kinds = getattr(text_config(config), "layer_types", None) or []
    return [i for i, kind in enumerate(kinds) if kind == "linear_attention"]


def linear_mixers(target: TargetModel) -> dict[int, nn.Module]:
    """Each linear-attention layer's mixer module (the one that takes the cache), by layer index."""
    return {index: recurrent_mixer(target, index) for index in linear_layers(target.config)}


def unsupported_reason(target: TargetModel) -> str | None:
    """Why the fast engine cannot hold this target's linear-attention states (None: it can): every linear
    layer must be a Gated DeltaNet mixer with the usual sizes, whose module defines the chunked delta rule
    that the rollback replays."""
    for index in linear_layers(target.config):
        try:
            mixer = recurrent_mixer(target, index)
        except FlashdraftError:
            return f"its layer {index} keeps a recurrent state, but not in one module that takes the cache"
        name = type(mixer).__name__
        if not name.endswith("GatedDeltaNet"):
            return f"its layer {index} mixes with {name}: the fast engine holds Gated DeltaNet states only"
        missing = [size for size in _MIXER_SIZES if not hasattr(mixer, size)]
        if missing:
            return f"its layer {index}'s {name} has no {', '.join(missing)}"
        if mixer.layer_idx != index:
            return f"its layer {index}'s {name} calls itself layer {mixer.layer_idx}"
        if not callable(getattr(sys.modules.get(type(mixer).__module__), DELTA_RULE, None)):
            return f"{type(mixer).__module__} has no {DELTA_RULE} (the rollback replays it)"
    return None


@dataclass
class _LinearLayer:
    """One linear layer's states where transformers 5.17 reads them (`cache.layers[i]`)."""

    conv_states: dict[int, Tensor]
    recurrent_states: dict[int, Tensor]
    record_past: bool = False


def _first_state_only(state_idx: int | None) -> None:
    if state_idx not in (None, 0):
        raise ValueError(
            f"state {state_idx}: the fast engine holds one conv and one recurrent state per layer"
        )


class StaticHybridCache(StaticKVCache):
    """The static KV cache of the attention layers plus, per Gated DeltaNet layer, `conv` [rows, C, K] (the
    model's dtype) and `recurrent` [rows, H, dk, dv] (fp32, as the delta rule returns it). A step's
    forward inside `verifying()` leaves both unchanged; `commit(kept)` then gives each row the state of its
    first `kept` positions (see the module doc). Outside `verifying()` (a one-token step) the model updates
    them in place."""

    def __init__(
        self,
        config,
        mixers: dict[int, nn.Module],
        rows: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        queries: int = 1,
    ):
        super().__init__(config, rows, width, dtype, device, queries=queries)
        self.conv = {
            i: torch.zeros(rows, m.conv_dim, m.conv_kernel_size, dtype=dtype, device=device)
            for i, m in mixers.items()
        }
        self.recurrent = {
            i: torch.zeros(
                rows, m.num_v_heads, m.head_k_dim, m.head_v_dim, dtype=torch.float32, device=device
            )
            for i, m in mixers.items()
        }
        layers = int(text_config(config).num_hidden_layers)
        self.layers = [
            _LinearLayer({0: self.conv[i]}, {0: self.recurrent[i]}) if i in mixers else None
            for i in range(layers)
        ]
        self._rule_modules = {sys.modules[type(m).__module__] for m in mixers.values()}
        self._verifying = False
        self._windows: dict[int, Tensor] = {}  # layer -> [rows, C, K + B]: old conv state, then the block's
        self._calls: dict[int, tuple[Callable, tuple, dict]] = {}  # layer -> its delta-rule call
        self._pending: list[tuple[Callable, tuple, dict]] = []

    # -- a row's prompt --------------------------------------------------------------------------------
    @contextmanager
    def prefilling(self, rows: slice, columns: slice) -> Iterator[StaticHybridCache]:
        """As the KV cache's, and the rows' linear states start from zero: a refilled row forgets its last
        prompt (the prefill then writes every state whole)."""
        for state in (*self.conv.values(), *self.recurrent.values()):
            state[rows].zero_()
        with super().prefilling(rows, columns):
            yield self

    # -- what transformers' Gated DeltaNet layers call -------------------------------------------------
    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        _first_state_only(state_idx)
        return self._prefill is None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """transformers 5.25: how many intermediate recurrent states a chunked forward should return for
        a rollback. None: this cache rolls a verify back by its own replay (`commit`)."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers 5.25 counts a linear layer's tokens through this; positions here are always
        passed explicitly (`get_seq_length` is 0), so there is nothing to count."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        _first_state_only(state_idx)
        return None if self._prefill is not None else self.conv[layer_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        _first_state_only(state_idx)
        return None if self._prefill is not None else self.recurrent[layer_idx]

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        """The convolution's input with its left context: a prompt as transformers pads it on a fresh
        cache, a block after its row's conv state."""
        _first_state_only(state_idx)
        state = self.conv[layer_idx]
        kernel = state.shape[-1]
        if self._prefill is not None:
            rows, _ = self._prefill
            if conv_states.shape[-1] < kernel:
                conv_states = F.pad(conv_states, (kernel - conv_states.shape[-1], 0))
            state[rows] = conv_states[..., -kernel:]
            return conv_states
        window = torch.cat([state, conv_states.to(state.dtype)], dim=-1)
        if self._verifying:
            self._windows[layer_idx] = window  # `commit` cuts each row's state from it
        else:
            state.copy_(window[..., -kernel:])
        return window

    def update_recurrent_state(
        self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> Tensor:
        _first_state_only(state_idx)
        state = self.recurrent[layer_idx]
        if self._prefill is not None:
            rows, _ = self._prefill
            state[rows] = recurrent_states
            return state[rows]
        if self._verifying:  # keep the state before the block: `commit` replays the rule from it
            if not self._pending:
                raise RuntimeError(
                    f"layer {layer_idx} updated its recurrent state without calling {DELTA_RULE}: "
                    "the fast engine cannot roll it back"
                )
            self._calls[layer_idx] = self._pending.pop()
            return recurrent_states
        state.copy_(recurrent_states)
        return state

    # -- a verify and its rollback ---------------------------------------------------------------------
    @contextmanager
    def verifying(self) -> Iterator[None]:
        """Around a forward over a block of several positions per row: the linear states stay as they were,
        and each layer's conv window and delta-rule call are kept for `commit`."""
        self._windows, self._calls, self._pending = {}, {}, []
        originals = {module: getattr(module, DELTA_RULE) for module in self._rule_modules}

        def recording(rule: Callable) -> Callable:
            def record(*args, **kwargs):
                if not {"g", "beta"} <= set(kwargs):  # the replay masks them by name
                    raise RuntimeError(f"{DELTA_RULE} was called without g= and beta= keywords")
                self._pending.append((rule, args, kwargs))
                return rule(*args, **kwargs)

            return record

        for module, rule in originals.items():
            setattr(module, DELTA_RULE, recording(rule))
        self._verifying = True
        try:
            yield
        finally:
            self._verifying = False
            for module, rule in originals.items():
                setattr(module, DELTA_RULE, rule)
        missing = sorted(set(self.conv) - (set(self._calls) & set(self._windows)))
        if missing:
            raise RuntimeError(
                f"layers {missing} did not pass their block through update_conv_state and {DELTA_RULE}: "
                "the fast engine cannot roll their states back"
            )

    def commit(self, kept: Tensor) -> None:
        """After a verify: each row's linear states become those after its first `kept[row]` block positions
        (0: unchanged), whatever the other rows kept."""
        for index, (rule, args, kwargs) in self._calls.items():
            g, beta = kwargs["g"], kwargs["beta"]  # [rows, B, heads]
            steps = torch.arange(g.shape[1], device=kept.device)
            dropped = (steps[None, :] >= kept[:, None])[..., None]
            replay = {**kwargs, "g": g.masked_fill(dropped, 0.0), "beta": beta.masked_fill(dropped, 0.0)}
            _, state = rule(*args, **{**replay, "output_final_state": True})
            self.recurrent[index].copy_(state)
            conv, window = self.conv[index], self._windows[index]
            columns = kept[:, None] + torch.arange(conv.shape[-1], device=kept.device)
            conv.copy_(window.gather(2, columns[:, None, :].expand(-1, conv.shape[1], -1)))
        self._windows, self._calls = {}, {}
