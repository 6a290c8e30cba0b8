"""One-line diagnoses of a run, each with the evidence it rests on.

Reads only the run directory (error.json, final.json, the log tail) and the exit code or signal, so a
broken trainer can still be diagnosed. A record that could not be written as a file (a full disk) is
read back from its `flashdraft: record:` line in the log (docs/run-files.md). Order matters: the most
specific cause wins.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from flashdraft.durable import free_bytes
from flashdraft.run_protocol import read_json, records_from_log

LOG_NAME = "train.log"
# A job that failed with less than this free beside its run directory is blamed on the full disk when
# nothing more specific is known (its own error record may be what could not be written).
FULL_DISK_BYTES = 16 * 2**20

# (kind, regex over the log tail, how to say it); first match wins
_LOG_PATTERNS: list[tuple[str, str, str]] = [
    ("out_of_memory", r"(CUDA out of memory.*|OutOfMemoryError.*)", "out of memory: {0}"),
    (
        "dense_flex_fallback",
        r"(flex_attention (was )?called (outside|without) torch.compile.*)",
        "dense flex_attention fallback refused: {0}",
    ),
    (
        "recompile_storm",
        r"(.*(recompile_limit|RecompileLimit|FailOnRecompileLimitHit).*)",
        "recompile storm: {0}",
    ),
    (
        "nccl_timeout",
        r"(.*(Watchdog caught collective operation timeout|NCCL.*[Tt]imeout).*)",
        "NCCL timeout: {0}",
    ),
    ("disk_full", r"(.*No space left on device.*)", "disk full: {0}"),
    (
        "import_error",
        r"^((ModuleNotFoundError|ImportError|SyntaxError|IndentationError): .*)",
        "import error: {0}",
    ),
    (
        "missing_path",
        r"(flashdraft: error: .*(no config\.json|no such file|No such file).*)",
        "missing path: {0}",
    ),
    ("config_error", r"(flashdraft: error: (config|override|config file).*)", "config error: {0}"),
    ("error", r"(flashdraft: error: .*)", "{0}"),
    ("fatal", r"(Fatal Python error: .*)", "interpreter crashed: {0}"),
]


@dataclass
class Diagnosis:
    kind: str
    line: str
    evidence: list[str] = field(default_factory=list)


def log_tail(run_dir: str | Path, lines: int = 200) -> list[str]:
    path = Path(run_dir) / LOG_NAME
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 256_000))
            text = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def classify_message(message: str) -> Diagnosis:
    """A FlashdraftError (or any one-line message) to a diagnosis kind."""
    low = message.lower()
    if "unknown config key" in low or low.startswith(("config", "override")) or "expected an integer" in low:
        return Diagnosis("config_error", f"config error: {message}", [message])
    if "no config.json" in low or "no such file" in low or "not a drafter directory" in low:
        return Diagnosis("missing_path", f"missing path: {message}", [message])
    if "outside torch.compile" in low or "without torch.compile" in low:
        return Diagnosis(
            "dense_flex_fallback", f"dense flex_attention fallback refused: {message}", [message]
        )
    if "no space left" in low:
        return Diagnosis("disk_full", f"disk full: {message}", [message])
    if "interpreter" in low:
        return Diagnosis("missing_interpreter", message, [message])
    return Diagnosis("error", message, [message])


# torchrun's failure summary (torch.distributed.elastic's ChildFailedError): the rank it saw fail first
ROOT_CAUSE = "Root Cause (first observed failure):"
SIGNAL_HINTS = {
    "SIGKILL": " (the kernel OOM killer or kill -9: check dmesg / journalctl -k)",
    "SIGSEGV": " (faulthandler's stack dump is in the log)",
    "SIGABRT": " (e.g. the NCCL watchdog)",
    "SIGTERM": " before it could checkpoint",
    "SIGHUP": " (the terminal hung up)",
}


def _torchrun_root_cause(tail: list[str]) -> tuple[Diagnosis, int] | None:
    """The rank torchrun reports as the first to fail, from its summary in the log, with its exit code.
    A rank killed by a signal writes no error record; this summary is then the only place that names it."""
    starts = [i for i, line in enumerate(tail) if ROOT_CAUSE in line]
    if not starts:
        return None
    block = "\n".join(tail[starts[-1] : starts[-1] + 12])
    rank = re.search(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", block)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", block)
    if rank is None or code is None:
        return None
    where = f"rank {rank.group(1)} (local rank {rank.group(2)})"
    exit_code = int(code.group(1))
    evidence = [line.strip() for line in block.splitlines()[1:] if line.strip()]
    if exit_code < 0:
        name = signal_name(exit_code) or f"signal {-exit_code}"
        line = (
            f"{where} was killed by {name}{SIGNAL_HINTS.get(name, '')}; torchrun then ended the other ranks"
        )
        return Diagnosis("rank_killed", line, evidence), exit_code
    traceback = re.search(r"traceback\s*:\s*(.*)", block)
    detail = traceback.group(1).strip() if traceback else ""
    line = f"{where} failed first, with exit code {exit_code}" + (f": {detail}" if detail else "")
    return Diagnosis("rank_failed", line, evidence), exit_code


def _root_frame(traceback_text: str) -> str:
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', traceback_text)
    if not frames:
        return ""
    file, line, func = frames[-1]
    return f" ({Path(file).name}:{line} in {func})"


def _from_error_file(error: dict, rank: int) -> Diagnosis:
    kind, message = error.get("type", "Exception"), error.get("message", "")
    where = (
        f"rank {rank}"
        + (f", step {error['step']}" if error.get("step") is not None else "")
        + (f", phase {error['phase']}" if error.get("phase") else "")
    )
    evidence = [f"{kind}: {message}"]
    if kind == "OutOfMemoryError" or "out of memory" in message.lower():
        match = re.search(r"Tried to allocate [0-9.]+ [GMK]iB", message)
        return Diagnosis(
            "out_of_memory", f"out of memory on {where}: {match.group(0) if match else message}", evidence
        )
    if kind == "FlashdraftError":
        diagnosis = classify_message(message)
        diagnosis.evidence = evidence
        return diagnosis
    if kind in ("ModuleNotFoundError", "ImportError", "SyntaxError", "IndentationError"):
        return Diagnosis("import_error", f"import error on {where}: {kind}: {message}", evidence)
    if "no space left" in message.lower():
        return Diagnosis("disk_full", f"disk full on {where}: {message}", evidence)
    return Diagnosis(
        "exception",
        f"Python exception on {where}: {kind}: {message}{_root_frame(error.get('traceback', ''))}",
        evidence,
    )


def _first_error_file(run_dir: Path, tail: list[str]) -> tuple[int, dict] | None:
    """The earliest error record across ranks: the root cause, as torchelastic reports it. Files first;
    the log's record lines stand in for files that a full disk kept from being written."""
    found = []
    for path in sorted(run_dir.glob("rank*/error.json")):
        data = read_json(path)
        if data:
            found.append((data.get("time", 0), int(path.parent.name.removeprefix("rank") or 0), data))
    ranks = {rank for _, rank, _ in found}
    for data in records_from_log(tail, "error.json"):
        rank = int(data.get("rank") or 0)
        if rank not in ranks:
            found.append((data.get("time", 0), rank, data))
    if not found:
        return None
    _, rank, data = min(found, key=lambda item: item[0])
    return rank, data


def lowest_rank(run_dir: str | Path) -> int:
    """The rank that speaks for this run directory: 0, or on another node of a multi-node run (whose
    directory holds only its own ranks) the lowest there."""
    ranks = [int(p.name[4:]) for p in Path(run_dir).glob("rank*") if p.name[4:].isdigit()]
    return min(ranks, default=0)


def final_record(run_dir: str | Path, tail: list[str] | None = None) -> dict | None:
    """Rank 0's final.json (a node without rank 0: its lowest rank's), or its record line in the log when
    the file could not be written."""
    run_dir = Path(run_dir)
    rank = lowest_rank(run_dir)
    final = read_json(run_dir / f"rank{rank}" / "final.json")
    if final is not None:
        return final
    records = records_from_log(log_tail(run_dir) if tail is None else tail, "final.json")
    records = [r for r in records if int(r.get("rank") or 0) == rank]
    return records[-1] if records else None


def forced_stop_line(forced: dict) -> str:
    """The diagnosis of a job that `flashdraft stop --force` killed (recorded by stop before SIGKILL)."""
    return (
        f"killed by flashdraft stop --force after {float(forced.get('after_s') or 0):.0f} s "
        f"(the job did not stop gracefully: hung at phase {forced.get('phase')} step {forced.get('step')})"
    )


def diagnose_exit(
    run_dir: str | Path,
    exit_code: int | None,
    signal_name: str | None,
    forced_stop: dict | None = None,
) -> Diagnosis:
    """Why a job ended, from its exit record, its error files and its log. `forced_stop` is the record
    `flashdraft stop --force` left in status.json before it sent SIGKILL."""
    run_dir = Path(run_dir)
    tail = log_tail(run_dir)
    final = final_record(run_dir, tail) or {}
    if forced_stop and signal_name in (None, "SIGKILL") and final.get("outcome") is None:
        return Diagnosis("forced_stop", forced_stop_line(forced_stop), tail[-3:])
    if exit_code == 0:
        if final.get("outcome") == "stopped":
            return Diagnosis(
                "stopped", f"stopped on request with a checkpoint at step {final.get('step')}", []
            )
        return Diagnosis("finished", f"finished at step {final.get('step')}", [])
    if signal_name is not None:
        step = (read_json(run_dir / f"rank{lowest_rank(run_dir)}" / "heartbeat.json") or {}).get("step")
        at = f" at step {step}" if step is not None else ""
        return Diagnosis(
            "killed", f"killed by {signal_name}{at}{SIGNAL_HINTS.get(signal_name, '')}", tail[-3:]
        )
    root_cause = _torchrun_root_cause(tail)
    if root_cause is not None and root_cause[1] < 0:
        # a rank killed by a signal: the survivors' error records (a peer gone) would blame one of them
        return root_cause[0]
    error = _first_error_file(run_dir, tail)
    if error is not None:
        rank, data = error
        return _from_error_file(data, rank)
    for kind, pattern, template in _LOG_PATTERNS:
        for line in reversed(tail):
            match = re.search(pattern, line)
            if match:
                return Diagnosis(kind, template.format(match.group(1).strip()), [line.strip()])
    if root_cause is not None:  # before the summary's own ChildFailedError line is taken for the cause
        return root_cause[0]
    for line in reversed(tail):  # the last exception line of a traceback
        if re.match(r"^[A-Za-z_.]+(Error|Exception|Interrupt)\b", line):
            return Diagnosis("exception", f"Python exception: {line.strip()}", [line.strip()])
    free = free_bytes(run_dir)
    if free is not None and free < FULL_DISK_BYTES:
        return Diagnosis(
            "disk_full",
            f"disk full: exited with code {exit_code} with {free / 2**20:.1f} MiB free on {run_dir}",
            tail[-3:],
        )
    return Diagnosis(
        "failed",
        f"exited with code {exit_code}; last log line: {tail[-1].strip() if tail else '(empty log)'}",
        tail[-3:],
    )


def signal_name(returncode: int) -> str | None:
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
