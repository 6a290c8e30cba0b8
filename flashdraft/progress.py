"""One progress reporter for every step that can take more than a few seconds (docs/progress.md).

    with track("regenerating answers", total=len(prompts), unit="answer", heartbeat=hb.beat) as bar:
        for prompt in prompts:
            ...
            bar.advance(tokens=len(answer_ids))

On a terminal (stderr is a TTY) it draws a rich progress bar; in a log or a pipe it writes one plain line
every `interval` seconds (also while one item takes long) and one at the end when the step took that long,
so a log is never silent for long, never floods, and a quick step leaves nothing. Each line
has done/total, the rate (items/s, and tokens/s when `advance` is given `tokens=`), the ETA and the latest
`**fields` (a running τ, say). `heartbeat`, when given, is called on every update with one keyword,
`progress={...}`, so `Heartbeat.beat` (which throttles its own writes) can be passed as is and a supervised
run's heartbeat keeps beating through the step.

`FLASHDRAFT_PROGRESS=plain|rich|off` overrides the choice of mode. Imports only the standard library;
rich is imported when a bar is first drawn.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

MODE_ENV = "FLASHDRAFT_PROGRESS"
MODES = ("rich", "plain", "off")
# A log line every 8 s: often enough that a watcher (and a stall check) sees movement and that a log is never
# silent for 10 s even when the ticker thread gets the CPU late on a busy machine (the newcomer walk saw
# 10.03 s at a 10 s interval, docs/newcomer-walk.md), rare enough that a long run's log stays readable.
DEFAULT_INTERVAL_S = 8.0
# A phase (`phase()`) is named in a log once it has run this long: a quick one leaves no line.
ANNOUNCE_AFTER_S = 2.0

# rich allows one live display at a time: a bar drawn while another is live goes to plain lines instead.
_live_lock = threading.Lock()
_live_bars = 0


def format_duration(seconds: float) -> str:
    """`0:07`, `12:34`, `1:02:03`: what a person reads in an ETA."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _format_count(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _format_field(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def choose_mode(stream: TextIO) -> str:
    """rich on a terminal, plain lines elsewhere; `FLASHDRAFT_PROGRESS` overrides."""
    forced = os.environ.get(MODE_ENV, "").strip().lower()
    if forced in MODES:
        return forced
    isatty = getattr(stream, "isatty", None)
    try:
        return "rich" if isatty is not None and isatty() else "plain"
    except (OSError, ValueError):  # a closed stream
        return "plain"


class Progress:
    """The state of one tracked step; `advance` it as work completes (thread-safe)."""

    def __init__(
        self,
        label: str,
        total: int | None,
        unit: str = "item",
        heartbeat: Callable[..., Any] | None = None,
        *,
        stream: TextIO | None = None,
        mode: str | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        announce_after: float | None = None,
    ):
        self.label = label
        self.total = total
        self.unit = unit
        self.heartbeat = heartbeat
        self.stream = stream if stream is not None else sys.stderr
        self.mode = mode or choose_mode(self.stream)
        if self.mode not in MODES:
            raise ValueError(f"progress mode {self.mode!r}: expected one of {MODES}")
        self.interval = DEFAULT_INTERVAL_S if interval is None else interval
        self.announce_after = announce_after
        self.clock = clock
        self.done = 0
        self.tokens = 0
        self.fields: dict[str, Any] = {}
        self.started = clock()
        self._last_line = self.started
        self._lines = 0
        self._lock = threading.Lock()
        self._closed = False
        self._rich: Any = None
        self._task: Any = None
        self._stop_ticker = threading.Event()
        if self.mode == "rich":
            self._start_rich()
        if (self.mode == "plain" or heartbeat is not None) and clock is time.monotonic and self.interval > 0:
            # one item can take minutes (a batch of answers): the line and the heartbeat still come
            threading.Thread(target=self._tick, name=f"progress {label}", daemon=True).start()

    # --- numbers -------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return max(0.0, self.clock() - self.started)

    def rate(self) -> float | None:
        """Items a second, averaged over the whole step (steadier than the last interval's)."""
        elapsed = self.elapsed()
        return self.done / elapsed if elapsed > 0 and self.done else None

    def token_rate(self) -> float | None:
        elapsed = self.elapsed()
        return self.tokens / elapsed if elapsed > 0 and self.tokens else None

    def eta(self) -> float | None:
        """Seconds left at the average rate so far; None without a total or before the first item."""
        rate = self.rate()
        if self.total is None or rate is None:
            return None
        return max(0, self.total - self.done) / rate

    def snapshot(self) -> dict[str, Any]:
        """What the heartbeat gets: plain JSON values."""
        state: dict[str, Any] = {
            "label": self.label,
            "unit": self.unit,
            "done": self.done,
            "total": self.total,
            "elapsed_s": round(self.elapsed(), 3),
        }
        for key, value in (("rate", self.rate()), ("tokens_per_s", self.token_rate()), ("eta_s", self.eta())):
            if value is not None:
                state[key] = round(value, 3)
        if self.tokens:
            state["tokens"] = self.tokens
        if self.fields:
            state["fields"] = {k: v for k, v in self.fields.items() if isinstance(v, (int, float, str, bool))}
        return state

    def line(self, final: bool = False) -> str:
        """The plain-mode line: `label: 3/10 answers (30%), 0.5 answers/s, 41.2 tokens/s, ETA 0:14, tau=3.1`;
        a phase's (`phase()`: no unit): `label: elapsed 0:20` and at the end `label: done in 0:34`."""
        if not self.unit:
            parts = [
                f"done in {format_duration(self.elapsed())}"
                if final
                else f"elapsed {format_duration(self.elapsed())}"
            ]
            parts.extend(f"{k}={_format_field(v)}" for k, v in self.fields.items())
            return f"{self.label}: " + ", ".join(parts)
        unit = self.unit if self.unit.endswith("s") else f"{self.unit}s"
        if self.total is not None:
            percent = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            parts = [f"{self.done:,}/{self.total:,} {unit}{percent}"]
        else:
            parts = [f"{self.done:,} {unit}"]
        rate, token_rate = self.rate(), self.token_rate()
        if rate is not None:
            parts.append(f"{_format_count(rate)} {unit}/s")
        if token_rate is not None:
            parts.append(f"{_format_count(token_rate)} tokens/s")
        if final:
            parts.append(f"done in {format_duration(self.elapsed())}")
        else:
            eta = self.eta()
            if self.total is not None:
                parts.append(f"ETA {format_duration(eta)}" if eta is not None else "ETA ?")
            parts.append(f"elapsed {format_duration(self.elapsed())}")
        parts.extend(f"{k}={_format_field(v)}" for k, v in self.fields.items())
        return f"{self.label}: " + ", ".join(parts)

    # --- updates -------------------------------------------------------------------------------------
    def advance(self, n: int = 1, *, tokens: int = 0, **fields: Any) -> None:
        """`n` more items done (`tokens` more tokens made); `fields` replace the shown values (tau=3.2)."""
        with self._lock:
            self.done += n
            self.tokens += tokens
            self.fields.update(fields)
            self._update()

    def set_total(self, total: int | None) -> None:
        """For steps that learn their size as they go (a source read lazily)."""
        with self._lock:
            self.total = total
            if self._rich is not None:
                self._rich.update(self._task, total=total)

    def note(self, text: str) -> None:
        """Print one line of its own without breaking the bar."""
        with self._lock:
            if self._rich is not None:
                self._rich.console.print(text, markup=False, highlight=False)
            elif self.mode != "off":
                self._write(text)

    def _update(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat(progress=self.snapshot())
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done, fields=self._rich_fields())
        elif self.mode == "plain":
            now = self.clock()
            if now - self._last_line >= self.interval:
                self._last_line = now
                self._write(self.line())
                self._lines += 1

    def _tick(self) -> None:
        while not self._stop_ticker.wait(self._until_next_line()):
            with self._lock:
                if self._closed:
                    return
                now = self.clock()
                if self.mode == "plain" and self.announce_after is not None and not self._lines:
                    if now - self.started >= self.announce_after:  # a phase that lasts: say what runs
                        self._last_line = now
                        self._write(f"{self.label} ...")
                        self._lines += 1
                elif self.mode != "plain" or now - self._last_line >= self.interval:
                    self._update()

    def _until_next_line(self) -> float:
        """Seconds until the next line is due: an interval after the last line, not after the last tick (a
        line written by `advance` between two ticks would otherwise leave almost two intervals of silence);
        a phase's first line is due `announce_after` seconds in."""
        if self.mode != "plain":
            return self.interval
        with self._lock:
            due = self._last_line + self.interval
            if self.announce_after is not None and not self._lines:
                due = min(due, self.started + self.announce_after)
            return max(0.05, due - self.clock())

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # a closed log never stops the work
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """The final line (plain) or the finished bar (rich); idempotent."""
        global _live_bars
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop_ticker.set()
            if self.heartbeat is not None:
                self.heartbeat(progress=self.snapshot())
            if self._rich is not None:
                self._rich.update(self._task, completed=self.done, fields=self._rich_fields())
                self._rich.stop()
                self._rich = None
                with _live_lock:
                    _live_bars -= 1
            elif self.mode == "plain" and (self._lines or self.elapsed() >= self.interval):
                # a step over within one interval leaves no line: a log shows only what took a while
                self._write(self.line(final=True))

    # --- rich ----------------------------------------------------------------------------------------
    def _rich_fields(self) -> str:
        """The bar's text after the percentage: tokens/s, the fields, and the ETA at the step's average rate
        (rich's own estimate follows the last 30 s, so a batch of answers ending at once reads as ETA 0:01)."""
        parts = []
        token_rate = self.token_rate()
        if token_rate is not None:
            parts.append(f"{_format_count(token_rate)} tokens/s")
        parts.extend(f"{k}={_format_field(v)}" for k, v in self.fields.items())
        if self.unit and self.total is not None:
            eta = self.eta()
            parts.append(f"ETA {format_duration(eta)}" if eta is not None else "ETA ?")
        return "  ".join(parts)

    def _start_rich(self) -> None:
        global _live_bars
        with _live_lock:
            if _live_bars:
                self.mode = "plain"
                return
            _live_bars += 1
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as RichProgress

        unit = self.unit if self.unit.endswith("s") else f"{self.unit}s"
        if not self.unit:  # a phase: what runs and for how long, nothing to count
            from rich.progress import SpinnerColumn

            self._rich = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TextColumn("{task.fields[fields]}"),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=True,  # a spinner while it runs; the lines after it say what came of it
            )
            self._task = self._rich.add_task(self.label, total=None, fields="")
            self._rich.start()
            return
        self._rich = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(unit),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[fields]}"),
            console=Console(file=self.stream),
            transient=False,
        )
        self._task = self._rich.add_task(self.label, total=self.total, fields="")
        self._rich.start()


@contextlib.contextmanager
def track(
    label: str,
    total: int | None,
    unit: str = "item",
    heartbeat: Callable[..., Any] | None = None,
    *,
    stream: TextIO | None = None,
    mode: str | None = None,
    interval: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Progress]:
    """Report a step's progress for the `with` block; the final line is written however the block ends."""
    bar = Progress(label, total, unit, heartbeat, stream=stream, mode=mode, interval=interval, clock=clock)
    try:
        yield bar
    finally:
        bar.close()


@contextlib.contextmanager
def phase(
    label: str,
    heartbeat: Callable[..., Any] | None = None,
    *,
    stream: TextIO | None = None,
    mode: str | None = None,
    interval: float | None = None,
) -> Iterator[Progress]:
    """A step with nothing to count (loading a model, importing torch, writing files). In a log: `label ...`
    once it has run `ANNOUNCE_AFTER_S`, then `label: elapsed 0:12` every interval, and `label: done in 0:34`
    at the end, so no long phase is silent and a quick one leaves nothing; on a terminal a spinner while it
    runs (docs/progress.md)."""
    bar = Progress(
        label,
        None,
        "",
        heartbeat,
        stream=stream,
        mode=mode,
        interval=interval,
        announce_after=ANNOUNCE_AFTER_S,
    )
    try:
        yield bar
    finally:
        bar.close()
