"""Command-line flags made from the `doc()` dataclasses of flashdraft/config.py, and the checks every
command makes before it imports the heavy stack (torch, transformers).

A field's name, type, default, allowed values and help are written once, in its dataclass; `flags_from`
turns each into a kebab-case flag (`max_new_tokens` -> `--max-new-tokens`) and `settings_from` builds the
dataclass back from the parsed flags. A bad value is refused by argparse naming the flag and the value.

Nothing here imports torch or transformers: an argument or path error must come back in well under two
seconds, not after the 7-70 s the heavy stack takes to import on a busy machine (issue 29).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

from flashdraft.config import (
    TEXT_CHECKS,
    block_size_value,
    int_list,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)
from flashdraft.errors import FlashdraftError

__all__ = [  # the validators are re-exported for the command modules' hand-declared flags
    "THREADS_ENV",
    "THREADS_HELP",
    "add_threads_flag",
    "block_size_value",
    "check_target",
    "close_flag_hint",
    "device_is_well_formed",
    "flag_name",
    "flags_from",
    "int_list",
    "non_negative_float",
    "non_negative_int",
    "positive_int",
    "probability",
    "settings_from",
    "split_config",
    "start_models",
    "threads_of",
]

THREADS_HELP = (
    "CPU threads for the model's work (default: the cores this process may use that no other process "
    "keeps busy; on a GPU, torch's own count; also $FLASHDRAFT_THREADS)"
)
THREADS_ENV = "FLASHDRAFT_THREADS"  # `launch --threads N` hands N to its job's `flashdraft train` this way


def threads_of(args: argparse.Namespace) -> int | None:
    """`--threads N` given after the command, else before it (`flashdraft --threads N COMMAND`), else
    $FLASHDRAFT_THREADS; None: the command chooses (flashdraft/cpu_threads.py)."""
    for given in (getattr(args, "threads", None), getattr(args, "global_threads", None)):
        if given is not None:
            return given
    raw = os.environ.get(THREADS_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        return positive_int(raw)
    except argparse.ArgumentTypeError as exc:
        raise FlashdraftError(f"{THREADS_ENV}={raw}: {exc}") from None


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _nested_settings(tp: Any) -> type | None:
    """The dataclass a field holds (`Sampling` or `Sampling | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [arg for arg in typing.get_args(tp) if dataclasses.is_dataclass(arg)]
        return inner[0] if inner else None
    return None


def _help_text(metadata: dict[str, Any], default: Any) -> str:
    text = metadata["help"].replace("%", "%%")  # argparse %-formats help strings
    if default is not None and default is not False and default != "" and "default" not in text:
        text += f" (default {default})"
    return text


def flags_from(
    parser: argparse.ArgumentParser,
    settings: type,
    *,
    defaults: dict[str, Any] | None = None,
    base: Any = None,
) -> None:
    """Add one flag per field of the `settings` dataclass that has `flag` set in its `doc()` metadata;
    a field holding a dataclass (the sampling knobs) adds that dataclass's flags. `defaults` replaces
    per-command defaults by field name; `base` is the instance whose values are the defaults."""
    defaults = defaults or {}
    base = settings() if base is None else base
    hints = typing.get_type_hints(settings)
    for knob in dataclasses.fields(settings):
        if not knob.metadata.get("flag", True):
            continue
        nested = _nested_settings(hints[knob.name])
        if nested is not None:
            flags_from(parser, nested, defaults=defaults, base=getattr(base, knob.name) or nested())
            continue
        default = defaults.get(knob.name, getattr(base, knob.name))
        options: dict[str, Any] = {"dest": knob.name, "default": default}
        options["help"] = _help_text(knob.metadata, default)
        if hints[knob.name] is bool:
            options["action"] = "store_true"
        else:
            if "check" in knob.metadata:
                options["type"] = TEXT_CHECKS[knob.metadata["check"]]
                options["metavar"] = {"int_list": "IDS", "probability": "P", "non_negative_float": "X"}.get(
                    knob.metadata["check"], "N"
                )
            if "choices" in knob.metadata:
                options["choices"] = knob.metadata["choices"]
        parser.add_argument(flag_name(knob.name), **options)


def settings_from(args: argparse.Namespace, settings: type, **given: Any) -> Any:
    """The `settings` dataclass from the flags `flags_from` made; `given` sets the other fields."""
    hints = typing.get_type_hints(settings)
    values: dict[str, Any] = {}
    for knob in dataclasses.fields(settings):
        nested = _nested_settings(hints[knob.name])
        if nested is not None and knob.metadata.get("flag", True):
            values[knob.name] = settings_from(args, nested)
        elif knob.metadata.get("flag", True) and hasattr(args, knob.name):
            values[knob.name] = getattr(args, knob.name)
    return settings(**{**values, **given})


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N", help=THREADS_HELP)


def close_flag_hint(word: str, parser: argparse.ArgumentParser) -> str:
    """' (did you mean --max-length?)' for a mistyped flag, as config keys get (config.py `_unknown`)."""
    if not word.startswith("--"):
        return ""
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _looks_like_gguf_target(path: Path) -> bool:
    # the same test as flashdraft/model/gguf.py's is_gguf_target, which imports torch
    if path.suffix == ".gguf":
        return True
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def check_target(path: str | Path) -> None:
    """A target must be a Hugging Face model directory (its config.json) or a .gguf file; said before
    the heavy stack loads, in the words `load_target_config` would use after it."""
    target = Path(path)
    if _looks_like_gguf_target(target):
        if target.suffix == ".gguf" and not target.is_file():
            raise FlashdraftError(f"target {target}: no such file")
        return
    if not (target / "config.json").is_file():
        raise FlashdraftError(
            f"target {target}: no config.json there (expected a local Hugging Face model directory)"
        )


DEVICE_SYNTAX = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def device_is_well_formed(device: str) -> bool:
    """auto, cpu, cuda or cuda:N: the forms every command takes (whether that GPU exists is the
    command's to say, once torch is loaded)."""
    return bool(DEVICE_SYNTAX.match(device))


def split_config(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`CONFIG [key=value ...]`: with no file given, the first word is already an override. A word that
    names an existing file is the config, even with an '=' in its path."""
    if config is not None and "=" in config and not Path(config).is_file():
        return None, [config, *overrides]
    return config, list(overrides)


def start_models(threads: int | None, device: str, *modules: str) -> int:
    """Once the checks have passed: set transformers up (before any model import), import `modules` (the
    command's own heavy ones: they pull in transformers' generation and model code, tens of seconds on a
    busy machine) and choose the CPU threads for `device` ('auto' is the GPU when there is one). Returns
    the thread count."""
    from flashdraft.progress import phase

    # importing torch and transformers takes 3 s on an idle machine and 20-40 s on a busy one (the newcomer
    # walk, docs/newcomer-walk.md): said, and ticking, rather than silent
    with phase("loading torch and transformers"):
        from flashdraft.hf_startup import prepare_transformers

        prepare_transformers()
        import importlib

        import torch

        for module in modules:
            importlib.import_module(module)

        from flashdraft.cpu_threads import configure_threads

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return configure_threads(threads, device)
