"""`flashdraft export DRAFTER --to zlab|vllm|sglang --out DIR`: a drafter directory in the layout an
engine loads, with the command that serves it (docs/export-and-eval.md). DRAFTER may also be a training
run's directory: its `best/`, else its newest checkpoint's drafter (flashdraft/model/locate.py).

- zlab, sglang: the drafter directory as it is (z-lab's format; SGLang reads the same `config.json`);
  DFlash2 drafters are checked with z-lab's DFlash2DraftModel.
- vllm: the `speculators` layout (config with `speculators_model_type: "dflash"`,
  `aux_hidden_state_layer_ids` = target layer ids + 1), the same tensors.

A drafter property the engine would silently ignore or compute differently is refused, never written.
Every output is built in a temporary directory, loaded back to verify it, and only then renamed into place.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from flashdraft.durable import atomic_directory, atomic_write_text
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter_dir import CONFIG_NAME, WEIGHTS_NAME, check_against_target, read_config
from flashdraft.model.locate import find_drafter
from flashdraft.model.spec import ARCHITECTURES, DFlashSpec, layer_kinds
from flashdraft.outputs import check_output_dir

ENGINES = ("zlab", "vllm", "sglang")
# The speculators release whose DFlashSpeculatorConfig the vllm layout follows (read from its wheel).
SPECULATORS_VERSION = "0.9.0"
# config.json keys that describe DFlash rather than the draft transformer: speculators keeps them out of
# `transformer_layer_config` (its converter drops the same set).
_DFLASH_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")


def refusals(config, spec: DFlashSpec, engine: str, *, allow_sliding_window: bool = False) -> list[str]:
    """What `engine` would not compute as flashdraft and z-lab do; empty when the export is faithful."""
    kinds = layer_kinds(config)
    sliding = [i for i, k in enumerate(kinds) if k.window is not None]
    non_causal_sliding = [i for i, k in enumerate(kinds) if k.window is not None and not k.causal]
    causal_full = [i for i, k in enumerate(kinds) if k.window is None and k.causal]
    reasons = []
    if engine == "vllm":
        if spec.arch == "dflash2":
            reasons.append(
                "DFlash2 drafters (architectures DFlash2DraftModel): vLLM's DFlash model has no convolutions "
                "or candidate selector and would draft with a different model; export --to zlab or sglang"
            )
        if spec.output_multiplier != 1.0:
            reasons.append(
                f"'output_multiplier'={spec.output_multiplier}: vLLM's DFlash model does not read it and "
                "would draft from unscaled logits"
            )
        if sliding and not allow_sliding_window:
            reasons.append(
                f"layers {sliding} are sliding-window layers: vLLM before PR #40898 runs them as full "
                "attention (acceptance collapses on long contexts); pass --allow-sliding-window if your vLLM "
                "has that change"
            )
        if non_causal_sliding:
            reasons.append(
                f"layers {non_causal_sliding} are non-causal sliding-window layers, which the vLLM DFlash "
                "model is not known to run as such"
            )
        if causal_full:
            reasons.append(
                f"layers {causal_full} are causal full-attention layers; the speculators layout makes every "
                "full-attention layer bidirectional"
            )
        last = spec.num_target_layers - 1
        if last in spec.target_layer_ids:
            reasons.append(
                f"'dflash_config.target_layer_ids' holds the target's last layer {last}: speculators treats "
                "that layer's output as the verifier's own last hidden state, not an auxiliary feature"
            )
    elif engine == "sglang":
        if non_causal_sliding:
            reasons.append(
                f"layers {non_causal_sliding} are non-causal sliding-window layers: SGLang runs every "
                "sliding layer causally"
            )
        if causal_full:
            reasons.append(
                f"layers {causal_full} are causal full-attention layers: SGLang runs every full-attention "
                "layer bidirectionally"
            )
    return reasons


def _is_export(path: Path) -> str | None:
    """None when `path` is an export flashdraft may replace: config.json + model.safetensors only, and a
    config in one of the layouts this module writes."""
    extra = sorted(p.name for p in path.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME))
    if extra:
        return f"holds files that are not an exported drafter's ({', '.join(extra[:4])})"
    try:
        data = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return "is not an exported drafter"
    if not isinstance(data, dict) or not (
        data.get("speculators_model_type") == "dflash" or "dflash_config" in data
    ):
        return "is not an exported drafter"
    return None


def speculators_config(
    raw: dict[str, Any], spec: DFlashSpec, verifier: str, verifier_architectures: list[str]
) -> dict[str, Any]:
    """The vllm layout's config.json (speculators' DFlashSpeculatorConfig fields, version 0.9.0)."""
    layer_config = {k: v for k, v in raw.items() if k not in _DFLASH_KEYS}
    layer_config.setdefault("model_type", "qwen3")
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": int(raw["vocab_size"]),
        "block_size": spec.block_size,
        "target_hidden_size": None,
        # z-lab's ids name the layer whose output is the feature; speculators/vLLM name the layer whose
        # input it is: +1 (docs/export-and-eval.md).
        "aux_hidden_state_layer_ids": [i + 1 for i in spec.target_layer_ids],
        "mask_token_id": spec.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": spec.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "dtype": raw.get("dtype", "bfloat16"),
    }


def _verify_zlab_layout(directory: Path, source_state: dict[str, torch.Tensor]) -> None:
    """Our loader (and z-lab's, when installed) reads the directory, and the tensors are the source's."""
    from flashdraft.model.drafter_dir import load_drafter

    loaded = load_drafter(directory)
    state = {k.removeprefix("model."): v for k, v in load_file(str(directory / WEIGHTS_NAME)).items()}
    if set(state) != set(source_state) or any(not torch.equal(state[k], source_state[k]) for k in state):
        raise FlashdraftError(f"export check failed: the tensors in {directory} differ from the drafter's")
    if importlib.util.find_spec("dflash") is not None:
        import dflash.model

        zlab_class = getattr(dflash.model, ARCHITECTURES[loaded.spec.arch], None)
        if zlab_class is None:
            raise FlashdraftError(
                f"export check failed: the installed z-lab package has no {ARCHITECTURES[loaded.spec.arch]}"
            )
        theirs = zlab_class.from_pretrained(directory)
        if list(theirs.target_layer_ids) != list(loaded.spec.target_layer_ids) or (
            theirs.mask_token_id != loaded.spec.mask_token_id or theirs.block_size != loaded.spec.block_size
        ):
            raise FlashdraftError(f"export check failed: z-lab's loader reads {directory} differently")


def _verify_speculators_layout(directory: Path, source_state: dict[str, torch.Tensor]) -> None:
    """The config validates against speculators' own class when it is importable; the fields and tensors
    are checked against what its DFlash model reads either way."""
    data = json.loads((directory / CONFIG_NAME).read_text())
    for name in ("aux_hidden_state_layer_ids", "mask_token_id", "draft_vocab_size", "block_size"):
        if data.get(name) is None:
            raise FlashdraftError(f"export check failed: {directory / CONFIG_NAME} has no '{name}'")
    state = load_file(str(directory / WEIGHTS_NAME))
    if set(state) != set(source_state) or any(not torch.equal(state[k], source_state[k]) for k in state):
        raise FlashdraftError(f"export check failed: the tensors in {directory} differ from the drafter's")
    hidden = data["transformer_layer_config"]["hidden_size"]
    if state["fc.weight"].shape[1] != hidden * len(data["aux_hidden_state_layer_ids"]):
        raise FlashdraftError("export check failed: fc.weight does not fit aux_hidden_state_layer_ids")
    if importlib.util.find_spec("speculators") is not None:
        from speculators.models.dflash import DFlashSpeculatorConfig

        DFlashSpeculatorConfig.from_dict(data)


def serve_command(engine: str, out: Path, spec: DFlashSpec, target: str | None, hybrid: bool) -> str:
    model = shlex.quote(target) if target else "TARGET"
    where = shlex.quote(str(out))
    if engine == "vllm":
        config = json.dumps(
            {"method": "dflash", "model": str(out), "num_speculative_tokens": spec.block_size - 1},
            separators=(",", ":"),
        )
        return f"vllm serve {model} --speculative-config {shlex.quote(config)} --attention-backend flash_attn"
    if engine == "sglang":
        command = (
            f"python -m sglang.launch_server --model-path {model} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {where} --speculative-num-draft-tokens {spec.block_size}"
        )
        return command + (" --mamba-scheduler-strategy extra_buffer" if hybrid else "")
    name = ARCHITECTURES[spec.arch]
    return (
        f"python -c \"from dflash.model import {name}; {name}.from_pretrained('{out}')\""
        "  # then dflash_generate(drafter, target, ids, ...)"
    )


def _is_hybrid(target_config) -> bool:
    types = getattr(target_config, "layer_types", None) or []
    return any(t not in ("full_attention", "sliding_attention") for t in types)


def export_drafter(
    drafter: str | Path,
    engine: str,
    out: str | Path,
    *,
    target: str | Path | None = None,
    force: bool = False,
    allow_sliding_window: bool = False,
) -> str:
    """Write the export and return the command that serves it. Everything is checked before writing.
    `drafter` is a drafter directory or a run directory (`find_drafter` picks its drafter)."""
    if engine not in ENGINES:
        raise FlashdraftError(f"--to {engine}: expected one of {', '.join(ENGINES)}")
    drafter, out = find_drafter(drafter, "DRAFTER")[0], Path(out)
    inputs = {"DRAFTER": drafter} | ({"--target": target} if target is not None else {})
    check_output_dir(out, "--out", force=force, inputs=inputs, ours=_is_export)
    config = read_config(drafter)
    source = str(drafter / CONFIG_NAME)
    spec = DFlashSpec.from_config(config, source)
    target_config = None
    if target is not None:
        from flashdraft.model.target import load_target_config

        target_config = load_target_config(target)
        check_against_target(config, target_config, source)
    elif engine == "vllm":
        raise FlashdraftError(
            "--to vllm needs --target: the speculators layout records the verifier (its path or hub id) "
            "and its architecture"
        )
    reasons = refusals(config, spec, engine, allow_sliding_window=allow_sliding_window)
    if reasons:
        raise FlashdraftError(f"{source}: cannot export to {engine}: " + "; ".join(reasons))
    weights = drafter / WEIGHTS_NAME
    if not weights.is_file():
        raise FlashdraftError(f"drafter {drafter}: no {WEIGHTS_NAME}")
    raw = json.loads((drafter / CONFIG_NAME).read_bytes().decode("utf-8-sig"))
    source_state = {k.removeprefix("model."): v for k, v in load_file(str(weights)).items()}

    with atomic_directory(out, replace=True) as tmp:
        if engine == "vllm":
            verifier = str(target)
            architectures = list(getattr(target_config, "architectures", None) or [])
            atomic_write_text(
                tmp / CONFIG_NAME,
                json.dumps(speculators_config(raw, spec, verifier, architectures), indent=2) + "\n",
            )
            # speculators names tensors without a "model." prefix, which some z-lab directories carry.
            save_file(
                source_state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "producer": "flashdraft"}
            )
            _verify_speculators_layout(tmp, source_state)
        else:
            shutil.copyfile(drafter / CONFIG_NAME, tmp / CONFIG_NAME)
            shutil.copyfile(weights, tmp / WEIGHTS_NAME)
            _verify_zlab_layout(tmp, source_state)
    hybrid = target_config is not None and _is_hybrid(target_config)
    return serve_command(engine, out, spec, None if target is None else str(target), hybrid)
