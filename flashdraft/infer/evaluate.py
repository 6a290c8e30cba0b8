"""`flashdraft eval`: real speculative decoding over a prompt file, against plain decoding of the same
target through the same code (block size 1), with an optional losslessness check."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from flashdraft.data.chat import normalise, prompt_ids
from flashdraft.data.sources import read_records
from flashdraft.durable import disk_full_reason
from flashdraft.errors import FlashdraftError
from flashdraft.infer.decode import Generation, generate
from flashdraft.infer.report import (
    PRODUCER,
    acceptance_report,
    check_plot_path,
    plot,
    plot_is_ours,
    tokens_per_second,
    write_json,
)
from flashdraft.model.checkpoint import load_drafter
from flashdraft.model.target import TargetModel, load_target_config, load_target_tokenizer
from flashdraft.outputs import check_output_file


@dataclass
class EvalSettings:
    block_size: int | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    thinking: str | None = None
    check_lossless: bool = False
    max_prompts: int = 0
    seed: int = 0


def first_divergence(
    target: TargetModel, prompt: torch.Tensor, reference: list[int], other: list[int]
) -> dict[str, Any] | None:
    """Where two greedy outputs part, and the target's top-1 minus top-2 logit there (bf16 near-ties can flip)."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            with torch.no_grad():
                ids = torch.cat(
                    [prompt.to(target.device), torch.tensor([reference[:i]], device=target.device)], 1
                )
                logits = target.model(ids).logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            return {
                "position": i,
                "plain_token": a,
                "speculative_token": b,
                "logit_margin": float(top2[0] - top2[1]),
            }
    if len(reference) != len(other):
        n = min(len(reference), len(other))
        return {
            "position": n,
            "plain_token": reference[n] if n < len(reference) else None,
            "speculative_token": other[n] if n < len(other) else None,
            "logit_margin": None,
        }
    return None


def resolve_device(device: str) -> torch.device:
    """`--device`: auto (a GPU when there is one), cpu, cuda or cuda:N; anything else is one line."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise FlashdraftError(f"--device {device}: not a device (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FlashdraftError(f"--device {device}: no CUDA GPU is visible here (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise FlashdraftError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) are visible")
    elif dev.type != "cpu":
        raise FlashdraftError(f"--device {device}: eval runs on cpu or cuda")
    return dev


def _check_settings(settings: EvalSettings) -> None:
    """The same limits as the command's flags, for callers that build settings in code."""
    if settings.max_new_tokens < 1:
        raise FlashdraftError(f"--max-new-tokens must be at least 1, got {settings.max_new_tokens}")
    if settings.block_size is not None and settings.block_size < 1:
        raise FlashdraftError(f"--block-size must be at least 1, got {settings.block_size}")
    if settings.max_prompts < 0:
        raise FlashdraftError(f"--max-prompts must be 0 (all) or more, got {settings.max_prompts}")
    if settings.check_lossless and settings.temperature != 0:
        raise FlashdraftError("--check-lossless compares greedy outputs: use it with --temperature 0")


def encode_prompts(
    prompts: str, tokenizer, thinking: str | None, vocab_size: int, max_prompts: int = 0
) -> list[torch.Tensor]:
    """Every prompt as a [1, n] id tensor; an empty prompt or an id outside the target's vocabulary is an
    error naming the prompt file and line (it would otherwise fail deep inside the embedding)."""
    records = read_records(prompts)
    if max_prompts:
        records = records[:max_prompts]
    if not records:
        raise FlashdraftError(f"--prompts {prompts}: no prompts")
    encoded = []
    for record, where in records:
        ids = prompt_ids(normalise(record, where), tokenizer, thinking)
        if not ids:
            raise FlashdraftError(f"{where}: the prompt has no tokens")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise FlashdraftError(
                f"{where}: token id {bad[0]} is outside the target vocabulary (0..{vocab_size - 1})"
            )
        encoded.append(torch.tensor([ids]))
    return encoded


def _report_is_ours(path: Path) -> bool:
    try:
        return json.loads(path.read_bytes()).get("producer") == PRODUCER
    except (OSError, ValueError, AttributeError):
        return False


def run_eval(
    target_dir: str,
    drafter_dir: str,
    prompts: str,
    settings: EvalSettings,
    *,
    device: str = "auto",
    out: str | None = None,
    plot_path: str | None = None,
    console: Console | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Outputs, device and prompts are all checked before a model loads (docs/inputs-and-outputs.md): an
    existing --out / --plot is overwritten only when flashdraft eval wrote it, or with `force`."""
    console = console or Console()
    _check_settings(settings)
    inputs = {"--target": target_dir, "--drafter": drafter_dir, "--prompts": prompts}
    if out:
        check_output_file(out, "--out", force=force, inputs=inputs, ours=_report_is_ours)
    if plot_path:
        check_plot_path(plot_path)
        check_output_file(plot_path, "--plot", force=force, inputs=inputs, ours=plot_is_ours)
    if out and plot_path and Path(out).resolve() == Path(plot_path).resolve():
        raise FlashdraftError(f"--out and --plot are the same file {out}")
    dev = resolve_device(device)
    target_path = Path(target_dir)
    target_config = load_target_config(target_path)
    tokenizer = load_target_tokenizer(target_path)
    encoded = encode_prompts(
        prompts, tokenizer, settings.thinking, int(target_config.vocab_size), settings.max_prompts
    )
    drafter = load_drafter(
        drafter_dir,
        target=target_config,
        device=dev,
        dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
    )
    target = TargetModel.load(target_path, drafter.spec.target_layer_ids, device=dev)
    block = settings.block_size or drafter.block_size
    stop_ids = [] if tokenizer is None or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]

    g = torch.Generator(device=dev).manual_seed(settings.seed)

    def run(prompt: torch.Tensor, with_drafter: bool) -> Generation:
        return generate(
            target,
            drafter if with_drafter else None,
            prompt,
            settings.max_new_tokens,
            block_size=block,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            stop_token_ids=stop_ids,
            generator=g,
        )

    run(encoded[0], True)  # warm-up (kernels, allocator), excluded from the numbers
    run(encoded[0], False)
    spec, plain, divergences = [], [], []
    for i, prompt in enumerate(encoded):
        spec_run, plain_run = run(prompt, True), run(prompt, False)
        spec.append(spec_run)
        plain.append(plain_run)
        console.print(
            f"prompt {i + 1}/{len(encoded)}: {len(spec_run.tokens)} tokens, τ {spec_run.tau:.2f}, "
            f"{tokens_per_second([spec_run]):.1f} tok/s speculative vs {tokens_per_second([plain_run]):.1f} plain",
            highlight=False,
        )
        if settings.check_lossless:
            diff = first_divergence(target, prompt, plain_run.tokens, spec_run.tokens)
            if diff is not None:
                divergences.append({"prompt": i, **diff})
    report = acceptance_report(spec, plain, block)
    report.update(
        {
            "target": str(target_dir),
            "drafter": str(drafter_dir),
            "prompts_file": str(prompts),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "settings": settings.__dict__,
            "producer": PRODUCER,
        }
    )
    if settings.check_lossless:
        report["lossless"] = {"identical": len(encoded) - len(divergences), "diverged": divergences}

    table = Table(title=f"flashdraft eval: {len(encoded)} prompts, block {block}, T={settings.temperature}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("τ (per-prompt mean of accepted + 1, z-lab)", f"{report['tau']:.3f}")
    table.add_row("τ pooled over all steps", f"{report['tau_pooled']:.3f}")
    table.add_row("speculative tokens/s", f"{report['tokens_per_s']:.1f}")
    table.add_row("plain tokens/s (same code, B=1)", f"{report['baseline_tokens_per_s']:.1f}")
    table.add_row("speedup", f"{report['speedup']:.2f}x")
    rates = " ".join(f"{r:.2f}" for r in report["acceptance_by_position"])
    table.add_row("acceptance by position 1..B-1", rates)
    if settings.check_lossless:
        table.add_row(
            "lossless (identical / diverged)", f"{report['lossless']['identical']} / {len(divergences)}"
        )
    console.print(table)
    for d in divergences:
        console.print(
            f"diverged: prompt {d['prompt']} at token {d['position']}: plain {d['plain_token']} vs "
            f"speculative {d['speculative_token']} (target logit margin {d['logit_margin']})"
        )
    try:
        if out:
            write_json(report, out)
        if plot_path:
            plot(report, plot_path)
    except OSError as exc:
        where = out if out and not Path(out).exists() else plot_path
        reason = disk_full_reason(exc, Path(where).parent) or exc.strerror or str(exc)
        raise FlashdraftError(f"cannot write the report {where}: {reason}") from None
    return report
