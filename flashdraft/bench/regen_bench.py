"""`flashdraft bench regen`: `prepare --regenerate` itself against plain HF batched `generate`, same prompts.

The `flashdraft prepare --regenerate` command is timed end to end as a user runs it, in its own
interpreter (start-up and imports, records read, engine chosen and loaded, every answer generated and
journaled, shards written), into a fresh output directory. The baseline is a plain script, also in its
own interpreter (flashdraft/bench/plain_generate.py): the target in bf16 (fp32 on the CPU) with SDPA
attention, the same chat-template prompts left-padded in input order, `--baseline-batch` rows per
`model.generate` call, greedy, the same stop tokens. Both count new tokens up to and including the stop
token. `speedup` sets the prepare command against the baseline's generate calls alone (the stricter
ratio); `speedup_end_to_end` sets process against process. Method and results: docs/regeneration.md.

The result carries each static-engine worker's timing (`engine_timing`: rows, decode steps, decode,
prefill and capture seconds, ms per decode step). `--step-time ROWSxCOLS` times only the static engine's
decode step at that size with each decode attention: `grouped`, `grouped-fused` and the model's own.

`--make-inputs DIR` writes a random-weight target shaped like a 135M instruct model (with a word-level
tokenizer and a ChatML template: no model hub is reachable) and a prompts file, for machines without one.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.bench.kernels import top_kernels
from flashdraft.bench.provenance import provenance
from flashdraft.config import Sampling
from flashdraft.data.prepare import PrepareSettings, local_regeneration
from flashdraft.data.regenerate import read_journal
from flashdraft.data.shards import JOURNAL, MANIFEST
from flashdraft.durable import atomic_write_json, atomic_write_text
from flashdraft.errors import FlashdraftError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAPE_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def make_inputs(directory: Path, prompts: int, vocab_size: int = 49152, seed: int = 0) -> tuple[Path, Path]:
    """A random 135M-shaped Llama target with a word tokenizer (`w0`..`wN` and ChatML specials), and
    `prompts` one-turn conversations of 16..256 words; returns (target dir, prompts file)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    words = [f"w{i}" for i in range(vocab_size - len(specials) - 3)] + ["\n", " ", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + specials)}, unk_token="[UNK]"))
    pattern = "|".join(s.replace("|", r"\|") for s in specials) + r"|\n| "
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), "isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]", additional_special_tokens=specials
    )
    tokenizer.chat_template = CHATML
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **SHAPE_135M))
    target = directory / "target"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(prompts):
        n = int(torch.randint(16, 257, (1,), generator=g))
        text = " ".join(f"w{int(i)}" for i in torch.randint(0, len(words) - 3, (n,), generator=g))
        lines.append(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    prompts_file = atomic_write_text(directory / "prompts.jsonl", "".join(lines))
    return target, prompts_file


def plain_generate_command(args: argparse.Namespace) -> list[str]:
    """The baseline as a user's own script, in its own interpreter (flashdraft/bench/plain_generate.py)."""
    command = [sys.executable, "-m", "flashdraft.bench.plain_generate", "--target", str(args.target)]
    command += ["--prompts", str(args.prompts), "--batch", str(args.baseline_batch)]
    return [*command, "--max-new-tokens", str(args.max_new_tokens), "--device", args.device]


def _rows_by_columns(text: str) -> tuple[int, int]:
    rows, sep, columns = text.lower().partition("x")
    if not (sep and rows.isdigit() and columns.isdigit() and int(rows) > 0 and int(columns) > 1):
        raise FlashdraftError(f"--step-time {text!r}: expected ROWSxCOLUMNS, e.g. 256x1024")
    return int(rows), int(columns)


def engine_kernels(engine, rows: int, columns: int, repeats: int, count: int = 12) -> list[dict]:
    """Where one decode step's device time goes (bench/kernels.py::top_kernels over `repeats` steps of
    `engine`). Give it an engine without CUDA graphs, so that every kernel is recorded whatever the profiler
    makes of graph replays; they are the kernels a graph replays."""
    with engine.decode_step(rows, columns) as step:
        return top_kernels(step, repeats, engine.device, count)


def step_time(
    target: str, rows: int, columns: int, device_name: str, repeats: int = 5, profile: bool = False
) -> dict:
    """Milliseconds of one static-engine decode step at `rows` x `columns` with each decode attention
    (`grouped`, `grouped-fused`, and `model`: the model's own SDPA), bf16 with CUDA graphs on a GPU, fp32
    eager on the CPU; with `profile`, also each attention's `top_kernels`."""
    from flashdraft.generate.static import StaticEngine
    from flashdraft.model.target import load_causal_lm

    device = torch.device("cuda" if torch.cuda.is_available() and device_name != "cpu" else "cpu")
    model = load_causal_lm(target, device, attention="sdpa")
    dtype = model.dtype
    sampling = Sampling(max_new_tokens=columns)
    result: dict = {"rows": rows, "columns": columns, "device": str(device), "dtype": str(dtype)}
    for attention in ("grouped", "grouped-fused", "model"):
        engine = StaticEngine(model, sampling, [], 0, rows, attention=attention)
        result[f"{attention}_ms"] = round(1000 * engine.step_seconds(rows, columns, repeats), 3)
        result["cuda_graphs"] = engine.describe()["cuda_graphs"]
        if profile:
            eager = StaticEngine(model, sampling, [], 0, rows, cuda_graphs=False, attention=attention)
            result[f"{attention}_top_kernels"] = engine_kernels(eager, rows, columns, repeats)
        del engine
    return result


def prepare_command(args: argparse.Namespace, out: Path) -> list[str]:
    """The `flashdraft prepare --regenerate` command a user runs, in a fresh interpreter: its wall clock
    counts the start-up and imports too. Samples of any length are kept, as the baseline keeps them."""
    command = [sys.executable, "-m", "flashdraft", "prepare", str(args.prompts), "--target", str(args.target)]
    command += ["--out", str(out), "--regenerate", "--max-new-tokens", str(args.max_new_tokens)]
    command += ["--device", args.device, "--engine", args.engine, "--max-length", str(10**9)]
    command += ["--row-groups", str(args.row_groups)]
    return command + (["--batch-size", str(args.batch_size)] if args.batch_size else [])


def prepare_settings(args: argparse.Namespace) -> PrepareSettings:
    """The settings `prepare_command` amounts to, for describing the engine when no manifest was written."""
    return PrepareSettings(
        regenerate=True,
        device=args.device,
        engine=args.engine,
        batch_size=args.batch_size,
        row_groups=args.row_groups,
        sampling=Sampling(max_new_tokens=args.max_new_tokens),
        max_length=10**9,
    )


def engine_timing(regeneration: dict) -> list[dict]:
    """Each static-engine worker's record of where its time went (empty for other engines)."""
    keys = ("rows", "batches", "decode_steps", "decode_s", "decode_ms_per_step", "prefill_s", "capture_s")
    keys += ("prefill_chunks",)
    details = regeneration.get("engine_details") or []
    return [{key: detail.get(key) for key in keys} for detail in details if "decode_steps" in detail]


def main(argv: list[str] | None = None) -> int:
    """The prepare command and the plain-`generate` baseline timed on the same prompts (or, with
    --make-inputs or --step-time, those instead); prints the result JSON."""
    args = build_parser().parse_args(argv)
    if args.make_inputs:
        target, prompts_file = make_inputs(Path(args.make_inputs), args.num_prompts)
        print(f"target {target}\nprompts {prompts_file}")
        return 0
    if args.step_time:
        result = step_time_result(args, argv)
    else:
        if not args.target or not args.prompts:
            raise FlashdraftError("flashdraft bench regen: --target and --prompts are required")
        result = time_prepare(args, argv)
        if not args.skip_baseline:
            time_baseline(args, result)
    print(json.dumps(result, indent=1))
    if args.out:
        atomic_write_json(args.out, result, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The flags of `flashdraft bench regen`."""
    parser = argparse.ArgumentParser(prog="flashdraft bench regen")
    parser.add_argument("--target", help="target model directory (with its tokenizer and chat template)")
    parser.add_argument("--prompts", help="conversations file (any `prepare` input; one-turn prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--baseline-batch", type=int, default=500)
    parser.add_argument("--device", default="auto", help="prepare --device")
    parser.add_argument("--engine", default="auto", help="prepare --engine (auto, static, hf, hf-cb, vllm)")
    parser.add_argument("--batch-size", type=int, default=0, help="prepare --batch-size")
    parser.add_argument("--row-groups", type=int, default=4, help="prepare --row-groups (1: off)")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--make-inputs", metavar="DIR", help="write a 135M-shaped random target and prompts")
    parser.add_argument("--num-prompts", type=int, default=2000, help="with --make-inputs")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument(
        "--step-time", metavar="ROWSxCOLS", help="time only the static engine's decode step at this size"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="with --step-time: also the kernels that take a step's device time, per attention (torch.profiler)",
    )
    return parser


def step_time_result(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """--step-time ROWSxCOLS: the static engine's decode step alone at that size."""
    rows, columns = _rows_by_columns(args.step_time)
    if not args.target:
        raise FlashdraftError("flashdraft bench regen --step-time: --target is required")
    result = {**provenance("regen", argv), "target": str(args.target)}
    result["step_time"] = step_time(args.target, rows, columns, args.device, profile=args.profile)
    return result


def time_prepare(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """`flashdraft prepare --regenerate` run as its own process on the prompts, timed end to end, with
    the tokens it generated and its own record of where the time went."""
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="flashdraft-bench-regen-") as tmp:
        out = Path(tmp) / "shards"
        command = prepare_command(args, out)
        started = time.perf_counter()
        finished = subprocess.run(command, capture_output=True, text=True)
        prepare_s = time.perf_counter() - started
        # A random-weight target ends no answer: nothing kept, still timed.
        if finished.returncode != 0 and "no sample kept" not in finished.stderr:
            raise FlashdraftError(
                f"flashdraft bench regen: `{shlex.join(command)}` failed (rc {finished.returncode}):\n"
                + finished.stderr[-3000:]
            )
        manifest = json.loads((out / MANIFEST).read_text()) if (out / MANIFEST).is_file() else None
        done = read_journal(out / JOURNAL)
    generated = [ids for r in done.values() for ids in r.token_ids if ids is not None]
    prepare_tokens = sum(len(ids) for ids in generated)
    result = {
        **provenance("regen", argv),
        "target": str(args.target),
        "prompts": len(done),
        "prepare_command": shlex.join(command),
        "max_new_tokens": args.max_new_tokens,
        "prepare": {
            "seconds": round(prepare_s, 3),
            "new_tokens": prepare_tokens,
            "tokens_per_s": round(prepare_tokens / prepare_s, 1),
            "regeneration": manifest["regeneration"]
            if manifest
            else local_regeneration(args.target, sampling, prepare_settings(args))["record"],
            "samples_kept": manifest["samples"] if manifest else 0,
            # prepare's own phases from its process's start ("start-up": the interpreter and the imports)
            "phases": manifest.get("seconds") if manifest else None,
            # the rest: the write (printed, not in the manifest), the summary and the interpreter's exit
            "after_phases_s": round(prepare_s - sum(manifest["seconds"].values()), 3) if manifest else None,
            "engine_timing": engine_timing(manifest["regeneration"]) if manifest else [],
        },
    }
    return result


def time_baseline(args: argparse.Namespace, result: dict) -> None:
    """The plain-`generate` script run as its own process on the same prompts; its numbers and the two
    speedups go into `result`."""
    command = plain_generate_command(args)
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True)
    process_s = time.perf_counter() - started
    if finished.returncode != 0:
        raise FlashdraftError(
            f"flashdraft bench regen: the baseline `{shlex.join(command)}` failed "
            f"(rc {finished.returncode}):\n" + finished.stderr[-3000:]
        )
    baseline = json.loads(finished.stdout.strip().splitlines()[-1])
    result["baseline"] = {
        "batch": args.baseline_batch,
        "command": shlex.join(command),
        **baseline,
        # the script end to end: its start-up, imports, model load and prompts as well as generate
        "process_seconds": round(process_s, 3),
    }
    # From the reported seconds, so that the result is consistent with itself. `speedup` sets the
    # prepare command (everything included) against the generate calls alone: the stricter ratio.
    # `speedup_end_to_end` sets process against process, start-up and loading on both sides.
    result["speedup"] = float(f"{baseline['seconds'] / result['prepare']['seconds']:.4g}")
    result["speedup_end_to_end"] = float(
        f"{result['baseline']['process_seconds'] / result['prepare']['seconds']:.4g}"
    )
