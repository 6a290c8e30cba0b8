"""The server client retries what a retry can fix (429, 5xx, a broken connection) with backoff, honours
Retry-After, fails at once on what it cannot, and counts what still failed (docs/inputs-and-outputs.md)."""

from __future__ import annotations

import email.utils
import io
import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from rich.console import Console

from flashdraft.cli import main
from flashdraft.config import Sampling
from flashdraft.data.prepare import PrepareSettings, prepare
from flashdraft.data.regenerate import REQUEST_FAILED, ServerEngine, _retry_after, read_journal, regenerate
from flashdraft.errors import FlashdraftError

from .helpers import RESET, fake_chat_server

HI = [{"role": "user", "content": "hi"}]
OVERLOADED = (503, '{"error": {"message": "overloaded"}}', {})


def engine(url: str, **kwargs) -> ServerEngine:
    kwargs = {"max_retries": 5, "max_failed": 0, "backoff": 0.001} | kwargs
    return ServerEngine(url, None, Sampling(), None, concurrency=1, **kwargs)


def test_429_5xx_and_a_broken_connection_are_retried_until_answered():
    script = [(429, "slow down", {}), OVERLOADED, RESET, (502, "", {})]
    with fake_chat_server(lambda body: "ok", script) as fake:
        client = engine(fake.url)
        assert client.complete([HI]) == [({"role": "assistant", "content": "ok"}, "stop")]
    assert len(fake.seen) == 5
    assert (client.counts.requests, client.counts.retried, client.counts.retries, client.counts.failed) == (
        1,
        1,
        4,
        0,
    )


def test_retry_after_is_honoured():
    with fake_chat_server(lambda body: "ok", [(429, "", {"Retry-After": "1"})]) as fake:
        engine(fake.url).complete([HI])
    assert fake.arrivals[1] - fake.arrivals[0] >= 0.95  # the backoff alone would wait about a millisecond


def test_backoff_doubles_scaled_by_a_random_factor(monkeypatch):
    factors = []  # the jitter factor drawn for each wait, here always its lowest value
    monkeypatch.setattr(random, "uniform", lambda low, high: factors.append((low, high)) or low)
    with fake_chat_server(lambda body: "ok", [OVERLOADED] * 3) as fake:
        engine(fake.url, backoff=0.2).complete([HI])
    gaps = [b - a for a, b in zip(fake.arrivals, fake.arrivals[1:], strict=False)]
    assert factors == [(0.5, 1.0)] * 3
    # 0.2 * 2**k * 0.5, with room for a busy machine but not for the waits without the factor
    assert 0.1 <= gaps[0] < 0.19 and 0.2 <= gaps[1] < 0.38 and 0.4 <= gaps[2] < 0.76


def test_retry_after_reads_seconds_and_dates_and_is_capped():
    in_two_seconds = email.utils.format_datetime(
        datetime.now(timezone.utc) + timedelta(seconds=2), usegmt=True
    )
    assert 0.5 < _retry_after(in_two_seconds) <= 2.0
    assert _retry_after("3") == 3.0 and _retry_after("-4") == 0.0 and _retry_after("86400") == 600.0
    assert _retry_after("soon") is None and _retry_after(None) is None


def test_a_request_still_failing_after_max_retries_is_counted_not_fatal():
    with fake_chat_server(lambda body: "ok", [OVERLOADED] * 3) as fake:
        client = engine(fake.url, max_retries=2, max_failed=1)
        (first, second) = client.complete([HI, HI])
    assert first[1] == REQUEST_FAILED and second == ({"role": "assistant", "content": "ok"}, "stop")
    assert (
        len(fake.seen) == 4
        and client.counts.retries == 2
        and client.counts.failed == 1
        and client.counts.last_failure == "HTTP 503: overloaded"
    )


def test_a_400_fails_at_once_without_retries():
    with fake_chat_server(
        lambda body: "ok", [(400, '{"error": {"message": "prompt too long"}}', {})]
    ) as fake:
        client = engine(fake.url, max_failed=1)
        (first, second) = client.complete([HI, HI])
    assert first[1] == REQUEST_FAILED and second[1] == "stop"
    assert len(fake.seen) == 2 and client.counts.retries == 0
    assert client.counts.last_failure == "HTTP 400: prompt too long"


def test_a_wrong_model_name_stops_the_run_at_once_with_the_servers_message():
    missing = (404, '{"error": {"message": "The model `nope` does not exist."}}', {})
    refused = pytest.raises(FlashdraftError, match=r"HTTP 404: The model `nope` does not exist\.")
    with fake_chat_server(lambda body: "ok", [missing] * 20) as fake, refused:
        engine(fake.url, max_failed=100).complete([HI] * 5)
    assert len(fake.seen) == 1


def test_failures_beyond_max_failed_requests_stop_the_run_naming_count_status_and_body():
    refused = pytest.raises(
        FlashdraftError,
        match=r"2 requests failed \(more than --max-failed-requests 1\); last: HTTP 503: overloaded",
    )
    with fake_chat_server(lambda body: "ok", [OVERLOADED] * 100) as fake, refused:
        engine(fake.url, max_retries=1, max_failed=1).complete([HI] * 4)
    assert len(fake.seen) == 4  # two requests, each tried twice; the rest never sent


def test_a_conversation_whose_request_failed_is_not_asked_its_later_turns_nor_journaled(tmp_path):
    two_turns = [*HI, {"role": "assistant", "content": "old"}, *HI, {"role": "assistant", "content": "old"}]
    journal = tmp_path / "regenerated.jsonl"
    with fake_chat_server(lambda body: "ok", [(400, "no", {})]) as fake:
        (result,) = regenerate([("k", two_turns)], engine(fake.url, max_failed=1).complete, journal).values()
    assert len(fake.seen) == 1 and result.finish_reasons == [REQUEST_FAILED]
    assert read_journal(journal) == {}


def test_each_answer_can_bring_its_own_seed():
    with fake_chat_server(lambda body: "ok") as fake:
        engine(fake.url).complete([HI, HI], seeds=[7, 8])
        engine(fake.url).complete([HI])
    assert [body["seed"] for body in fake.seen] == [7, 8, Sampling().seed]


def _prepare(tmp_path: Path, target: Path, url: str, **settings) -> tuple[dict, str]:
    data = tmp_path / "in.jsonl"
    records = [{"prompt": p} for p in ("hi", "why", "2+2", "thanks")]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    printed = io.StringIO()
    settings = {"regenerate": True, "server_url": url, "concurrency": 1, "retry_backoff": 0.001} | settings
    manifest = prepare(
        [str(data)],
        str(target),
        str(tmp_path / "s"),
        PrepareSettings(**settings),
        Console(file=printed, width=200),
    )
    return manifest, printed.getvalue()


def test_a_failed_conversation_is_left_out_counted_and_asked_again_by_a_rerun(tmp_path, target):
    with fake_chat_server(lambda body: "ok", [OVERLOADED, (400, "bad request", {})]) as fake:
        manifest, printed = _prepare(tmp_path, target, fake.url, max_failed_requests=1)
        assert manifest["server_requests"] == {
            "requests": 4,
            "retried": 1,
            "retries": 1,
            "failed": 1,
            "last_failure": "HTTP 400: bad request",
        }
        assert manifest["dropped"] == {"server request failed": 1} and manifest["samples"] == 3
        assert "server requests retried" in printed and "server requests failed" in printed
        assert len(read_journal(tmp_path / "s" / "regenerated.jsonl")) == 3  # the failure is not journaled
        asked = len(fake.seen)
        manifest, _ = _prepare(tmp_path, target, fake.url)
    assert len(fake.seen) == asked + 1 and manifest["samples"] == 4 and manifest["dropped"] == {}


def test_all_requests_failing_is_an_error_whatever_the_limit(tmp_path, target):
    refused = pytest.raises(FlashdraftError, match=r"all 4 requests failed; last: HTTP 400: no")
    with fake_chat_server(lambda body: "ok", [(400, "no", {})] * 4) as fake, refused:
        _prepare(tmp_path, target, fake.url, max_failed_requests=10)


def test_the_default_limit_is_one_percent_of_the_requests(tmp_path, target):
    """4 requests: 1% allows none, so the first failure stops the run."""
    refused = pytest.raises(FlashdraftError, match=r"1 request failed \(more than --max-failed-requests 0\)")
    with fake_chat_server(lambda body: "ok", [(400, "no", {})]) as fake, refused:
        _prepare(tmp_path, target, fake.url)


@pytest.mark.parametrize("flag", ["--max-retries", "--max-failed-requests"])
def test_retry_flags_must_be_zero_or_more(tmp_path, target, capsys, flag):
    args = ["prepare", str(tmp_path / "in.jsonl"), "--target", str(target), "--out", str(tmp_path / "s")]
    with pytest.raises(SystemExit) as exit_:
        main([*args, flag, "-1"])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be 0 or more, got -1" in capsys.readouterr().err
