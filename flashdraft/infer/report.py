"""Acceptance statistics of speculative decoding runs, as z-lab's benchmark defines them (docs/dflash.md §5).

τ = mean over prompts of the per-prompt mean tokens committed per step (accepted drafts + 1), so
1 <= τ <= B. Acceptance at block position k = P(draft k accepted | drafts 1..k-1 accepted).
Speedup = mean time per output token of plain decoding / that of speculative decoding (prefill excluded).
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from flashdraft.durable import atomic_write_bytes, atomic_write_text
from flashdraft.errors import FlashdraftError
from flashdraft.generate.speculative import Generation, mean_tau
from flashdraft.run_protocol import read_metrics

PRODUCER = "flashdraft eval"  # recorded in reports and plots: a rerun may overwrite what it wrote


def acceptance_report(
    runs: list[Generation], baselines: list[Generation] | None, block_size: int
) -> dict[str, Any]:
    steps = [a for run in runs for a in run.accepted]
    reached = [0] * block_size  # reached[k]: steps whose first k drafts were all accepted
    hist = [0] * (block_size + 1)
    for produced in steps:
        hist[produced] += 1
        for k in range(produced):
            reached[k] += 1
    per_position = [reached[k] / reached[k - 1] if reached[k - 1] else 0.0 for k in range(1, block_size)]
    report: dict[str, Any] = {
        "prompts": len(runs),
        "block_size": block_size,
        "tau": mean_tau(runs),
        "tau_pooled": sum(steps) / len(steps) if steps else float("nan"),
        "acceptance_by_position": per_position,
        "accepted_length_histogram": {str(n): hist[n] for n in range(1, block_size + 1)},
        "output_tokens": sum(len(r.tokens) for r in runs),
        "decode_seconds": sum(r.decode_seconds for r in runs),
    }
    report["tokens_per_s"] = tokens_per_second(runs)
    if baselines:
        tpot = statistics.mean(_tpot(r) for r in runs)
        base_tpot = statistics.mean(_tpot(r) for r in baselines)
        report["baseline_tokens_per_s"] = tokens_per_second(baselines)
        report["speedup"] = base_tpot / tpot if tpot > 0 else float("nan")
    return report


# A training checkpoint's drafter: <run>/checkpoints/step-00000100/drafter (flashdraft/train/checkpoint.py).
_CHECKPOINT_STEP = re.compile(r"^step-(\d{8})$")


def simulated_tau(drafter_dir: str | Path) -> dict[str, Any] | None:
    """The held-out simulated τ that training logged for this drafter, when it is a flashdraft run's:
    `<run>/checkpoints/step-N/drafter` is step N; `<run>/best` is the last evaluation row marked `best`
    (the one that wrote best/, by train.best_by), in a run from before that marker the first evaluation at
    the run's highest τ. None when the directory is neither, or the run's metrics.jsonl has no evaluation of
    that step (docs/quality-benchmark.md)."""
    path = Path(drafter_dir).resolve()
    found = _CHECKPOINT_STEP.match(path.parent.name)
    if path.name == "drafter" and found and path.parent.parent.name == "checkpoints":
        run, step = path.parents[2], int(found.group(1))
    elif path.name == "best":
        run, step = path.parent, None
    else:
        return None
    metrics = run / "metrics.jsonl"
    try:
        evals = [r for r in read_metrics(metrics, "eval") if isinstance(r.get("tau"), (int, float))]
    except OSError:
        return None
    if step is None and any(r.get("best") for r in evals):  # the evaluation that last wrote best/
        chosen = next(r for r in reversed(evals) if r.get("best"))
    elif step is None:  # a run from before the marker: best/ was chosen by the highest simulated τ
        finite = [r for r in evals if math.isfinite(r["tau"])]
        chosen = max(finite, key=lambda r: r["tau"]) if finite else None  # max keeps the first of ties
    else:
        chosen = next((r for r in reversed(evals) if r.get("step") == step), None)
    if chosen is None:
        return None
    return {
        "step": chosen["step"],
        "tau": chosen["tau"],
        "train_minutes": chosen.get("train_minutes"),
        "metrics": str(metrics),
    }


def _tpot(run: Generation) -> float:
    return run.decode_seconds / max(1, len(run.tokens))


def tokens_per_second(runs: list[Generation]) -> float:
    seconds = sum(r.decode_seconds for r in runs)
    return sum(len(r.tokens) for r in runs) / seconds if seconds > 0 else float("nan")


def write_json(report: dict[str, Any], path: str | Path) -> None:
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")


def check_plot_path(path: str | Path) -> None:
    """The plot's format comes from its suffix; an unknown one is refused before the evaluation runs."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in formats:
        raise FlashdraftError(
            f"--plot {path}: unknown image format {suffix or '(no suffix)'!r}; use .png, .pdf or .svg"
        )


def png_written_by(path: Path, producer: str) -> bool:
    """A PNG whose Software field names `producer` (flashdraft's plots carry it), which a rerun may overwrite."""
    try:
        from PIL import Image

        with Image.open(path) as image:
            return image.info.get("Software") == producer
    except Exception:  # not an image PIL reads: not ours
        return False


def plot_is_ours(path: Path) -> bool:
    """A PNG written by `plot` (Software=flashdraft eval)."""
    return png_written_by(path, PRODUCER)


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    rates = report["acceptance_by_position"]
    left.bar(range(1, len(rates) + 1), rates, color="#3b7dd8")
    left.set(
        xlabel="block position k",
        ylabel="P(accept k | 1..k-1 accepted)",
        ylim=(0, 1),
        title=f"per-position acceptance (τ = {report['tau']:.2f})",
    )
    hist = report["accepted_length_histogram"]
    right.bar([int(k) for k in hist], list(hist.values()), color="#d8773b")
    right.set(xlabel="tokens committed per step", ylabel="steps", title="accepted-length histogram")
    if "speedup" in report:
        fig.suptitle(f"speedup {report['speedup']:.2f}x vs plain decoding")
    fig.tight_layout()
    fmt = Path(path).suffix.lstrip(".").lower()
    buffer = io.BytesIO()
    metadata = {"Software": PRODUCER} if fmt == "png" else None
    fig.savefig(buffer, format=fmt, dpi=120, metadata=metadata)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
