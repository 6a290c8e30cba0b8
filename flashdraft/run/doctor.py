"""`flashdraft doctor CONFIG`: preflight in seconds; every check says ✓ or ✗ and how to fix it.

`launch` runs the quick checks first; the full doctor also compiles and runs flex_attention in a
subprocess on the GPU (a compile failure there cannot take this process down).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flashdraft.config import DEFAULT_NUM_LAYERS, Config
from flashdraft.errors import FlashdraftError
from flashdraft.provenance import python_bytecode


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable here (shown, not counted as a failure)
    detail: str
    fix: str = ""


def _versions(_: Config) -> Check:
    parts = [f"python {sys.version.split()[0]}"]
    for package in ("torch", "transformers", "safetensors"):
        try:
            parts.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            return Check("packages", False, f"{package} is not installed", f"pip install {package}")
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 6):
        return Check(
            "packages", False, f"torch {torch.__version__} is older than 2.6", "pip install 'torch>=2.6'"
        )
    return Check("packages", True, ", ".join(parts))


def _gpus(config: Config) -> Check:
    import torch

    if config.train.device == "cpu":
        return Check("GPUs", None, "train.device=cpu: no GPU needed (exact SDPA attention)")
    if not torch.cuda.is_available():
        if config.train.device == "auto":
            return Check("GPUs", None, "no CUDA GPU visible: training will run on the CPU (slow)")
        return Check(
            "GPUs",
            False,
            f"train.device={config.train.device} but no CUDA GPU is visible",
            "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES",
        )
    rows = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        rows.append(f"{i}: {torch.cuda.get_device_name(i)} {free / 2**30:.0f}/{total / 2**30:.0f} GiB free")
        if free < 0.5 * total:
            return Check(
                "GPUs",
                False,
                f"GPU {i} has only {free / 2**30:.0f} GiB free of {total / 2**30:.0f}",
                "another process holds it: flashdraft status, nvidia-smi",
            )
    return Check("GPUs", True, "; ".join(rows))


def _target(config: Config) -> Check:
    from flashdraft.model.gguf import target_directory
    from flashdraft.model.target import load_target_config

    if not config.model.target:
        return Check("target", False, "model.target is not set", "model.target=/path/to/hf/model")
    try:
        target = load_target_config(config.model.target)
    except FlashdraftError as exc:
        return Check("target", False, str(exc), "point model.target at a local Hugging Face model directory")
    directory = target_directory(config.model.target)  # a GGUF target: its converted copy
    weights = list(directory.glob("*.safetensors")) + list(directory.glob("*.bin"))
    if not weights:
        return Check(
            "target",
            False,
            f"target {config.model.target}: no weight files",
            "download or copy the weights there",
        )
    return Check(
        "target",
        True,
        f"{config.model.target}: {target.model_type}, {target.num_hidden_layers} layers, "
        f"hidden {target.hidden_size}, vocab {target.vocab_size}",
    )


# Packages transformers uses for linear-attention (Gated DeltaNet) layers when they import, with the
# modules and functions it looks up; without them it runs its reference PyTorch code (docs/decoding.md).
_HYBRID_KERNELS = (
    ("flash-linear-attention", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    ("causal-conv1d", "causal_conv1d", "causal_conv1d_fn"),
)


def _hybrid_kernels(config: Config) -> Check:
    import importlib

    from flashdraft.model.target import load_target_config

    try:
        target = load_target_config(config.model.target)
    except FlashdraftError:
        return Check("hybrid kernels", None, "skipped: the target does not load")
    types = list(getattr(target, "layer_types", None) or [])
    linear = sum(t == "linear_attention" for t in types)
    if not linear:
        return Check("hybrid kernels", None, "not needed: the target has no linear-attention layers")
    missing = []
    for package, module, function in _HYBRID_KERNELS:
        try:
            if not callable(getattr(importlib.import_module(module), function, None)):
                missing.append(package)
        except Exception:  # not installed, or installed without a working GPU build
            missing.append(package)
    if not missing:
        return Check(
            "hybrid kernels", True, f"{linear}/{len(types)} linear-attention layers use fast kernels"
        )
    return Check(
        "hybrid kernels",
        None,
        f"{linear}/{len(types)} target layers are linear attention and {' and '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not importable: they run on transformers' slow torch "
        "fallback (features, eval); install flashdraft[hybrid]. Measured on an H200, Qwen3.6-27B shape, 2 x 768 "
        "tokens: target forward 269 ms on the fallback against 178 ms with the fla kernels "
        "(benchmarks/results/train_h200_27b_*.json)",
    )


def _drafter(config: Config) -> Check:
    from flashdraft.model.drafter_dir import check_against_target, read_config
    from flashdraft.model.spec import build_target_layer_ids
    from flashdraft.model.target import load_target_config

    try:
        target = load_target_config(config.model.target)
    except FlashdraftError:
        return Check("drafter", None, "skipped: the target does not load")
    try:
        if config.model.drafter:
            drafter = read_config(config.model.drafter)
            check_against_target(drafter, target, f"model.drafter={config.model.drafter}")
            return Check("drafter", True, f"{config.model.drafter} fits the target")
        num_layers = config.model.num_layers or DEFAULT_NUM_LAYERS  # None: the default of a new drafter
        ids = config.model.target_layer_ids or build_target_layer_ids(target.num_hidden_layers, num_layers)
        bad = [i for i in ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            return Check(
                "drafter",
                False,
                f"model.target_layer_ids {bad} are outside the target's {target.num_hidden_layers} layers",
                f"choose ids in 0..{target.num_hidden_layers - 1}",
            )
        mask = config.model.mask_token_id
        if mask is not None and not 0 <= mask < target.vocab_size:
            return Check(
                "drafter",
                False,
                f"model.mask_token_id={mask} is outside the vocabulary ({target.vocab_size})",
                "use an id inside the embedding, e.g. the first row past the tokenizer's entries",
            )
        return Check("drafter", True, f"new {num_layers}-layer drafter on target layers {ids}")
    except FlashdraftError as exc:
        return Check(
            "drafter", False, str(exc), "fix the drafter directory or drop model.drafter to start fresh"
        )


def _data(config: Config) -> Check:
    from flashdraft.data.shards import open_shards, read_manifest
    from flashdraft.data.sources import text_lines

    if not config.data.train:
        return Check("data", False, "data.train is empty", "data.train=[/path/to/shards.jsonl]")
    for raw in [*config.data.train, *config.data.eval]:
        path = Path(raw)
        if not path.exists():
            return Check(
                "data",
                False,
                f"data {path}: no such file or directory",
                "check the path (relative to the launch directory)",
            )
        try:  # the same manifest checks `train` makes: not an object, no shards list, a shard missing
            manifest = read_manifest(path) if path.is_dir() else None
            if manifest is not None:
                open_shards(path)  # old JSONL sets, files of the wrong size
        except FlashdraftError as exc:
            fix = "run flashdraft prepare again into that directory"
            if "convert-shards" in str(exc):
                fix = "convert the set with flashdraft convert-shards OLD NEW, then point data at NEW"
            return Check("data", False, str(exc), fix)
        if manifest is not None:
            continue  # memory-mapped shards: their layout was checked above
        first = path if path.is_file() else next(iter(sorted(path.glob("*.jsonl"))), None)
        if first is None:
            return Check(
                "data", False, f"data {path}: directory holds no .jsonl files", "point at the prepared shards"
            )
        try:
            line = next((raw for _, raw in text_lines(first) if raw.strip()), b"")
            record = json.loads(line)
            assert isinstance(record, dict) and "input_ids" in record and "loss_mask" in record
        except (json.JSONDecodeError, UnicodeDecodeError, AssertionError, FlashdraftError):
            return Check(
                "data",
                False,
                f"{first} line 1: not a tokenized sample with input_ids and loss_mask",
                "run flashdraft prepare first, or check the file",
            )
    return Check("data", True, f"{len(config.data.train)} training source(s) readable")


def _output(config: Config) -> Check:
    out = Path(config.train.out_dir)
    probe_dir = out if out.exists() else next((p for p in out.parents if p.exists()), Path("/"))
    if not os.access(probe_dir, os.W_OK):
        return Check(
            "output", False, f"{probe_dir} is not writable", "choose train.out_dir on a writable disk"
        )
    free = shutil.disk_usage(probe_dir).free
    need = 0
    try:
        from flashdraft.model.target import load_target_config

        t = load_target_config(config.model.target)
        layer = 4 * t.hidden_size * t.hidden_size + 3 * t.hidden_size * t.intermediate_size
        params = (config.model.num_layers or DEFAULT_NUM_LAYERS) * layer + 5 * t.hidden_size * t.hidden_size
        # fp32 weights, Adam moments and (bf16 training) fp32 master weights in the optimizer state
        need = int(
            params * (16 if config.train.master_weights else 12) * (config.train.keep_last + 1) + (1 << 30)
        )
    except Exception:
        pass
    if need and free < need:
        return Check(
            "output",
            False,
            f"{free / 2**30:.1f} GiB free at {probe_dir}, checkpoints need about {need / 2**30:.1f} GiB",
            "free space, lower train.keep_last, or move train.out_dir",
        )
    return Check(
        "output",
        True,
        f"{probe_dir} writable, {free / 2**30:.0f} GiB free"
        + (f" (checkpoints need ~{need / 2**30:.1f} GiB)" if need else ""),
    )


def _flex_compiles(config: Config) -> Check:
    import torch

    if config.train.device == "cpu" or not torch.cuda.is_available() or config.train.attention == "sdpa":
        return Check("flex_attention", None, "not used here (SDPA path)")
    code = (
        "import torch; from torch.nn.attention.flex_attention import flex_attention, create_block_mask\n"
        "torch._dynamo.config.fail_on_recompile_limit_hit=True\n"
        "f=torch.compile(flex_attention, fullgraph=True)\n"
        "q=torch.randn(1,4,1024,128,device='cuda',dtype=torch.bfloat16,requires_grad=True)\n"
        "m=create_block_mask(lambda b,h,q,k:q>=k,1,1,1024,1024,device='cuda')\n"
        "f(q,q,q,block_mask=m).sum().backward(); torch.cuda.synchronize(); print('ok')\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return Check(
            "flex_attention",
            False,
            "compiling flex_attention took over 300 s",
            "check TORCHINDUCTOR_CACHE_DIR and the CUDA toolkit",
        )
    if out.returncode != 0 or "ok" not in out.stdout:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return Check(
            "flex_attention",
            False,
            f"flex_attention does not compile and run on this GPU: {last}",
            "use train.attention=sdpa, or fix the Triton/CUDA setup",
        )
    return Check("flex_attention", True, "compiles and runs (forward + backward) in a subprocess")


def _port(_: Config) -> Check:
    port = int(os.environ.get("MASTER_PORT", "29500"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return Check("rendezvous port", False, f"port {port} is in use", "set MASTER_PORT to a free port")
    return Check("rendezvous port", True, f"{port} free")


def _environment(_: Config) -> Check:
    keys = [
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "PYTORCH_CUDA_ALLOC_CONF",
        *sorted(k for k in os.environ if k.startswith("NCCL_")),
    ]
    shown = [f"{k}={os.environ[k]}" for k in keys if k in os.environ]
    if os.environ.get("CUDA_VISIBLE_DEVICES") and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return Check(
            "environment",
            True,
            "; ".join(shown) + " (tip: CUDA_DEVICE_ORDER=PCI_BUS_ID makes indices match nvidia-smi)",
        )
    return Check("environment", True, "; ".join(shown) or "no CUDA/NCCL variables set")


def _bytecode(_: Config) -> Check:
    """Not a failure, a slow start: every process then compiles the Python it imports (torch, transformers:
    thousands of files), seconds before each command and each rank begins."""
    state = python_bytecode()
    if state["torch_cached"]:
        return Check("python bytecode", True, "cached: imports read compiled bytecode")
    if state["writes_bytecode"]:
        return Check("python bytecode", True, "not cached yet: the first process writes it")
    return Check(
        "python bytecode",
        True,
        "not cached, and this environment forbids writing it (PYTHONDONTWRITEBYTECODE): every process "
        "compiles the Python it imports, 15 s of `flashdraft train`'s start-up on an H200 host (docs/shards.md). "
        "Tip: export PYTHONPYCACHEPREFIX=$HOME/.cache/pycache, then once: "
        'python -m compileall -q -j 0 "$(python -c "import sysconfig; print(sysconfig.get_paths()[\'purelib\'])")"',
    )


QUICK: list[Callable[[Config], Check]] = [_versions, _target, _drafter, _data, _output]
FULL: list[Callable[[Config], Check]] = [
    _versions,
    _gpus,
    _target,
    _hybrid_kernels,
    _drafter,
    _data,
    _output,
    _flex_compiles,
    _port,
    _environment,
    _bytecode,
]


def run_checks(config: Config, quick: bool = False) -> list[Check]:
    results = []
    for check in QUICK if quick else FULL:
        try:
            results.append(check(config))
        except Exception as exc:  # a broken check is itself a finding, never a crash of the doctor
            results.append(
                Check(check.__name__.strip("_"), False, f"check crashed: {type(exc).__name__}: {exc}")
            )
    return results


def print_checks(checks: list[Check]) -> int:
    from rich.console import Console

    console = Console()
    for c in checks:
        mark = {True: "[green]✓[/]", False: "[red]✗[/]", None: "[dim]–[/]"}[c.ok]
        console.print(
            f"{mark} {c.name}: {c.detail}" + (f"\n    fix: {c.fix}" if c.ok is False and c.fix else "")
        )
    console.print(check_counts(checks))
    return 1 if any(c.ok is False for c in checks) else 0


def check_counts(checks: list[Check]) -> str:
    """`5 ok, 1 failed, 2 skipped`: a check that did not apply here passed nothing."""
    ok = sum(c.ok is True for c in checks)
    failed = sum(c.ok is False for c in checks)
    skipped = sum(c.ok is None for c in checks)
    return f"{ok} ok, {failed} failed" + (f", {skipped} skipped" if skipped else "")
