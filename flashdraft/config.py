"""The typed config tree: one dataclass per section, per-field docs, YAML files and dotted overrides.

Unknown keys and ill-typed values are errors that name the file and the dotted key; nothing is guessed.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flashdraft.errors import FlashdraftError


def doc(default: Any, help: str) -> Any:
    """A dataclass field with a default and a one-line description (shown by `flashdraft init --help-config`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    target: str = doc("", "Local directory of the Hugging Face causal LM to draft for (frozen).")
    drafter: str = doc("", "Existing drafter directory to warm-start from; empty builds a new drafter.")
    num_layers: int = doc(5, "Decoder layers of a new drafter (paper: 5).")
    block_size: int = doc(16, "Block size B of a new drafter: 1 anchor + B-1 masked positions.")
    target_layer_ids: list[int] | None = doc(
        None, "Target layers whose outputs feed the drafter; default spreads num_layers ids from 1 to L-3."
    )
    mask_token_id: int | None = doc(
        None, "Token id used for masked block positions; default from the tokenizer or the Qwen3 convention."
    )


@dataclass
class DataConfig:
    train: list[str] = doc([], "Training data: shard directories or JSONL files of {input_ids, loss_mask}.")
    eval: list[str] = doc([], "Held-out data in the same format, for simulated acceptance.")
    max_length: int = doc(3072, "Sequences are truncated to this many tokens (paper: 3072).")


@dataclass
class TrainConfig:
    out_dir: str = doc("runs/flashdraft", "Run output: checkpoints, metrics.jsonl, TensorBoard events.")
    epochs: int = doc(6, "Passes over the training data (paper: 6).")
    max_steps: int = doc(0, "Stop after this many optimizer steps (0: run all epochs).")
    batch_size: int = doc(1, "Sequences per micro-batch.")
    grad_accum: int = doc(1, "Micro-batches per optimizer step.")
    lr: float = doc(6e-4, "Peak learning rate of AdamW (paper: 6e-4).")
    weight_decay: float = doc(0.0, "AdamW weight decay.")
    warmup_ratio: float = doc(0.04, "Fraction of steps with linear warm-up (paper: 0.04).")
    min_lr_ratio: float = doc(0.0, "Cosine schedule floor as a fraction of lr.")
    grad_clip: float = doc(1.0, "Global gradient-norm clip (paper: 1.0).")
    num_anchors: int = doc(512, "Anchors (blocks) sampled per sequence, fresh each epoch (paper: 512).")
    gamma: float | None = doc(None, "Loss decay exp(-(k-1)/gamma); default 7/5/4 for block size 16/10/8.")
    seed: int = doc(0, "Seed of initialisation, data order and anchor sampling.")
    device: str = doc("auto", "'auto' (cuda if present), 'cuda', 'cuda:N' or 'cpu'.")
    dtype: str = doc("auto", "Compute dtype: 'auto' (bf16 on GPU, fp32 on CPU), 'bf16' or 'fp32'.")
    master_weights: bool = doc(
        True,
        "With bf16: bf16 weights and gradients in the drafter, fp32 master weights, moments "
        "and gradient sums in the optimizer (faster). false: fp32 weights under bf16 autocast.",
    )
    attention: str = doc("auto", "'auto' (flex on GPU, sdpa on CPU), 'flex' or 'sdpa'.")
    compile: bool = doc(
        True, "torch.compile the drafter layers and loss on GPU (flex attention requires it)."
    )
    activation_checkpointing: bool = doc(False, "Recompute drafter layer activations in the backward pass.")
    loss_chunk: int = doc(2048, "Block positions per LM-head chunk of the fused cross-entropy.")
    log_every: int = doc(10, "Optimizer steps between metric lines.")
    save_every: int = doc(500, "Optimizer steps between checkpoints (a final one is always written).")
    eval_every: int = doc(0, "Optimizer steps between simulated-acceptance evaluations (0: off).")
    keep_last: int = doc(3, "Checkpoints kept on disk.")
    resume: str = doc("auto", "'auto' (latest checkpoint in out_dir if any), 'never', or a checkpoint path.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats. Errors name `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except FlashdraftError:
                continue
        raise FlashdraftError(f"{where}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and item_tp is str:
            value = [value]
        if not isinstance(value, list):
            raise FlashdraftError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise FlashdraftError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise FlashdraftError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise FlashdraftError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise FlashdraftError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp!r}")


def _section_fields(cls: type) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, f in fields.items():
        f.type = hints[name]
    return fields


def _unknown(key: str, known: list[str], source: str) -> FlashdraftError:
    close = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = (
        f" (did you mean '{key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{close[0]}'?)" if close else ""
    )
    return FlashdraftError(f"{source}: unknown config key '{key}'{hint}")


def _apply(obj: Any, data: dict[str, Any], prefix: str, source: str) -> None:
    fields = _section_fields(type(obj))
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise _unknown(dotted, list(fields), source)
        tp = fields[key].type
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise FlashdraftError(f"{source}: '{dotted}' is a section; expected a mapping, got {value!r}")
            _apply(getattr(obj, key), value, dotted + ".", source)
        else:
            setattr(obj, key, _coerce(value, tp, f"{source}: '{dotted}'"))


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=1e-4` -> ("train.lr", 1e-4); the value is read as YAML (numbers, lists, true/false, null)."""
    if "=" not in text:
        raise FlashdraftError(f"override '{text}': expected key=value, e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides in order; every key is checked."""
    config = Config()
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise FlashdraftError(f"config file {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise FlashdraftError(
                f"config file {path}{line}: invalid YAML ({getattr(exc, 'problem', exc)})"
            ) from None
        if not isinstance(data, dict):
            raise FlashdraftError(
                f"config file {path}: expected a mapping of sections, got {type(data).__name__}"
            )
        _apply(config, data, "", str(path))
    for text in overrides or []:
        key, value = parse_override(text)
        _apply(config, _nest(key, value), "", "override")
    validate(config)
    return config


def validate(config: Config) -> None:
    """Range checks that do not need the target model."""
    t = config.train
    checks = [
        (config.model.block_size >= 2, "model.block_size must be at least 2"),
        (config.model.num_layers >= 1, "model.num_layers must be at least 1"),
        (
            config.data.max_length >= 2 * config.model.block_size,
            "data.max_length must be at least 2 * block_size",
        ),
        (t.batch_size >= 1 and t.grad_accum >= 1, "train.batch_size and train.grad_accum must be at least 1"),
        (t.num_anchors >= 1, "train.num_anchors must be at least 1"),
        (t.lr > 0, "train.lr must be positive"),
        (0 <= t.warmup_ratio < 1, "train.warmup_ratio must be in [0, 1)"),
        (t.gamma is None or t.gamma > 0, "train.gamma must be positive"),
        (t.dtype in ("auto", "bf16", "fp32"), f"train.dtype must be auto, bf16 or fp32, got {t.dtype!r}"),
        (
            t.attention in ("auto", "flex", "sdpa"),
            f"train.attention must be auto, flex or sdpa, got {t.attention!r}",
        ),
        (t.keep_last >= 1, "train.keep_last must be at least 1"),
        (t.log_every >= 1 and t.save_every >= 1, "train.log_every and train.save_every must be at least 1"),
        (t.loss_chunk >= 1, "train.loss_chunk must be at least 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise FlashdraftError(f"config: {message}")


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field: the documentation of the config tree."""
    rows = []
    instance = cls()
    for name, f in _section_fields(cls).items():
        if dataclasses.is_dataclass(f.type):
            rows.extend(describe(f.type, f"{prefix}{name}."))
        else:
            rows.append((f"{prefix}{name}", repr(getattr(instance, name)), f.metadata.get("help", "")))
    return rows
