"""Where does the loss's head pass go beyond its GEMMs? A probe, one device call (issue 32, docs/fp8.md).

At shape (a) the chunk function's two non-GEMM kernels took 6.8 ms of a 108 ms FP8 + head step on the H200
(benchmarks/results/train_fp8_h200_c21111c.json): the row reduction (log-sum-exp, argmax, the label's
log-probability, with the FP8 head the gradient's amax) 3.56 ms and the gradient's cast 3.24 ms, where reading
each chunk's bf16 logits twice and writing the gradient once would take about 1.3 ms a step at the memory
bandwidth. This times the trainer's own head pass (`WeightedHeadLoss.rows`, compiled, cross-entropy) on
shape (a)'s rows against a random Qwen3-8B-sized head, for each head (bf16, FP8) and loss chunk, and the same
pass with the chunk function written along the vocabulary in `--splits` parts (`split_chunk_rows`: each part's
max, argmax and sum of exponentials, then the parts combined), and, for the FP8 head, the trainer's pass with
the gradient's amax read from the gradient (`fp8-amax-read`, the path before `ce_grad_amax`), each checked
against the trainer's rows at the same chunk; on a GPU also `train.fused_ce`'s two Triton kernels
(`fused`, train/loss_kernels.py) for each head.
Each variant: median ms per pass over `--reps`, the logits' bytes per ms (two reads and one write of the bf16
logits: the floor's traffic), the peak memory the pass adds, and its largest kernels.

Usage on the device: PYTHONPATH=$PWD python3 benchmarks/head_probe.py [--out FILE.json]; on the CPU
`--device cpu --rows 96 --vocab 512 --hidden 64 --chunks 32 64` is a smoke run of the script itself
(FP8 casts emulated).
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from flashdraft.bench.kernels import top_kernels
from flashdraft.bench.train_bench import median_ms
from flashdraft.distributed.float8 import Float8Head
from flashdraft.durable import atomic_write_json
from flashdraft.train.loss import WeightedHeadLoss, ce_grad_amax


def split_chunk_rows(*chunk_args, splits: int):
    """`train/loss.py::chunk_rows` for cross-entropy, its row reductions split along the vocabulary into
    `splits` parts (rows x splits reductions instead of rows: more of them run at once) and combined: the
    log-sum-exp from each part's max and sum of exponentials, the argmax from the first part holding the
    largest logit (torch.argmax's first occurrence)."""
    # chunk_rows's arguments, in the order WeightedHeadLoss.rows passes them
    hidden, weight, labels, _teacher, multiplier, loss, _lk_eta, top_k, gemm, gemm_operands = chunk_args
    if loss != "ce" or top_k:
        raise ValueError("the split head pass is written for cross-entropy without a selector")
    logits = gemm.logits(hidden, weight, gemm_operands).float()
    if multiplier != 1.0:
        logits = logits * multiplier
    rows, vocab = logits.shape
    parts = logits.view(rows, splits, vocab // splits)
    part_max, part_argmax = parts.max(dim=-1)
    part_sum = torch.exp(parts - part_max[..., None]).sum(dim=-1)
    row_max, best_part = part_max.max(dim=-1)
    lse = row_max + torch.log((part_sum * torch.exp(part_max - row_max[:, None])).sum(dim=-1))
    label_log_q = logits.gather(-1, labels[:, None])[:, 0] - lse
    grad_logits = torch.exp(logits - lse[:, None]) - F.one_hot(labels, vocab).to(logits.dtype)
    grad_amax = ce_grad_amax(label_log_q, multiplier)
    grad = gemm.input_grad(grad_logits * multiplier, weight, gemm_operands, hidden.dtype, grad_amax)
    argmax = best_part * (vocab // splits) + part_argmax.gather(-1, best_part[:, None])[:, 0]
    empty = logits.new_zeros(rows, 0), labels.new_zeros(rows, 0)
    return -label_log_q, label_log_q.exp(), argmax == labels, grad, *empty


class AmaxRead(Float8Head):
    """The FP8 head reading the gradient's amax itself, ignoring the one cross-entropy hands it
    (`ce_grad_amax`): the trainer's pass as it was before, one more pass over each chunk's logits."""

    def input_grad(self, grad_logits, weight, operands, dtype, grad_amax=None):
        return super().input_grad(grad_logits, weight, operands, dtype)


def probe(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=g, device=device, dtype=dtype)
    head = (torch.randn(args.vocab, args.hidden, generator=g, device=device) * args.hidden**-0.5).to(dtype)
    labels = torch.randint(0, args.vocab, (args.rows,), generator=g, device=device)
    heads = {"bf16": None}
    if args.fp8:
        Float8Head.check_head(head)
        emulate = device.type != "cuda"  # the CPU (a smoke run) emulates the casts
        heads["fp8"], heads["fp8-amax-read"] = Float8Head(emulate=emulate), AmaxRead(emulate=emulate)
    report = {"settings": vars(args), "torch": torch.__version__, "variants": []}
    report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    logits_bytes = 2 * args.rows * args.vocab  # one bf16 copy of the step's logits
    references = {}  # the trainer's pass per head and chunk (an FP8 head's scales are per chunk)
    # chunk by chunk, every head and variant at each: a call cut short keeps whole comparisons
    for chunk in args.chunks:
        for head_name, gemm in heads.items():
            # (vocabulary parts, train.fused_ce's Triton kernels): the trainer's, the splits, the kernels
            modes = [(1, False), *((s, False) for s in args.splits), (1, True)]
            for splits, fused in modes:
                if splits > 1 and (args.vocab % splits or isinstance(gemm, AmaxRead)):
                    continue
                if fused and (device.type != "cuda" or isinstance(gemm, AmaxRead)):
                    continue  # the kernels run on a GPU (train/loss_kernels.py)
                torch._dynamo.reset()
                loss = WeightedHeadLoss(
                    chunk=chunk, head=gemm, compile=args.compile and not fused, fused=fused
                )
                if splits > 1:
                    split_fn = functools.partial(split_chunk_rows, splits=splits)
                    loss.chunk_fn = torch.compile(split_fn, fullgraph=True) if args.compile else split_fn

                def run(loss=loss):
                    return loss.rows(hidden, head, labels)

                run()  # compiles: the first chunk, then the graph dynamic in its rows
                out = run()
                reference = references.setdefault((head_name.split("-")[0], chunk), out)
                checks = {
                    "loss_max_abs_diff": float((out.loss - reference.loss).abs().max()),
                    "grad_rel_diff": float(
                        (out.grad.float() - reference.grad.float()).norm() / reference.grad.float().norm()
                    ),
                    "correct_equal": bool(torch.equal(out.correct, reference.correct)),
                }
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                ms = median_ms(run, args.reps, device)
                row = {
                    "head": head_name,
                    "chunk": chunk,
                    "splits": splits,
                    "fused": fused,
                    "ms": round(ms, 3),
                    "logits_GB_per_s_3x": round(3 * logits_bytes / ms / 1e6, 1),
                    **checks,
                }
                if device.type == "cuda":
                    row["added_peak_GiB"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 2)
                    row["kernels"] = top_kernels(run, 3, device, args.kernels)
                report["variants"].append(row)
                if args.out:  # after each variant: a call cut by its time limit keeps the finished ones
                    atomic_write_json(args.out, report)
                print(
                    f"{head_name:5} chunk {chunk:5} splits {splits:3}{' fused' if fused else '      '}: "
                    f"{row['ms']:8.3f} ms, "
                    f"{row['logits_GB_per_s_3x']:8.1f} GB/s, loss diff {checks['loss_max_abs_diff']:.2e}, "
                    f"grad diff {checks['grad_rel_diff']:.2e}, argmax same {checks['correct_equal']}"
                    + (f", +{row['added_peak_GiB']} GiB" if "added_peak_GiB" in row else ""),
                    flush=True,
                )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", type=int, default=7680, help="shape (a): 2 x 256 blocks x 15 positions")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[2048, 1024, 4096], help="the trainer's (2048) first"
    )
    parser.add_argument(
        "--splits", type=int, nargs="*", default=[8], help="vocabulary parts (1: the trainer's)"
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--kernels", type=int, default=6)
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = parser.parse_args()
    report = probe(args)
    report["complete"] = True
    if args.out:
        atomic_write_json(args.out, report)


if __name__ == "__main__":
    main()
