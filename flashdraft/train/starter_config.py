"""`flashdraft config --target DIR`: a commented starter config for one's own target, sized for this
machine, that `flashdraft train` and `launch` accept as it is.

Every key it writes carries its own `doc()` help from flashdraft/config.py as the comment above it (the
help is written once, there); the values come from the target (its layer count gives target_layer_ids by
the paper's rule, its tokenizer the mask token) and from whether a CUDA GPU is visible.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import yaml

from flashdraft.config import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_LAYERS, Config

# Sizes by machine. The GPU column is the paper's recipe; on a CPU a step of the paper's shape takes
# minutes, so the starter trains a smaller drafter on shorter rows within a wall-clock budget.
GPU_SIZES: dict[str, Any] = {
    "num_layers": DEFAULT_NUM_LAYERS,
    "max_length": 3072,
    "batch_size": 2,
    "num_anchors": 512,
    "epochs": 6,
    "max_minutes": 0.0,
    "eval_every": 500,
}
CPU_SIZES: dict[str, Any] = {
    "num_layers": 2,
    "max_length": 1024,
    "batch_size": 1,
    "num_anchors": 64,
    "epochs": 1,
    "max_minutes": 30.0,
    "eval_every": 50,
}


def _help(section: str, key: str) -> str:
    cls = type(getattr(Config(), section))
    return next(f.metadata["help"] for f in dataclasses.fields(cls) if f.name == key)


def _value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def render(sections: dict[str, dict[str, Any]], header: list[str]) -> str:
    """YAML text of `sections`, each key preceded by its config help as a comment."""
    lines = [f"# {line}" if line else "#" for line in header]
    for section, values in sections.items():
        lines += ["", f"{section}:"]
        for key, value in values.items():
            for part in textwrap.wrap(_help(section, key), 100):
                lines.append(f"  # {part}")
            lines.append(f"  {key}: {_value(value)}")
    return "\n".join(lines) + "\n"


def starter_config(
    target: str,
    *,
    data: str,
    eval_data: str | None,
    out_dir: str,
    gpu: bool,
    mask_token_id: int | None = None,
) -> str:
    """The starter config's text for `target` (a local model directory or .gguf)."""
    from flashdraft.model.drafter_dir import resolve_mask_token_id
    from flashdraft.model.spec import build_target_layer_ids
    from flashdraft.model.target import load_target_config

    target_config = load_target_config(target)
    target_layers = int(target_config.num_hidden_layers)
    sizes = GPU_SIZES if gpu else CPU_SIZES
    num_layers = min(sizes["num_layers"], max(1, target_layers - 3))
    layer_ids = build_target_layer_ids(target_layers, num_layers)
    mask = resolve_mask_token_id(target, target_config, mask_token_id, "--mask-token-id")
    train: dict[str, Any] = {
        "out_dir": out_dir,
        "epochs": sizes["epochs"],
        "batch_size": sizes["batch_size"],
        "num_anchors": sizes["num_anchors"],
        "lr": 6e-4,
        "save_every": 500,
    }
    if sizes["max_minutes"]:
        train["max_minutes"] = sizes["max_minutes"]
    if eval_data:
        train["eval_every"] = sizes["eval_every"]
    sections = {
        "model": {
            "target": str(target),
            "num_layers": num_layers,
            "block_size": DEFAULT_BLOCK_SIZE,
            "target_layer_ids": layer_ids,
            "mask_token_id": mask,
        },
        "data": {
            "train": [data],
            **({"eval": [eval_data]} if eval_data else {}),
            "max_length": sizes["max_length"],
        },
        "train": train,
    }
    machine = "a CUDA GPU" if gpu else "the CPU only (no CUDA GPU visible)"
    header = [
        f"flashdraft starter config for {target} ({target_layers} layers), sized for {machine}.",
        "Edit freely: every key is documented above it; `flashdraft --help-config` lists them all.",
        f"Make {data} first:  flashdraft prepare CHATS.jsonl --target {target} --out {data} --regenerate",
        "Then:  flashdraft launch THIS_FILE   (or flashdraft train THIS_FILE in this terminal)",
        f"The drafter lands in {out_dir}/best/ (best held-out τ, with data.eval) and in",
        f"{out_dir}/checkpoints/step-N/drafter/; launch puts it under runs/NAME-... instead of out_dir.",
    ]
    if not eval_data:
        header.append("No --eval data: give held-out shards as data.eval and train.eval_every to get best/.")
    return render(sections, header)


def write_starter(text: str, out: str | Path, *, force: bool) -> Path:
    from flashdraft.durable import atomic_write_text
    from flashdraft.outputs import check_output_file

    check_output_file(out, "--out", force=force)
    return atomic_write_text(out, text)
