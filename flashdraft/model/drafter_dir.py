"""The drafter directory: `config.json` + `model.safetensors`, as z-lab's released drafters ship them.

Fields and tensor names follow docs/dflash.md §2 so that z-lab's reference code,
SGLang and vLLM load a flashdraft directory as it is, and flashdraft loads theirs. Anything unknown or
inconsistent is an error naming the field or tensor, never silently random weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from flashdraft.durable import atomic_directory, atomic_write_text
from flashdraft.errors import FlashdraftError
from flashdraft.model.dflash2 import DFlash2DraftModel
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.spec import (
    ARCHITECTURES,
    DEFAULT_SLIDING_WINDOW,
    DFLASH2_DEFAULTS,
    DFlashSpec,
    build_target_layer_ids,
    layer_kinds,
)
from flashdraft.outputs import check_output_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def weights_sha256(directory: str | Path) -> str:
    """The sha256 of a drafter directory's weights, which exact weights a run started from: over each
    tensor's name, dtype, shape and bytes in name order, not over the file, whose header safetensors writes
    in an order that changes from process to process."""
    digest = hashlib.sha256()
    with safe_open(Path(directory) / WEIGHTS_NAME, "pt") as weights:
        for name in sorted(weights.keys()):
            tensor = weights.get_tensor(name).contiguous()
            digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}\n".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# Rope types a Qwen3-style drafter can carry over from its target; others (e.g. multimodal mrope) fall
# back to plain RoPE with the target's theta, which is what released Qwen3.5/3.6 drafters use (docs/dflash.md §2).
_PORTABLE_ROPE_TYPES = {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}


def _rope_parameters(target: PretrainedConfig) -> dict[str, Any]:
    params = dict(getattr(target, "rope_parameters", None) or {})
    if isinstance(params.get("full_attention"), dict):
        # One RoPE per layer type (Gemma 3: theta 1e6 for full layers, 1e4 for sliding ones): the drafter's
        # layers see the whole context through KV injection, so they take the full layers' RoPE.
        params = dict(params["full_attention"])
    theta = params.get("rope_theta", getattr(target, "rope_theta", 10000.0))
    if params.get("rope_type", "default") in _PORTABLE_ROPE_TYPES and "mrope_section" not in params:
        params.pop("partial_rotary_factor", None)
        params["rope_theta"] = theta
        params.setdefault("rope_type", "default")
        return params
    return {"rope_type": "default", "rope_theta": theta}


def make_drafter_config(
    target: PretrainedConfig,
    *,
    num_layers: int = 5,
    block_size: int = 16,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
    arch: str = "dflash",
    dflash2: dict[str, int] | None = None,
) -> Qwen3Config:
    """A new drafter config for `target` (its text config), with the paper's defaults. Sliding layers get
    `sliding_window` (default 2048); `arch` 'dflash2' adds DFlash2's fields (`dflash2` overrides defaults)."""
    if arch not in ARCHITECTURES:
        raise FlashdraftError(f"drafter config: arch {arch!r}; expected one of {', '.join(ARCHITECTURES)}")
    n_target = int(target.num_hidden_layers)
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(n_target, num_layers)
    heads = int(target.num_attention_heads)
    head_dim = getattr(target, "head_dim", None) or target.hidden_size // heads
    if layer_types is not None and len(layer_types) != num_layers:
        raise FlashdraftError(
            f"drafter config: {len(layer_types)} layer types for {num_layers} layers ({layer_types})"
        )
    if layer_types is not None and "sliding_attention" in layer_types and sliding_window is None:
        sliding_window = DEFAULT_SLIDING_WINDOW
    config = Qwen3Config(
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=getattr(target, "rms_norm_eps", 1e-6),
        attention_bias=False,
        vocab_size=target.vocab_size,
        max_position_embeddings=getattr(target, "max_position_embeddings", 32768),
        rope_parameters=_rope_parameters(target),
        use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window,
        max_window_layers=num_layers,
        layer_types=layer_types or ["full_attention"] * num_layers,
        tie_word_embeddings=False,
        bos_token_id=getattr(target, "bos_token_id", None),
        eos_token_id=getattr(target, "eos_token_id", None),
    )
    config.architectures = [ARCHITECTURES[arch]]
    config.auto_map = {"AutoModel": f"dflash.{ARCHITECTURES[arch]}"}
    config.block_size = block_size
    config.num_target_layers = n_target
    config.dflash_config = {"mask_token_id": int(mask_token_id), "target_layer_ids": list(target_layer_ids)}
    if arch == "dflash2":
        config.dflash_config |= DFLASH2_DEFAULTS | (dflash2 or {})
        # A tiny vocabulary (tests) cannot offer the default 16 candidates.
        config.dflash_config["selector_top_k"] = min(
            config.dflash_config["selector_top_k"], target.vocab_size
        )
    config.dtype = "bfloat16"
    DFlashSpec.from_config(config)  # the same checks a loader applies
    layer_kinds(config)
    return config


def new_drafter(config: PretrainedConfig) -> DFlashDraftModel:
    """The model class the config's `architectures` names (DFlash or DFlash2)."""
    spec = DFlashSpec.from_config(config)
    return DFlash2DraftModel(config) if spec.arch == "dflash2" else DFlashDraftModel(config)


# Released DFlash2 checkpoints name the selector's codebooks without ".weight" (z-lab maps them on load).
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def check_against_target(config: PretrainedConfig, target: PretrainedConfig, source: str) -> None:
    """The drafter must fit the target it is used with: width, depth, layer ids, vocabulary."""
    spec = DFlashSpec.from_config(config, source)
    n_target = int(target.num_hidden_layers)
    if config.hidden_size != target.hidden_size:
        raise FlashdraftError(
            f"{source}: 'hidden_size'={config.hidden_size} but the target's hidden size is {target.hidden_size}"
        )
    if spec.num_target_layers != n_target:
        raise FlashdraftError(
            f"{source}: 'num_target_layers'={spec.num_target_layers} but the target has {n_target} layers"
        )
    bad = [i for i in spec.target_layer_ids if i >= n_target]
    if bad:
        raise FlashdraftError(
            f"{source}: 'dflash_config.target_layer_ids' has {bad}, beyond the target's {n_target} layers"
        )
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and int(vocab) != int(target.vocab_size):
        raise FlashdraftError(
            f"{source}: 'vocab_size'={vocab} but the target's vocabulary has {target.vocab_size} rows "
            "(the drafter decodes with the target's head: it was made for another target)"
        )
    if not spec.mask_token_id < target.vocab_size:
        raise FlashdraftError(
            f"{source}: 'dflash_config.mask_token_id'={spec.mask_token_id} is outside the target vocabulary ({target.vocab_size})"
        )


# Fields whose JSON type is checked before a config object is built from them: a wrong type would
# otherwise surface as a traceback deep in transformers or in the model's constructor.
_INT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_TYPES: dict[str, tuple[type, ...]] = {
    "num_key_value_heads": (int,),
    "head_dim": (int,),
    "vocab_size": (int,),
    "block_size": (int,),
    "num_target_layers": (int,),
    "max_position_embeddings": (int,),
    "sliding_window": (int, type(None)),
    "rms_norm_eps": (int, float),
    "rope_theta": (int, float),
    "dflash_config": (dict,),
    "rope_parameters": (dict, type(None)),
    "rope_scaling": (dict, type(None)),
    "layer_types": (list,),
    "architectures": (list,),
}
_JSON_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    dict: "an object",
    list: "a list",
    type(None): "null",
}


def _check_config_types(data: Any, file: Path) -> None:
    if not isinstance(data, dict):
        raise FlashdraftError(f"{file}: expected a JSON object, found {type(data).__name__}")
    for name in _INT_FIELDS:
        if not isinstance(data.get(name), int) or isinstance(data.get(name), bool):
            raise FlashdraftError(f"{file}: field '{name}' is missing or not an integer")
    for name, types in _OPTIONAL_TYPES.items():
        value = data.get(name)
        if name in data and (not isinstance(value, types) or isinstance(value, bool)):
            wanted = " or ".join(dict.fromkeys(_JSON_TYPE_NAMES[t] for t in types))
            raise FlashdraftError(f"{file}: field '{name}' must be {wanted}, got {value!r}")
    dflash = data.get("dflash_config") or {}
    for name in ("mask_token_id", "block_size"):
        if name in dflash and (not isinstance(dflash[name], int) or isinstance(dflash[name], bool)):
            raise FlashdraftError(
                f"{file}: field 'dflash_config.{name}' must be an integer, got {dflash[name]!r}"
            )
    for name in ("target_layer_ids",):
        value = dflash.get(name, data.get(name))
        if value is not None and not (
            isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        ):
            raise FlashdraftError(
                f"{file}: field 'dflash_config.{name}' must be a list of integers, got {value!r}"
            )
    if any(not isinstance(t, str) for t in data.get("layer_types") or []):
        raise FlashdraftError(f"{file}: field 'layer_types' must be a list of strings")


def read_config(path: str | Path) -> Qwen3Config:
    path = Path(path)
    file = path / CONFIG_NAME
    try:
        data = json.loads(file.read_bytes().decode("utf-8-sig"))
    except FileNotFoundError:
        raise FlashdraftError(f"drafter {path}: no {CONFIG_NAME} (not a drafter directory)") from None
    except IsADirectoryError:
        raise FlashdraftError(f"{file} is a directory, not a JSON file") from None
    except UnicodeDecodeError as exc:
        raise FlashdraftError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise FlashdraftError(f"{file} line {exc.lineno}: invalid JSON ({exc.msg})") from None
    _check_config_types(data, file)
    data.pop("model_type", None)
    try:
        config = Qwen3Config(**{k: v for k, v in data.items() if k not in ("transformers_version",)})
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise FlashdraftError(f"{file}: not a valid drafter config ({exc})") from None
    DFlashSpec.from_config(config, str(file))
    layer_kinds(config, str(file))
    _check_rope(config, file)
    return config


def _check_rope(config: Qwen3Config, file: Path) -> None:
    """The drafter's RoPE must be one transformers can build: an unknown `rope_type` (or a known one without
    its parameters) would otherwise be a KeyError from inside the model's constructor."""
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    known = ["default", *ROPE_INIT_FUNCTIONS]
    if rope_type not in known:
        raise FlashdraftError(
            f"{file}: field 'rope_parameters.rope_type' is {rope_type!r}, which this transformers cannot "
            f"build (known: {', '.join(known)}); set it to one of those (the target's own rope type)"
        )
    try:
        Qwen3RotaryEmbedding(config)  # no weights: builds the inverse frequencies from the parameters
    except (KeyError, ValueError, TypeError, AttributeError, ZeroDivisionError) as exc:
        raise FlashdraftError(
            f"{file}: field 'rope_parameters' ({rope_type!r}) cannot be built: {type(exc).__name__} {exc}; "
            "give the parameters that rope type needs (as in the target's config.json)"
        ) from None


def load_drafter(
    path: str | Path,
    *,
    target: PretrainedConfig | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDraftModel:
    """Load a drafter directory (ours or z-lab's); every tensor must be present with the right shape."""
    path = Path(path)
    config = read_config(path)
    if target is not None:
        check_against_target(config, target, str(path / CONFIG_NAME))
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise FlashdraftError(f"drafter {path}: no {WEIGHTS_NAME}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise FlashdraftError(f"{weights}: cannot read ({exc})") from None
    state = {k.removeprefix("model."): v for k, v in state.items()}
    state = {f"{k}.weight" if k in _CODEBOOKS else k: v for k, v in state.items()}
    with torch.device("meta"):
        model = new_drafter(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise FlashdraftError(f"{weights}: missing tensors {missing[:4]}{' …' if len(missing) > 4 else ''}")
    if unexpected:
        raise FlashdraftError(
            f"{weights}: unexpected tensors {unexpected[:4]}{' …' if len(unexpected) > 4 else ''}"
        )
    for name, shape in expected.items():
        if state[name].shape != shape:
            why = ""
            if name == "fc.weight":
                n_feat = len(DFlashSpec.from_config(config).target_layer_ids)
                why = f" (= hidden_size x {n_feat} target_layer_ids x hidden_size; the target_layer_ids or hidden_size do not match the weights)"
            raise FlashdraftError(
                f"{weights}: tensor '{name}' has shape {list(state[name].shape)}, expected {list(shape)}{why}"
            )
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    model = model.to(dtype)
    # After the cast: RoPE's inv_freq (recomputed off the meta device) stays fp32, as a bf16 one puts the
    # phases of long positions off (docs/decoding.md).
    model.rotary_emb = type(model.rotary_emb)(config).to(device)
    return model


def _not_a_drafter(path: Path) -> str | None:
    """None when `path` is a drafter directory flashdraft may replace (only config.json and weights, and
    the config reads as a DFlash drafter); else why it is not, for the error message."""
    extra = sorted(p.name for p in path.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME))
    if extra:
        return f"holds files that are not a drafter's ({', '.join(extra[:4])})"
    try:
        read_config(path)
    except FlashdraftError:
        return "is not a drafter directory"
    return None


def save_drafter(
    model: DFlashDraftModel,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    *,
    overwrite: str = "drafter",
    flag: str = "drafter directory",
) -> Path:
    """Write `config.json` + `model.safetensors` into a new directory, swapped in only once complete.

    `overwrite` says what an existing non-empty `path` may be: 'never' (refused: `flashdraft init`
    without --force), 'drafter' (only a drafter directory, e.g. the trainer's `best/`), 'any' (--force).
    A file or a symbolic link is always refused (docs/inputs-and-outputs.md)."""
    if overwrite not in ("never", "drafter", "any"):
        raise ValueError(f"overwrite={overwrite!r}")
    path = Path(path)
    check_output_dir(
        path,
        flag,
        force=overwrite == "any",
        ours=None if overwrite == "never" else _not_a_drafter,
    )
    config = model.config.to_dict()
    config["dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    for noise in (
        "transformers_version",
        "id2label",
        "label2id",
        "_name_or_path",
        "problem_type",
        "chunk_size_feed_forward",
    ):
        config.pop(noise, None)
    rope = config.get("rope_parameters") or {}
    # Engines on older transformers read the flat fields; keep both spellings in step.
    config["rope_theta"] = rope.get("rope_theta", config.get("rope_theta"))
    if rope.get("rope_type", "default") == "default":
        config["rope_scaling"] = None
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    with atomic_directory(path, replace=True) as tmp:
        atomic_write_text(tmp / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "producer": "flashdraft"})
    return path


def resolve_mask_token_id(
    target_path: str | Path,
    target: PretrainedConfig,
    explicit: int | None,
    label: str = "model.mask_token_id",
) -> int:
    """Explicit id, else the tokenizer's mask token or `<|MASK|>`, else the first embedding row past the
    tokenizer's entries (Qwen3's 151669 convention, docs/dflash.md §1), else (a full vocabulary) an unused
    special token (flashdraft/model/mask_token.py). Otherwise a clear error saying how to choose.
    `label` is the setting the user gave the id with (`--mask-token-id` or `model.mask_token_id`)."""
    vocab = int(target.vocab_size)
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, int) or not 0 <= explicit < vocab:
            raise FlashdraftError(f"{label} {explicit!r} is outside the target vocabulary (0..{vocab - 1})")
        return explicit
    from flashdraft.model.target import load_target_tokenizer

    tokenizer = load_target_tokenizer(target_path)
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None and tokenizer.mask_token_id < vocab:
            return int(tokenizer.mask_token_id)
        special = tokenizer.convert_tokens_to_ids("<|MASK|>")
        if isinstance(special, int) and special != tokenizer.unk_token_id and 0 <= special < vocab:
            return special
        if len(tokenizer) < vocab:
            return len(tokenizer)
        from flashdraft.model.mask_token import pick_unused_special_token

        picked = pick_unused_special_token(tokenizer, vocab, target_path)  # docs/real-target.md
        if picked is not None:
            return picked[0]
        raise FlashdraftError(
            f"target {target_path}: its tokenizer fills all {vocab} embedding rows and has no unused special "
            "token (every special token is eos/bos/pad/unk or written by the chat template), so there is no "
            f"safe mask token; set {label} to an id the model never reads or writes"
        )
    raise FlashdraftError(
        f"target {target_path}: no tokenizer found to choose a mask token; set {label} "
        "(an embedding row the model never generates, e.g. the first id past the tokenizer's entries)"
    )


def init_drafter(
    target_path: str | Path,
    out: str | Path,
    *,
    num_layers: int = 5,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    arch: str = "dflash",
    seed: int = 0,
    force: bool = False,
) -> Path:
    """`flashdraft init`: a new, randomly initialised drafter directory for a target. An existing non-empty
    `out` is replaced only with `force`, and never when it is (or holds, or lies in) the target."""
    from flashdraft.model.target import load_target_config

    check_output_dir(out, "--out", force=force, inputs={"--target": target_path})  # before any work
    target = load_target_config(target_path)
    mask = resolve_mask_token_id(target_path, target, mask_token_id, label="--mask-token-id")
    config = make_drafter_config(
        target,
        num_layers=num_layers,
        block_size=block_size,
        mask_token_id=mask,
        target_layer_ids=target_layer_ids,
        layer_types=layer_types,
        sliding_window=sliding_window,
        arch=arch,
    )
    model = new_drafter(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    return save_drafter(model, out, overwrite="any" if force else "never", flag="--out")


def init_from_drafter(
    target_path: str | Path,
    source: str | Path,
    out: str | Path,
    *,
    arch: str | None = None,
    seed: int = 0,
    force: bool = False,
) -> Path:
    """`flashdraft init --from DRAFTER`: an existing drafter (ours or z-lab's), checked against the target
    (hidden size, vocabulary, layer count and ids, mask token), written as a new drafter directory to
    fine-tune with `model.drafter`. `arch` 'dflash2' grafts a DFlash drafter onto DFlash2
    (flashdraft/model/dflash2.py::graft_dflash2: identity convolutions, so it starts as the old drafter)."""
    from flashdraft.model.dflash2 import graft_dflash2
    from flashdraft.model.target import load_target_config

    check_output_dir(out, "--out", force=force, inputs={"--target": target_path, "--from": source})
    target = load_target_config(target_path)
    check_against_target(read_config(source), target, f"--from {Path(source) / CONFIG_NAME}")
    model = load_drafter(source, target=target)
    if arch is not None and arch != model.spec.arch:
        if (model.spec.arch, arch) != ("dflash", "dflash2"):
            raise FlashdraftError(
                f"--arch {arch}: --from {source} is a {model.spec.arch} drafter; only dflash -> dflash2 is a "
                "graft (a DFlash2 drafter's convolutions and selector cannot be dropped without changing it)"
            )
        model = graft_dflash2(model, generator=torch.Generator().manual_seed(seed))
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(
        str(getattr(read_config(source), "dtype", "")).removeprefix("torch."), torch.bfloat16
    )  # the source's own precision: a copy does not round it
    return save_drafter(model, out, dtype, overwrite="any" if force else "never", flag="--out")
