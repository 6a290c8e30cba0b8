"""`flashdraft status`: a rich table for people, `--json` for scripts."""

from __future__ import annotations

import json
import time

from rich.console import Console
from rich.table import Table

from flashdraft.run.monitor import find_run, gpu_usage, list_runs, run_state, runs_root
from flashdraft.run.restarts import restart_line
from flashdraft.run_protocol import rank_dir, read_json

STATE_STYLE = {
    "training": "green",
    "compiling": "cyan",
    "evaluating": "cyan",
    "starting": "cyan",
    "finished": "bold green",
    "stopped": "yellow",
    "failed": "bold red",
    "killed": "bold red",
    "lost": "bold red",
    "stalled": "bold yellow",
}


def _progress(info: dict) -> str:
    if info.get("step") is None:
        return ""
    total = f"/{info['total_steps']}" if info.get("total_steps") else ""
    eta = f" ETA {info['eta_s'] // 60:.0f}m" if info.get("eta_s") else ""
    return f"{info['step']}{total} ep {info.get('epoch', 0)}{eta}"


def with_balance(info: dict) -> dict:
    """Add the split topology's balance report (docs/distributed.md), as rank 0's heartbeat last carried it:
    each side's samples/s per GPU, busy and waiting shares, and the split that would balance them."""
    heartbeat = read_json(rank_dir(info["run_dir"], 0) / "heartbeat.json") if info.get("run_dir") else None
    if heartbeat and heartbeat.get("balance"):
        info["balance"] = heartbeat["balance"]
    return info


def balance_line(report: dict) -> str:
    sides = ", ".join(
        f"{side} {report[f'{side}_samples_per_s_per_gpu']:.1f} samples/s/GPU, busy "
        f"{report[f'{side}_busy_share']:.0%} waiting {report[f'{side}_waiting_share']:.0%}"
        for side in ("target", "drafter")
    )
    return f"balance: {sides}" + (f"; {report['advice']}" if report.get("advice") else "")


def show_status(run: str | None, *, runs_dir: str | None = None, as_json: bool = False) -> int:
    runs = [find_run(run, runs_dir)] if run else list_runs(runs_root(runs_dir))
    infos = [with_balance(run_state(r)) for r in runs]
    gpus = gpu_usage()
    if as_json:
        print(json.dumps(infos[0] if run else {"runs": infos, "gpus": gpus}, indent=1, default=str))
        return 0
    console = Console()
    if not infos:
        console.print(f"no runs in {runs_root(runs_dir)}")
        return 0
    table = Table(title="flashdraft runs")
    for column in ("run", "state", "step", "loss", "τ", "heartbeat", "diagnosis"):
        table.add_column(column, overflow="fold")
    for info in infos:
        ages = [r["heartbeat_age_s"] for r in info["ranks"].values()]
        table.add_row(
            info["run"],
            f"[{STATE_STYLE.get(info['state'], '')}]{info['state']}[/]",
            _progress(info),
            f"{info['loss']:.3f}" if info.get("loss") is not None else "",
            f"{info['tau']:.2f}" if info.get("tau") is not None else "",
            f"{min(ages):.0f}s ago"
            if ages and info["state"] not in ("finished", "failed", "stopped", "killed")
            else "",
            info.get("diagnosis") or "",
        )
    console.print(table)
    if run:
        info = infos[0]
        for rank, r in sorted(info["ranks"].items()):
            console.print(
                f"rank {rank}: phase {r['phase']}, step {r['step']}, heartbeat {r['heartbeat_age_s']:.0f}s ago"
            )
        if info.get("exit_code") is not None or info.get("signal"):
            console.print(
                f"exit: {'signal ' + info['signal'] if info.get('signal') else 'code ' + str(info['exit_code'])}"
            )
        if info.get("balance"):
            console.print(balance_line(info["balance"]), soft_wrap=True)
        for restart in info.get("restarts") or []:
            console.print(restart_line(restart), soft_wrap=True)
        for line in info.get("evidence") or []:
            console.print(f"evidence: {line}")
        console.print(f"last log line: {info['last_log_line']}")
    for (
        info
    ) in infos:  # stopped, failed, killed or lost (and nothing of it running): one command continues it
        if info.get("resume"):
            console.print(f"{info['run']}: resume with {info['resume']}", soft_wrap=True)
    for g in gpus:
        console.print(
            f"GPU {g['index']}: {g['util_percent']}% util, {g['memory_used_GiB']}/{g['memory_total_GiB']} GiB"
        )
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/]")
    return 0
