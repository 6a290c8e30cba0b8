"""Records that used to end `prepare` with a traceback (#28): each is one line naming the file, line and
field, and `--skip-bad-records` skips and counts it like any other bad record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashdraft.cli import main
from flashdraft.data.chat import normalise
from flashdraft.errors import FlashdraftError

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi there"}]}
DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON parser can recurse
# JSON may spell a lone UTF-16 surrogate, which decodes to a Python str no tokenizer accepts
SURROGATE = (
    '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ok"}]}'
)


def _prepare(tmp_path: Path, target: Path, lines: list[str], *flags: str) -> int:
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    return main(
        ["prepare", str(tmp_path / "in.jsonl"), "--target", str(target), "--out", str(tmp_path / "s"), *flags]
    )


@pytest.mark.parametrize(
    "bad,needle",
    [
        (DEEP, "in.jsonl line 2: JSON nested too deeply"),
        (SURROGATE, "in.jsonl line 2: messages[0].content holds a lone UTF-16 surrogate (\\ud800"),
    ],
    ids=["deep", "surrogate"],
)
def test_bad_record_is_one_line_naming_file_line_and_field(tmp_path, target, capsys, bad, needle):
    assert _prepare(tmp_path, target, [json.dumps(GOOD), bad]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_skip_bad_records_skips_and_counts_deep_and_surrogate_records(tmp_path, target):
    assert _prepare(tmp_path, target, [json.dumps(GOOD), DEEP, SURROGATE], "--skip-bad-records") == 0
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["samples"] == 1 and manifest["dropped"] == {"bad record": 2}
    assert "line 2: JSON nested too deeply" in manifest["bad_records"][0]
    assert "line 3: messages[0].content holds a lone UTF-16 surrogate" in manifest["bad_records"][1]


def test_a_surrogate_in_a_tool_call_is_named_with_its_field():
    record = {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": {"q": "x\udfff"}}}],
            },
        ]
    }
    with pytest.raises(
        FlashdraftError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments\.q holds"
    ):
        normalise(record, "in.jsonl line 7")
