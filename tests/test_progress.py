"""The progress reporter: plain lines in a log at the interval and at the end, a rich bar on a terminal."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from flashdraft.progress import Progress, choose_mode, format_duration, phase, track


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_come_at_the_interval_and_at_the_end() -> None:
    clock, out = FakeClock(), io.StringIO()
    with track(
        "regenerating", total=10, unit="answer", stream=out, mode="plain", interval=5, clock=clock
    ) as bar:
        clock.now += 2
        bar.advance(tokens=40)  # 2 s in: under the interval, no line yet
        assert out.getvalue() == ""
        clock.now += 3
        bar.advance(tokens=60, tau=3.25)  # 5 s in: a line
        clock.now += 1
        bar.advance()  # 6 s: 1 s since the last line, none
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0] == (
        "regenerating: 2/10 answers (20%), 0.4 answers/s, 20 tokens/s, ETA 0:20, elapsed 0:05, tau=3.25"
    )
    assert (
        lines[1] == "regenerating: 3/10 answers (30%), 0.5 answers/s, 16.7 tokens/s, done in 0:06, tau=3.25"
    )


def test_unknown_total_and_a_step_that_raises_still_ends_with_a_line() -> None:
    clock, out = FakeClock(), io.StringIO()
    with (
        pytest.raises(RuntimeError),
        track("reading", total=None, stream=out, mode="plain", interval=2, clock=clock) as bar,
    ):
        bar.advance(8)
        clock.now += 4
        raise RuntimeError("boom")
    assert out.getvalue() == "reading: 8 items, 2 items/s, done in 0:04\n"


def test_heartbeat_gets_every_update_as_progress_field() -> None:
    clock, beats = FakeClock(), []
    with track(
        "eval", total=3, unit="prompt", heartbeat=lambda **kw: beats.append(kw), mode="off", clock=clock
    ) as bar:
        clock.now += 1
        bar.advance(tau=2.0)
        clock.now += 1
        bar.advance(tau=2.5)
    assert len(beats) == 3  # two advances and the close
    assert all(set(b) == {"progress"} for b in beats)
    assert beats[1]["progress"]["done"] == 2
    assert beats[1]["progress"]["total"] == 3
    assert beats[1]["progress"]["eta_s"] == 1.0
    assert beats[1]["progress"]["fields"] == {"tau": 2.5}


def test_off_mode_writes_nothing_and_env_overrides_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    with track("quiet", total=2, stream=out, mode="off") as bar:
        bar.advance(2)
    assert out.getvalue() == ""
    monkeypatch.setenv("FLASHDRAFT_PROGRESS", "plain")
    assert choose_mode(io.StringIO()) == "plain"
    monkeypatch.setenv("FLASHDRAFT_PROGRESS", "")
    assert choose_mode(io.StringIO()) == "plain"  # not a terminal


def test_a_quick_step_leaves_only_its_notes() -> None:
    clock, out = FakeClock(), io.StringIO()
    bar = Progress("x", 1, stream=out, mode="plain", interval=10, clock=clock)
    bar.note("kept 3 answers")
    clock.now += 9
    bar.advance()
    bar.close()
    bar.close()
    assert out.getvalue() == "kept 3 answers\n"


def test_a_long_item_still_gets_lines_and_heartbeats() -> None:
    """Nothing advances, yet the log gets a line and the heartbeat a beat each interval."""
    out, beats, seen = io.StringIO(), [], threading.Event()

    def beat(**fields) -> None:
        beats.append(fields)
        seen.set()

    with track("slow", total=3, stream=out, mode="plain", interval=0.05, heartbeat=beat):
        assert seen.wait(60)
        while not out.getvalue():  # the line is written right after the beat
            assert seen.wait(60)
    assert out.getvalue().startswith("slow: 0/3 items (0%), ETA ?")
    assert beats[0]["progress"]["done"] == 0


def test_the_heartbeat_keeps_beating_without_a_log() -> None:
    beats = threading.Semaphore(0)
    with track("quiet", total=1, mode="off", interval=0.05, heartbeat=lambda **kw: beats.release()):
        assert beats.acquire(timeout=60) and beats.acquire(timeout=60)  # two ticks, nothing advanced


def test_format_duration() -> None:
    assert [format_duration(s) for s in (7, 754, 3723)] == ["0:07", "12:34", "1:02:03"]


def test_import_is_cheap() -> None:
    code = "import sys, flashdraft.progress; print('torch' in sys.modules, 'rich' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_a_terminal_gets_a_rich_bar() -> None:
    """Through a pty, as a user's terminal: the bar (ANSI drawing) with the label and the final count."""
    script = textwrap.dedent(
        """
        import sys
        from flashdraft.progress import track
        with track("converting", total=4, unit="tensor") as bar:
            for _ in range(4):
                bar.advance(tokens=10)
        print("DONE", file=sys.stderr)
        """
    )
    primary, secondary = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    env.pop("FLASHDRAFT_PROGRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, env=env
    )
    os.close(secondary)
    chunks = []
    while True:
        ready, _, _ = select.select([primary], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the child closed the pty
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=60) == 0
    os.close(primary)
    text = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in text  # drawn with escape codes, not plain lines
    assert "converting" in text
    assert "4/4" in text
    assert "tensors" in text
    assert "converting: " not in text  # not the plain-mode line
    assert text.rstrip().endswith("DONE")


def test_a_phase_that_lasts_is_named_then_ticks_and_says_when_it_ended(monkeypatch) -> None:
    """A step with nothing to count (loading a model): named once it has run ANNOUNCE_AFTER_S, a line each
    interval while it runs, the time it took at the end; a quick phase leaves nothing (an error right after
    it stays the only line on stderr)."""
    monkeypatch.setattr("flashdraft.progress.ANNOUNCE_AFTER_S", 0.05)
    out = io.StringIO()
    with phase("loading the target t", stream=out, mode="plain", interval=0.1):
        deadline = time.monotonic() + 60
        while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading the target t ..."
    assert lines[1].startswith("loading the target t: elapsed 0:0")
    assert lines[-1].startswith("loading the target t: done in 0:0")
    monkeypatch.setattr("flashdraft.progress.ANNOUNCE_AFTER_S", 30)
    quick = io.StringIO()
    with phase("quick", stream=quick, mode="plain", interval=60):
        time.sleep(0.05)
    assert quick.getvalue() == ""


def test_plain_lines_follow_the_last_line_not_the_last_tick() -> None:
    """A line written by an advance just after a tick: the next line comes one interval after it (a ticker
    on a fixed beat would skip its next tick as too early and leave almost two intervals of silence)."""
    out = io.StringIO()
    with track("x", total=100, stream=out, mode="plain", interval=1.0) as bar:
        while not out.getvalue():  # the first tick's line
            time.sleep(0.005)
        bar.interval = 0  # the advance writes its line at once
        bar.advance()
        bar.interval = 1.0
        written = time.monotonic()
        while out.getvalue().count("\n") < 3:
            time.sleep(0.005)
        gap = time.monotonic() - written
    assert 0.9 < gap < 1.5, f"{gap:.2f} s after the advance's line"


def test_the_bar_eta_is_the_average_rate_not_the_last_burst() -> None:
    """16 answers ending at once after 90 s of a 163-answer step: rich's own estimate (the last 30 s) read
    ETA 0:01; the bar shows the ETA at the step's average rate, as the plain line does."""
    clock = FakeClock()
    bar = Progress("regenerating", 163, "answer", stream=io.StringIO(), mode="off", clock=clock)
    clock.now += 90
    bar.advance(16, tokens=256)
    assert bar._rich_fields() == "2.84 tokens/s  ETA 13:47"
    assert "ETA 13:47" in bar.line()
