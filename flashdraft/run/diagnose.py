"""One-line diagnoses of a run, each with the evidence it rests on.

Reads only the run directory (error.json, final.json, the log tail) and the exit code or signal, so a
broken trainer can still be diagnosed. Order matters: the most specific cause wins.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from flashdraft.run_protocol import read_json

LOG_NAME = "train.log"

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


def _first_error_file(run_dir: Path) -> tuple[int, dict] | None:
    """The earliest error.json across ranks: the root cause, as torchelastic reports it."""
    found = []
    for path in sorted(run_dir.glob("rank*/error.json")):
        data = read_json(path)
        if data:
            found.append((data.get("time", 0), int(path.parent.name.removeprefix("rank") or 0), data))
    if not found:
        return None
    _, rank, data = min(found, key=lambda item: item[0])
    return rank, data


def diagnose_exit(run_dir: str | Path, exit_code: int | None, signal_name: str | None) -> Diagnosis:
    """Why a job ended, from its exit record, its error files and its log."""
    run_dir = Path(run_dir)
    tail = log_tail(run_dir)
    final = read_json(run_dir / "rank0" / "final.json") or {}
    if exit_code == 0:
        if final.get("outcome") == "stopped":
            return Diagnosis(
                "stopped", f"stopped on request with a checkpoint at step {final.get('step')}", []
            )
        return Diagnosis("finished", f"finished at step {final.get('step')}", [])
    if signal_name is not None:
        hints = {
            "SIGKILL": " (the kernel OOM killer or kill -9: check dmesg / journalctl -k)",
            "SIGSEGV": " (faulthandler's stack dump is in the log)",
            "SIGABRT": " (e.g. the NCCL watchdog)",
            "SIGTERM": " before it could checkpoint",
            "SIGHUP": " (the terminal hung up)",
        }
        step = (read_json(run_dir / "rank0" / "heartbeat.json") or {}).get("step")
        at = f" at step {step}" if step is not None else ""
        return Diagnosis("killed", f"killed by {signal_name}{at}{hints.get(signal_name, '')}", tail[-3:])
    error = _first_error_file(run_dir)
    if error is not None:
        rank, data = error
        return _from_error_file(data, rank)
    for kind, pattern, template in _LOG_PATTERNS:
        for line in reversed(tail):
            match = re.search(pattern, line)
            if match:
                return Diagnosis(kind, template.format(match.group(1).strip()), [line.strip()])
    for line in reversed(tail):  # the last exception line of a traceback
        if re.match(r"^[A-Za-z_.]+(Error|Exception|Interrupt)\b", line):
            return Diagnosis("exception", f"Python exception: {line.strip()}", [line.strip()])
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
