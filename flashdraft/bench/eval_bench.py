"""`flashdraft bench eval`: wall-clock speculative-decoding speedup on a random target of a real shape
(Qwen3-8B by default; `--target qwen3.6-27b` for the seeds' hybrid, `--target-layers` to shorten it).

No real weights can be downloaded, so the whole path runs on a random target: its own greedy answers
are the training data (as DFlash prescribes), a 5-layer drafter is trained on them for a few hundred
steps, and `flashdraft eval` then measures τ, per-position acceptance and the speedup against plain
decoding of the same target through the same code (warm-up excluded, CUDA-synchronised timers), with the
lossless check on. `--tiny` runs the same pipeline on a tiny target (CPU tests).

Workloads (`--workload`): a deep random transformer's greedy continuation is chaotic (its residual
branches dwarf the 0.02-scale embeddings), so no drafter learns it in minutes and τ stays ~1: `random`
measures that, i.e. the loop's overhead when nothing is accepted. `repeat` (the default) zeroes every
residual branch's output projection and ties the head to the embedding: every matmul of the 8B-shaped
forward still runs (the cost being timed), but the target repeats its last token, a rule a drafter can learn,
so the run shows the speedup the loop delivers when drafts are accepted. Neither is a language.
Prompts draw from `--prompt-vocab` token ids, so held-out prompts share the training distribution (as
real chat data does). Measured on the CPU with a 512-wide, 16k-vocabulary `repeat` target and a 2-layer
drafter: ids from the whole vocabulary, 128 samples, 100 steps: training acc@1 1.0 but held-out τ 1.0 (the
drafter memorised the samples); 256 ids, 256 samples, 200 steps: held-out τ 6.2 of 8, speedup 1.8x.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from flashdraft.bench.provenance import provenance, write_result
from flashdraft.bench.shapes import add_target_shape_arguments, build_random_target
from flashdraft.config import Sampling, load_config
from flashdraft.durable import atomic_write_text
from flashdraft.generate.engines import HFGenerateEngine
from flashdraft.infer.evaluate import EvalSettings, run_eval
from flashdraft.model.target import default_dtype
from flashdraft.train.trainer import train

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=False,
)


def zero_residual_branches(model: torch.nn.Module) -> None:
    """The `repeat` workload: every residual branch's output projection (attention, linear attention, MLP)
    is zeroed, so the target repeats its last token while every matmul still runs."""
    with torch.no_grad():
        for layer in model.model.layers:
            for mixer in ("self_attn", "linear_attn"):
                if hasattr(layer, mixer):
                    projection = getattr(layer, mixer)
                    (
                        projection.o_proj if hasattr(projection, "o_proj") else projection.out_proj
                    ).weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def _parser() -> argparse.ArgumentParser:
    """`flashdraft bench eval`'s arguments."""
    parser = argparse.ArgumentParser(prog="flashdraft bench eval")
    parser.add_argument(
        "--work", default="/tmp/flashdraft-bench-eval", help="scratch directory (the target is written here)"
    )
    parser.add_argument("--samples", type=int, default=256, help="target-generated training samples")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per training answer")
    parser.add_argument("--steps", type=int, default=300, help="drafter training steps")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts decoded")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--workload",
        choices=("repeat", "random"),
        default="repeat",
        help="repeat: a target whose continuation a drafter can learn; random: a chaotic one (see above)",
    )
    parser.add_argument("--prompt-vocab", type=int, default=256, help="prompts use token ids below this")
    parser.add_argument("--lr", type=float, default=6e-4, help="drafter learning rate")
    parser.add_argument("--tiny", action="store_true", help="a tiny target on the CPU (tests)")
    add_target_shape_arguments(parser)
    parser.add_argument(
        "--engine",
        choices=["auto", "eager", "fast"],
        default="auto",
        help="eval's decoding loop, as flashdraft eval's --engine: auto (the default) is the fast engine on "
        "a GPU (docs/export-and-eval.md); results before this default ran eager",
    )
    parser.add_argument(
        "--batch-size", type=int, default=1, help="eval rows decoding together (--engine fast)"
    )
    parser.add_argument("--out", default=None)
    return parser


def _random_target(args: argparse.Namespace, device: str) -> torch.nn.Module:
    """The random target, tiny or of --target's shape, seeded; its residual branches zeroed for the
    `repeat` workload (whose head is tied to the embedding)."""
    tie = {"tie_word_embeddings": args.workload == "repeat"}
    torch.manual_seed(0)
    if args.tiny:
        from transformers import AutoModelForCausalLM, Qwen3Config

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                Qwen3Config(**{**TINY, **tie}), dtype=default_dtype(device)
            )
    else:
        model = build_random_target(
            args.target, device=device, dtype=default_dtype(device), num_layers=args.target_layers, **tie
        )
    model.eval()
    if args.workload == "repeat":
        zero_residual_branches(model)
    return model


def _write_target_answers(model: torch.nn.Module, args: argparse.Namespace, work: Path, mask_id: int) -> int:
    """The target's own greedy answers to random prompts: --samples of them as the training data
    (`work/train.jsonl`), the other --prompts prompts held out (`work/prompts.jsonl`). Returns how many
    answers were generated."""
    g = torch.Generator().manual_seed(1)
    n = args.samples + args.prompts
    prompts = [
        torch.randint(
            0, min(args.prompt_vocab, mask_id), (int(torch.randint(16, 65, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]
    answers = HFGenerateEngine(
        model, Sampling(max_new_tokens=args.new_tokens), [], 0, batch_size=128
    ).generate_ids(prompts, [0] * len(prompts))
    atomic_write_text(
        work / "train.jsonl",
        "".join(
            json.dumps({"input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a)}) + "\n"
            for p, a in zip(prompts[: args.samples], answers[: args.samples], strict=True)
        ),
    )
    atomic_write_text(
        work / "prompts.jsonl", "".join(json.dumps({"input_ids": p}) + "\n" for p in prompts[args.samples :])
    )
    return len(prompts)


def _train_drafter(args: argparse.Namespace, work: Path, mask_id: int, device: str) -> Path:
    """A drafter trained on the target's answers by `flashdraft train` in a fresh `work/run`; returns its
    last checkpoint's drafter directory."""
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run: never mix with an earlier one
    overrides = [
        f"model.target={work / 'target'}",
        f"model.mask_token_id={mask_id}",
        f"data.train=[{work / 'train.jsonl'}]",
        f"train.out_dir={run}",
        f"train.max_steps={args.steps}",
        "train.resume=never",
        f"train.save_every={args.steps}",
        f"train.log_every={max(1, args.steps // 10)}",
        f"train.lr={args.lr}",
        f"train.device={device}",
    ]
    if args.tiny:
        overrides += [
            "model.num_layers=2",
            "model.block_size=8",
            "train.num_anchors=32",
            "train.batch_size=8",
        ]
    else:
        # every anchor valid: a block of B fits in each answer at about new_tokens - B + 1 positions, and
        # padded anchors would still cost drafter compute
        overrides += [f"train.num_anchors={max(1, args.new_tokens - 16)}", "train.batch_size=16"]
    train(load_config(None, overrides))
    return run / "checkpoints" / f"step-{args.steps:08d}" / "drafter"


def _evaluate(args: argparse.Namespace, work: Path, drafter: Path, device: str) -> dict:
    """`flashdraft eval` of the drafter on the held-out prompts, lossless check on; its report and plot in
    `work`."""
    return run_eval(
        str(work / "target"),
        str(drafter),
        str(work / "prompts.jsonl"),
        EvalSettings(
            sampling=Sampling(max_new_tokens=args.max_new_tokens),
            check_lossless=True,
            engine=args.engine,
            batch_size=args.batch_size,
        ),
        device=device,
        out=str(work / "eval.json"),
        plot_path=str(work / "eval.png"),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("flashdraft bench eval: needs a CUDA GPU (or --tiny)")
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    timings = {}
    started = time.perf_counter()
    model = _random_target(args, device)
    mask_id = model.config.vocab_size - 1

    # 1. the target's own greedy answers to random prompts: training data and held-out prompts
    answered = _write_target_answers(model, args, work, mask_id)
    model.save_pretrained(work / "target")
    model_shape = {"kind": "tiny" if args.tiny else args.target, **model.config.to_diff_dict()}
    del model
    timings["data_s"] = round(time.perf_counter() - started, 1)
    print(f"data: {answered} target answers in {timings['data_s']} s", flush=True)

    # 2. a drafter trained on them
    started = time.perf_counter()
    drafter = _train_drafter(args, work, mask_id, device)
    timings["train_s"] = round(time.perf_counter() - started, 1)
    print(f"training: {timings['train_s']} s", flush=True)

    # 3. real speculative decoding against plain decoding of the same target
    started = time.perf_counter()
    report = _evaluate(args, work, drafter, device)
    timings["eval_s"] = round(time.perf_counter() - started, 1)
    report.update(
        {
            **provenance("eval", argv),
            "target_shape": model_shape,
            "workload": args.workload,
            "training_steps": args.steps,
            "training_samples": args.samples,
            "timings": timings,
        }
    )
    write_result(args.out, report)
    print(
        json.dumps(
            {k: report[k] for k in ("tau", "tau_pooled", "speedup", "tokens_per_s", "baseline_tokens_per_s")}
        )
    )
    return 0
