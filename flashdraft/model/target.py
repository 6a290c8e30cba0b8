"""The frozen target model: any Hugging Face causal LM from a local directory (or a GGUF file, converted
once: docs/real-target.md), with layer capture.

Features are the outputs of decoder layers `target_layer_ids`, i.e. HF `hidden_states[id + 1]`
(docs/dflash.md §1; §4 trap 4). They are captured with forward hooks, so only the
chosen layers are kept, and the forward stops after the last needed layer when no logits are needed.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from flashdraft.errors import FlashdraftError
from flashdraft.model.gguf import target_directory


def default_dtype(device: str | torch.device) -> torch.dtype:
    """The compute dtype flashdraft uses where the user does not choose one: bf16 on a GPU, fp32 on the CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def check_safetensors_weights(path: str | Path) -> None:
    """Refuse a target whose weights exist only as pickled `pytorch_model.bin`: unpickling can run code, so
    flashdraft loads safetensors only, and says how to convert (else torch's weights_only traceback)."""
    path = target_directory(path)
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return
    found = [name for name in _PICKLE_WEIGHTS if (path / name).is_file()]
    if found:
        raise FlashdraftError(
            f"target {path}: its weights are only {found[0]} (a pickle, which flashdraft does not load); "
            'convert them to safetensors once, if you trust the file: python -c "from transformers import '
            f"AutoModelForCausalLM as M; M.from_pretrained('{path}').save_pretrained('{path}-safetensors')\" "
            "and copy the tokenizer files beside the result"
        )


class _StopForward(Exception):
    """Raised by the capture hook after the last needed layer; caught by TargetModel."""


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a (possibly multimodal) config, e.g. Qwen3.5's text_config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_target_config(path: str | Path) -> PretrainedConfig:
    path = target_directory(path)
    if not (path / "config.json").is_file():
        raise FlashdraftError(
            f"target {path}: no config.json there (expected a local Hugging Face model directory)"
        )
    try:
        return text_config(AutoConfig.from_pretrained(path))
    except (ValueError, OSError, KeyError) as exc:
        raise FlashdraftError(f"target {path}/config.json: {exc}") from None


def load_target_tokenizer(path: str | Path, *, required: bool = False):
    """The target's own tokenizer (and chat template), or None when the directory ships none."""
    path = target_directory(path)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        if required:
            raise FlashdraftError(
                f"target {path}: no tokenizer files there (tokenizer.json / tokenizer_config.json)"
            )
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        raise FlashdraftError(f"target {path}: cannot load its tokenizer ({exc})") from None


def load_causal_lm(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    attention: str | None = None,
) -> nn.Module:
    """The target's weights as a Hugging Face causal LM in eval mode on `device`: the one loader every
    command uses (training, eval, regeneration, the benches). `dtype` None: `default_dtype(device)`;
    `attention`: an `attn_implementation` (e.g. "sdpa"), None for transformers' own choice. A GGUF target
    loads from its converted copy."""
    path = target_directory(path)
    load_target_config(path)  # clear error for a missing or broken directory
    check_safetensors_weights(path)
    if dtype is None:
        dtype = default_dtype(device)
    extra: dict[str, Any] = {} if attention is None else {"attn_implementation": attention}
    if torch.device(device).type == "cuda":
        # Straight onto a GPU (device_map): the target never passes whole through host memory. On the
        # CPU there is nothing to skip, and no accelerate-era loading path to depend on.
        extra["device_map"] = {"": torch.device(device)}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    except (ValueError, OSError) as exc:
        raise FlashdraftError(f"target {path}: cannot load as a causal LM: {exc}") from None
    return model.eval()


def _decoder(model: nn.Module, num_layers: int) -> tuple[nn.ModuleList, nn.Module | None]:
    """The decoder-layer list and the final norm, found by structure rather than by model family."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    candidates = [base] if base is not None else []
    candidates += [m for m in model.modules() if hasattr(m, "layers")]
    for module in candidates:
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) >= num_layers:
            return layers, getattr(module, "norm", None)
    raise FlashdraftError(
        f"target {type(model).__name__}: could not find its list of {num_layers} decoder layers"
    )


class TargetModel:
    """A frozen causal LM with feature capture. Not an nn.Module: it is never trained or wrapped."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | tuple[int, ...], name: str = "target"):
        self.model = model.eval().requires_grad_(False)
        self.name = name
        self.config = text_config(model.config)
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.layers, self.final_norm = _decoder(model, self.num_layers)
        self.embed_weight: Tensor = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        if head is None:
            raise FlashdraftError(f"{name}: {type(model).__name__} has no LM head (not a causal LM?)")
        self.lm_head_weight: Tensor = head.weight
        self.vocab_size = int(self.lm_head_weight.shape[0])
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.set_layer_ids(layer_ids)

    @classmethod
    def load(
        cls, path: str | Path, layer_ids, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> TargetModel:
        path = target_directory(path)  # a GGUF target: its converted copy (docs/real-target.md)
        return cls(load_causal_lm(path, device, dtype), layer_ids, name=f"target {path}")

    def set_layer_ids(self, layer_ids) -> None:
        layer_ids = list(layer_ids)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise FlashdraftError(
                f"{self.name}: target_layer_ids {bad} are outside its {self.num_layers} layers"
            )
        self.layer_ids = layer_ids

    def close(self) -> None:
        """Before the process group is destroyed: let go of whatever holds one of its groups (a whole target
        holds none; `GroupTarget` does)."""

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def embed(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.embed_weight)

    def _run_with_capture(self, stop_early: bool, **forward_kwargs):
        captured: dict[int, Tensor] = {}
        last = max(self.layer_ids)
        handles = []

        def hook_for(index: int):
            def hook(_module, _inputs, output):
                hidden = output[0] if isinstance(output, tuple) else output
                if index == self.num_layers - 1 and self.final_norm is not None:
                    # HF's last hidden_states entry is after the final norm; keep that meaning.
                    hidden = self.final_norm(hidden)
                captured[index] = hidden
                if stop_early and index == last:
                    raise _StopForward

            return hook

        for index in sorted(set(self.layer_ids)):
            handles.append(self.layers[index].register_forward_hook(hook_for(index)))
        output = None
        try:
            output = self.model(**forward_kwargs)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        features = torch.cat([captured[i] for i in self.layer_ids], dim=-1)
        return output, features

    @torch.no_grad()
    def features(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Concatenated features [b, S, n_feat*H] for teacher-forced sequences (no logits computed).

        `position_ids` restarting at 0 mark packed samples: with no attention mask and no cache, transformers
        builds a mask that keeps each sample to itself (docs/packing.md)."""
        _, features = self._run_with_capture(
            stop_early=True,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        return features

    @torch.no_grad()
    def forward_cached(
        self, input_ids: Tensor, position_ids: Tensor, cache: DecodingCache, logits_to_keep: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Logits and features of `input_ids` appended to `cache` (decoding: prefill and verify).
        Follow it with `cache.keep(...)`, which says how many of the new positions stay."""
        kwargs = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "use_cache": True,
            "logits_to_keep": logits_to_keep,
            self._cache_kwarg: cache.cache,
        }
        with cache.recording(input_ids.shape[1]):
            output, features = self._run_with_capture(stop_early=False, **kwargs)
        return output.logits, features


# The names a transformers module's forward takes its cache by (they changed across versions).
CACHE_PARAMETERS = ("cache", "cache_params", "past_key_values")


def recurrent_mixer(target: TargetModel, index: int) -> nn.Module:
    """The module of decoder layer `index` that advances its recurrent state: the one child whose forward
    takes the cache (Qwen3.5/Qwen3-Next: `linear_attn`, called with `cache=` or `cache_params=`)."""
    found = [
        child
        for child in target.layers[index].children()
        if any(p in inspect.signature(child.forward).parameters for p in CACHE_PARAMETERS)
    ]
    if len(found) != 1:
        raise FlashdraftError(
            f"{target.name}: layer {index} keeps a recurrent (linear-attention) state, but flashdraft cannot "
            f"tell which of its modules updates it ({len(found)} take the cache), so a rejected draft could "
            "not be rolled back; evaluate this target with SGLang or vLLM"
        )
    return found[0]


def _shorten(value: Any, length: int, keep: int) -> Any:
    """`value` (a captured forward argument) cut from `length` sequence positions to the first `keep`."""
    if isinstance(value, Tensor):
        if value.dim() == 1 and value.shape[0] == length:
            return value[:keep]
        if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == length:
            return value[:, :keep]
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_shorten(v, length, keep) for v in value)
    return value


class DecodingCache:
    """The target's cache for speculative decoding, rolled back exactly after a rejected draft
    (docs/decoding.md).

    Attention layers are cropped; sliding-window layers record past keys until the crop, so they can be
    cropped after the sequence passes the window. Recurrent (linear-attention) layers cannot be cropped
    (transformers' `crop` does not restore a recurrent state): before each verify their conv and recurrent
    states are copied and their mixer's inputs recorded; after a partial acceptance the copy is restored
    and the mixer re-run over the accepted positions only, which advances the states exactly as if the
    rejected tokens had never been seen (the mixer's inputs at accepted positions do not depend on later
    positions: every layer is causal).
    """

    def __init__(self, target: TargetModel):
        self.cache = DynamicCache(config=target.model.config)
        self._mixers: dict[int, nn.Module] = {}
        for index, layer in enumerate(self.cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                if isinstance(layer, DynamicLayer):
                    raise FlashdraftError(
                        f"{target.name}: layer {index} ({type(layer).__name__}) holds attention keys and a "
                        "recurrent state in one layer, which flashdraft cannot roll back after a rejected "
                        "draft; evaluate this target with SGLang or vLLM"
                    )
                self._mixers[index] = recurrent_mixer(target, index)
            elif isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()  # else `crop` raises once the window is full
            elif not isinstance(layer, DynamicLayer) and type(layer).__name__ != "DummyLayer":
                raise FlashdraftError(
                    f"{target.name}: layer {index} uses a {type(layer).__name__} cache, which flashdraft does "
                    "not know how to roll back after a rejected draft; evaluate this target with SGLang or vLLM"
                )
        self._saved: dict[int, tuple[dict[int, Tensor], ...]] = {}  # conv, recurrent states by slot
        self._counted: dict[int, Tensor] = {}  # linear layers' token counts (transformers 5.25)
        self._inputs: dict[int, tuple[tuple, dict]] = {}
        self._length = 0  # positions in the last forward
        self._prefilled = False  # the first forward (the prompt) is always kept whole

    @property
    def has_recurrent_layers(self) -> bool:
        return bool(self._mixers)

    @contextmanager
    def recording(self, length: int) -> Iterator[None]:
        """Around a forward over `length` new positions: keep what a rollback of them needs."""
        self._saved, self._inputs, self._length = {}, {}, length
        self._counted: dict[int, Tensor] = {}
        if not self._mixers or length == 1 or not self._prefilled:
            yield  # nothing to roll back: the prompt and a single position are always kept
            return
        handles = []
        for index, mixer in self._mixers.items():
            layer = self.cache.layers[index]
            self._saved[index] = tuple(
                {slot: state.clone() for slot, state in states.items() if state is not None}
                for states in (layer.conv_states, layer.recurrent_states)
            )
            # transformers 5.25 counts a linear layer's tokens (its get_seq_length); the replay recounts
            counted = getattr(layer, "cumulative_length_linear", None)
            if isinstance(counted, Tensor):
                self._counted[index] = counted.clone()

            def record(_module, args, kwargs, index=index):
                self._inputs[index] = (args, kwargs)

            handles.append(mixer.register_forward_pre_hook(record, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def keep(self, kept: int) -> None:
        """Keep the first `kept` positions of the last forward and forget the rest."""
        removed = self._length - kept
        if removed < 0:
            raise ValueError(f"keep({kept}) after a forward over {self._length} positions")
        for index, layer in enumerate(self.cache.layers):
            if index in self._mixers or not isinstance(layer, DynamicLayer):
                continue
            if removed or isinstance(layer, DynamicSlidingWindowLayer):
                layer.crop(-removed)  # crop(0) trims a sliding layer back to its window
        if removed and self._saved:
            for index, (conv, recurrent) in self._saved.items():
                layer = self.cache.layers[index]
                for states, saved in ((layer.conv_states, conv), (layer.recurrent_states, recurrent)):
                    for slot, state in saved.items():
                        states[slot].copy_(state)
                if index in self._counted:
                    layer.cumulative_length_linear.copy_(self._counted[index])
                if kept:
                    args, kwargs = self._inputs[index]
                    self._mixers[index](
                        *_shorten(args, self._length, kept),
                        **{k: _shorten(v, self._length, kept) for k, v in kwargs.items()},
                    )
        self._saved, self._inputs, self._length, self._prefilled = {}, {}, kept, True
