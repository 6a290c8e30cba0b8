"""Metrics to the console (progress bar on a terminal, plain lines in a log), TensorBoard and JSONL.

A resumed run continues the files of the run it resumes: rows past the resumed step (written after the
checkpoint, before the crash) are dropped first, so every step appears once (docs/training-safety.md).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from flashdraft.durable import atomic_write_text


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key.startswith("acc@") or key in ("tau", "real_tau", "loss", "grad_norm"):
            return f"{key} {value:.3f}"
        if key == "lr":
            return f"lr {value:.2e}"
        if key == "mfu":
            return f"MFU {100 * value:.1f}%"
        if key.endswith("tok_s"):
            return f"{key.replace('_tok_s', ' tok/s')} {value:,.0f}"
        return f"{key} {value:.4g}"
    return f"{key} {value}"


def truncate_after(path: Path, step: int) -> None:
    """Keep the rows of `path` up to `step` (and drop a torn last line), rewritten atomically."""
    if not path.is_file():
        return
    kept, dropped = [], False
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            dropped = True  # a line cut short by a crash
            continue
        if row_step <= step:
            kept.append(line)
        else:
            dropped = True
    if dropped:
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))


class MetricsLogger:
    """One record per log interval: metrics.jsonl (for scripts and `flashdraft status`), TensorBoard
    events, and a console line or progress bar. JSONL lines are flushed at once: a crash loses none."""

    CONSOLE_KEYS = (
        "loss",
        "acc@1",
        "acc@2",
        "acc@4",
        "tau",
        "real_tau",
        "lr",
        "grad_norm",
        "block_tok_s",
        "mfu",
    )

    def __init__(self, out_dir: str | Path, total_steps: int, tensorboard: bool = True, start_step: int = 0):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / "metrics.jsonl"
        truncate_after(path, start_step)
        self.jsonl = path.open("a")
        self.total_steps = total_steps
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: events past the resumed step, from the run that crashed, are dropped
                self.writer = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_step + 1)
            except ImportError:
                self.writer = None
        self.progress = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
            )
            self.task = self.progress.add_task("train", total=total_steps, metrics="")
            self.progress.start()
        self.started = time.time()

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train", console: bool = True) -> None:
        """`console=False`: a record for metrics.jsonl and TensorBoard only (e.g. the compile stages)."""
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **metrics}
        self.jsonl.write(json.dumps(record, allow_nan=True) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)
        if not console:
            return
        line = " | ".join(_fmt(k, metrics[k]) for k in self.CONSOLE_KEYS if k in metrics)
        if self.progress is not None:
            self.progress.update(self.task, completed=step, metrics=line)
            if kind != "train":
                self.progress.console.print(f"[{kind}] step {step}: {line}")
        else:
            print(f"[{kind}] step {step}/{self.total_steps} | {line}", flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
        self.jsonl.close()
