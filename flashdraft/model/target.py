"""The frozen target model: any Hugging Face causal LM from a local directory, with layer capture.

Features are the outputs of decoder layers `target_layer_ids`, i.e. HF `hidden_states[id + 1]`
(../shared/reference/dflash.md §1.3, §8 item 1). They are captured with forward hooks, so only the
chosen layers are kept, and the forward stops after the last needed layer when no logits are needed.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from flashdraft.errors import FlashdraftError


class _StopForward(Exception):
    """Raised by the capture hook after the last needed layer; caught by TargetModel."""


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model part of a (possibly multimodal) config, e.g. Qwen3.5's text_config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_target_config(path: str | Path) -> PretrainedConfig:
    path = Path(path)
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
    path = Path(path)
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
        path = Path(path)
        load_target_config(path)  # clear error for a missing or broken directory
        if dtype is None:
            dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except (ValueError, OSError) as exc:
            raise FlashdraftError(f"target {path}: cannot load as a causal LM: {exc}") from None
        return cls(model.to(device), layer_ids, name=f"target {path}")

    def set_layer_ids(self, layer_ids) -> None:
        layer_ids = list(layer_ids)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise FlashdraftError(
                f"{self.name}: target_layer_ids {bad} are outside its {self.num_layers} layers"
            )
        self.layer_ids = layer_ids

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
    def features(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Concatenated features [b, S, n_feat*H] for teacher-forced sequences (no logits computed)."""
        _, features = self._run_with_capture(
            stop_early=True, input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        )
        return features

    @torch.no_grad()
    def forward_cached(
        self, input_ids: Tensor, position_ids: Tensor, cache, logits_to_keep: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Logits and features of `input_ids` appended to `cache` (decoding: prefill and verify)."""
        kwargs = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "use_cache": True,
            "logits_to_keep": logits_to_keep,
            self._cache_kwarg: cache,
        }
        output, features = self._run_with_capture(stop_early=False, **kwargs)
        return output.logits, features
