"""Loading only this rank's shard of a tensor-parallel target (docs/distributed.md "Target tensor
parallelism", loading).

The model is first built without memory (on the meta device, from its config, with the class, dtype and
attention implementation a normal `from_pretrained` load picks), the caller's plan splits its layers there,
and then every parameter is made real on this rank's device holding only its own shard, read from the
checkpoint's safetensors files as a slice: a rank reads the bytes of its shard and nothing more of a split
weight. Replicated parameters (embedding, LM head, norms, the small Gated-DeltaNet parts) are read whole.

What a normal load would do differently is refused with `ShardLoadUnsupported` (its message says why),
and the caller falls back to loading the whole model (as it does for a GGUF target): a checkpoint without
safetensors, a quantized one, checkpoint names that are neither the model's own nor its text model's inside a multimodal
wrapper (`model.language_model.`), a weight transformers converts on load, or a buffer it cannot recompute.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import AutoConfig, AutoModelForCausalLM

from flashdraft.errors import FlashdraftError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
WRAPPED_TEXT_PREFIX = "model.language_model."  # a multimodal wrapper's text model (Qwen3.5/3.6 checkpoints)


class ShardLoadUnsupported(Exception):
    """The shard-only load cannot reproduce a normal load of this target; the message says why."""


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint in `path` and the safetensors file holding it."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except json.JSONDecodeError as exc:
            raise FlashdraftError(f"{index}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        except (KeyError, TypeError):
            raise FlashdraftError(f"{index}: has no 'weight_map' object") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FlashdraftError(f"{index}: names {file.name}, which is not in {path}")
        return files
    single = path / SINGLE_NAME
    if not single.is_file():
        raise ShardLoadUnsupported(f"no {SINGLE_NAME} or {INDEX_NAME} in {path}")
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def empty_model(path: Path, dtype: torch.dtype) -> nn.Module:
    """The model `TargetModel.load` would build (same Auto class, config, dtype and attention choice),
    with every tensor on the meta device: no memory, no initialisation."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


def checkpoint_names(model: nn.Module, available: set[str]) -> dict[str, str]:
    """Each state-dict name of `model` -> its name in the checkpoint. The plain case (the same names) and a
    multimodal wrapper's text model (`model.language_model.X` for the model's `model.X`) are supported;
    tied weights need only one of their names in the checkpoint."""
    wanted = list(model.state_dict(keep_vars=True))
    tied = _tied_names(model)
    first_missing = None
    for rename in (_same, _wrapped_text):
        names = {key: rename(key) for key in wanted}
        missing = [key for key in wanted if not any(names[n] in available for n in tied.get(key, [key]))]
        if not missing:
            _check_transformers_agrees(model, names, available)
            return names
        first_missing = first_missing or missing[0]
    raise ShardLoadUnsupported(
        f"the checkpoint has no tensor named {first_missing!r} (nor {_wrapped_text(first_missing)!r}): "
        "its names are not the model's own"
    )


def _same(key: str) -> str:
    return key


def _wrapped_text(key: str) -> str:
    return WRAPPED_TEXT_PREFIX + key.removeprefix("model.") if key.startswith("model.") else key


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """name -> all names of the same parameter (tied embeddings: the LM head IS the embedding)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {name: group for group in groups.values() for name in group}


def _check_transformers_agrees(model: nn.Module, names: dict[str, str], available: set[str]) -> None:
    """Where this transformers exposes its load-time renaming, check it maps every checkpoint name we read
    to the same model name and converts none of their values (a converted weight would differ)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError):
        return  # an older or newer transformers without it: the names checked above are what we have
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if len(renamings) + len(converters) != len(transforms):
        raise ShardLoadUnsupported(
            f"transformers applies a transform of a kind flashdraft does not know: {transforms}"
        )
    for key, source in names.items():
        if source not in available:
            continue  # a tied name the checkpoint omits
        try:
            renamed, converter = rename_source_key(source, renamings, converters)
        except TypeError:
            return  # another signature than 5.24's: the names checked above are what we have
        if converter is not None:
            raise ShardLoadUnsupported(f"transformers converts the checkpoint's {source!r} on load")
        if renamed != key:
            raise ShardLoadUnsupported(
                f"transformers loads the checkpoint's {source!r} as {renamed!r}, not as {key!r}"
            )


def shard_bounds(full: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of `parts` of a dimension of length `full`, cut as DTensor's Shard cuts (torch.chunk)."""
    size = math.ceil(full / parts)
    start = min(index * size, full)
    return start, min(start + size, full)


def _module_and_leaf(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, leaf = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), leaf


def recompute_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (RoPE's inv_freq and the like) are computed at init, not saved: give them
    memory on `device` and let transformers compute them as its own load does (its `_init_weights` of the
    owning module). Each is filled with NaN first, so one left uncomputed is caught."""
    owners: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        for leaf in module._non_persistent_buffers_set:
            buffer = module._buffers.get(leaf)
            if buffer is None:
                continue
            if not buffer.is_floating_point():
                raise ShardLoadUnsupported(f"cannot recompute the integer buffer {name}.{leaf}")
            module._buffers[leaf] = torch.full(buffer.shape, math.nan, dtype=buffer.dtype, device=device)
            owners[name] = module
    init = getattr(model, "_init_weights", None)
    if owners and init is None:
        raise ShardLoadUnsupported(f"{type(model).__name__} has no _init_weights to compute its buffers")
    with torch.no_grad():
        for module in owners.values():
            init(module)
    for name, module in owners.items():
        for leaf in module._non_persistent_buffers_set:
            if leaf in module._buffers and module._buffers[leaf].isnan().any():
                raise ShardLoadUnsupported(f"transformers did not recompute the buffer {name}.{leaf}")


class _Reader:
    """Reads named tensors, whole or as one slice along one dimension, from the checkpoint's files
    (each opened once). `read` is the one place checkpoint bytes come from (the tests count them)."""

    def __init__(self, files: dict[str, Path], stack: ExitStack):
        self.files = files
        self.stack = stack
        self.handles: dict[Path, object] = {}

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(safe_open(str(file), framework="pt"))
        return self.handles[file]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> Tensor:
        if dim is None:
            return self._handle(name).get_tensor(name)
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._handle(name).get_slice(name)[index]


def _own_copy(view: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """`view` (a slice of safetensors' memory map of the whole tensor) copied into memory of its own on
    `device`: one allocation of the slice's size; only the slice's bytes of the file are read, and
    nothing keeps the map of the whole tensor alive."""
    return torch.empty(view.shape, dtype=dtype, device=device).copy_(view)


def _materialise(param: nn.Parameter, source: str, reader: _Reader, device: torch.device) -> nn.Parameter:
    """`param` (on meta, maybe a DTensor) made real on `device` from the checkpoint's tensor `source`."""
    if list(param.shape) != reader.shape(source):
        raise ShardLoadUnsupported(
            f"the checkpoint's {source!r} has shape {reader.shape(source)}, "
            f"the model expects {list(param.shape)}"
        )
    if not isinstance(param, DTensor):
        return nn.Parameter(
            _own_copy(reader.read(source), param.dtype, device), requires_grad=param.requires_grad
        )
    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or not isinstance(placements[0], (Shard, Replicate)):
        raise ShardLoadUnsupported(f"{source!r} is placed as {placements} (only Shard/Replicate on one axis)")
    placement = placements[0]
    if isinstance(placement, Replicate):
        local = reader.read(source)
    else:
        start, stop = shard_bounds(param.shape[placement.dim], mesh.size(), mesh.get_local_rank())
        local = reader.read(source, placement.dim, start, stop)
    local = _own_copy(local, param.dtype, device)
    if local.shape != param.to_local().shape:  # our cut must be DTensor's own
        raise ShardLoadUnsupported(
            f"{source!r}: shard {list(local.shape)} is not DTensor's {param.to_local().shape}"
        )
    value = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return nn.Parameter(value, requires_grad=param.requires_grad)


def load_sharded(
    path: str | Path, dtype: torch.dtype, device: torch.device, shard: Callable[[nn.Module], None]
) -> nn.Module:
    """The target at `path`, split by `shard` (which applies the tensor-parallel plan to the meta model),
    with each parameter holding only this rank's shard on `device`. Raises `ShardLoadUnsupported` (before
    any weight is read) where a normal load would do something this cannot reproduce."""
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None) is not None:
        raise ShardLoadUnsupported("the checkpoint is quantized (transformers dequantizes it on load)")
    files = checkpoint_files(path)
    model = empty_model(path, dtype)
    names = checkpoint_names(model, set(files))
    recompute_buffers(model, device)
    shard(model)
    params: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(param), (param, []))[1].append(name)
    with ExitStack() as stack:
        reader = _Reader(files, stack)
        for param, group in params.values():
            source = next(names[n] for n in group if names[n] in files)
            real = _materialise(param, source, reader, device)
            # Every name of a tied weight gets the same parameter, as a normal load ties them.
            for name in group:
                module, leaf = _module_and_leaf(model, name)
                module._parameters[leaf] = real
        for name, buffer in list(model.named_buffers()):
            if buffer.is_meta:  # a persistent buffer: saved in the checkpoint, replicated
                module, leaf = _module_and_leaf(model, name)
                module._buffers[leaf] = _own_copy(reader.read(names[name]), buffer.dtype, device)
    return model.eval()
