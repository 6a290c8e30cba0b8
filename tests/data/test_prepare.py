"""`flashdraft prepare` end to end: shapes in, shards + manifest out, bad input named, regeneration through
an OpenAI-compatible server and in-process, resumable after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.data.regenerate import read_journal
from flashdraft.data.shards import open_shards
from flashdraft.errors import FlashdraftError
from flashdraft.model.tiny import save_tiny_target
from flashdraft.train.trainer import train

from .helpers import fake_chat_server, make_tokenizer

CONVS = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hi there"},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "2+2"},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "why"},
            {"from": "gpt", "value": "because"},
        ]
    },
    {"prompt": "why", "response": "because 2+2 4"},
    {"messages": [{"role": "user", "content": "thanks"}]},  # no assistant turn
]


def _by_first_user(journal: dict) -> dict:
    """Journaled conversations by their first user turn (the journal is keyed by hashes)."""
    return {
        next(m["content"] for m in done.messages if m["role"] == "user"): done.messages
        for done in journal.values()
    }


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prepare_writes_shards_manifest_and_trains(tmp_path, target, capsys):
    data = _write(tmp_path / "in.jsonl", CONVS * 4)
    out = tmp_path / "shards"
    assert main(["prepare", str(data), "--target", str(target), "--out", str(out), "--thinking", "on"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == 12 and manifest["dropped"] == {"no assistant turn": 4}
    assert manifest["tokens"] > manifest["supervised_tokens"] > 0 and len(manifest["tokenizer_sha256"]) == 64
    assert "prepare" in manifest["command"] and [s["name"] for s in manifest["shards"]] == ["shard-00000"]
    ids, mask = open_shards(out)[1].sample(0)
    assert len(ids) == len(mask) == 22 and int(mask.sum()) == 4
    printed = capsys.readouterr().out
    assert "samples kept" in printed and "supervised fraction" in printed
    # where the command's time went: every phase before the write in the manifest, the write too on screen
    # (called in-process, the command has no start-up of its own to report)
    assert list(manifest["seconds"]) == ["checks", "tokenizer", "read_and_check", "render"]
    assert all(value >= 0 for value in manifest["seconds"].values()) and "write " in printed

    run = tmp_path / "run"
    train(
        load_config(
            None,
            [
                f"model.target={target}",
                "model.mask_token_id=60",
                "model.num_layers=1",
                "model.block_size=2",
                f"data.train=[{out}]",
                f"train.out_dir={run}",
                "train.max_steps=2",
                "train.num_anchors=4",
                "train.device=cpu",
                "train.resume=never",
            ],
        )
    )
    assert (run / "checkpoints" / "step-00000002").is_dir()


def test_shards_from_another_tokenizer_are_refused(tmp_path, target):
    data = _write(tmp_path / "in.jsonl", CONVS)
    other = save_tiny_target(
        tmp_path / "other",
        "qwen3",
        vocab_size=64,
        hidden_size=32,
        num_layers=4,
        tokenizer=make_tokenizer("llama"),
    )
    out = tmp_path / "shards"
    assert main(["prepare", str(data), "--target", str(other), "--out", str(out)]) == 0
    with pytest.raises(FlashdraftError, match="made with another tokenizer"):
        train(
            load_config(
                None,
                [
                    f"model.target={target}",
                    "model.mask_token_id=60",
                    f"data.train=[{out}]",
                    f"train.out_dir={tmp_path / 'run'}",
                    "train.device=cpu",
                ],
            )
        )


def test_over_long_samples_are_dropped_with_the_reason(tmp_path, target, capsys):
    data = _write(tmp_path / "in.jsonl", CONVS[:3])
    assert (
        main(
            [
                "prepare",
                str(data),
                "--target",
                str(target),
                "--out",
                str(tmp_path / "s"),
                "--max-length",
                "23",
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["dropped"] == {"longer than 23 tokens": 1} and manifest["samples"] == 2
    assert "longer than 23 tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad,needle",
    [
        (
            '{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n',
            "in.jsonl line 2: invalid JSON",
        ),
        ('{"messages": []}\n', "in.jsonl line 1: empty conversation"),
        (
            '{"messages": [{"role": "wizard", "content": "hi"}]}\n',
            "in.jsonl line 1: message 0 has unknown role 'wizard'",
        ),
    ],
)
def test_bad_input_is_named_and_nothing_is_written(tmp_path, target, capsys, bad, needle):
    (tmp_path / "in.jsonl").write_text(bad)
    assert (
        main(["prepare", str(tmp_path / "in.jsonl"), "--target", str(target), "--out", str(tmp_path / "s")])
        == 2
    )
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "s" / "manifest.json").exists() and not list(tmp_path.glob("s/shard-*"))


def test_skip_bad_records_reports_each_and_keeps_the_other_lines(tmp_path, target, capsys):
    lines = [
        json.dumps(CONVS[0]),
        '{"messages": [',
        json.dumps(CONVS[2]),
        '{"messages": [{"role": "wizard", "content": "x"}]}',
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "s"
    assert (
        main(
            [
                "prepare",
                str(tmp_path / "in.jsonl"),
                "--target",
                str(target),
                "--out",
                str(out),
                "--skip-bad-records",
            ]
        )
        == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["samples"] == 2 and manifest["dropped"] == {"bad record": 2}
    assert manifest["bad_records"][0].endswith("in.jsonl line 2: invalid JSON (Expecting value)")
    assert "in.jsonl line 4: message 0 has unknown role 'wizard'" in manifest["bad_records"][1]
    assert "skipped" in capsys.readouterr().out


def test_parquet_and_datasets_folders(tmp_path, target):
    import datasets

    rows = [{"messages": c["messages"]} for c in CONVS[:1]] * 3
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "in.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for source in ("in.parquet", "ds"):
        out = tmp_path / f"out-{source}"
        assert main(["prepare", str(tmp_path / source), "--target", str(target), "--out", str(out)]) == 0
        assert json.loads((out / "manifest.json").read_text())["samples"] == 3


@pytest.fixture()
def server():
    with fake_chat_server(lambda body: "ok" if len(body["messages"]) < 3 else "sure") as fake:
        yield fake.url, fake


def test_regenerate_through_an_openai_compatible_server(tmp_path, target, server):
    url, handler = server
    data = _write(tmp_path / "in.jsonl", CONVS)
    out = tmp_path / "s"
    assert (
        main(
            [
                "prepare",
                str(data),
                "--target",
                str(target),
                "--out",
                str(out),
                "--regenerate",
                "--server-url",
                url,
                "--thinking",
                "off",
                "--temperature",
                "0.7",
                "--concurrency",
                "4",
            ]
        )
        == 0
    )
    done = _by_first_user(read_journal(out / "regenerated.jsonl"))
    assert [m["content"] for m in done["2+2"] if m["role"] == "assistant"] == [
        "ok",
        "sure",
    ]  # turn 2 sees regenerated turn 1
    assert done["thanks"][-1] == {
        "role": "assistant",
        "content": "ok",
    }  # prompt-only conversations get an answer too
    assert all(
        b["chat_template_kwargs"] == {"enable_thinking": False} and b["temperature"] == 0.7
        for b in handler.seen
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["regeneration"]["engine"] == "server" and manifest["regeneration"]["temperature"] == 0.7
    assert manifest["samples"] >= 4
    assert list(manifest["seconds"]) == ["checks", "tokenizer", "read_and_check", "regenerate", "render"]


def test_regeneration_killed_midway_resumes_without_duplicates_or_loss(tmp_path, target, server):
    url, handler = server
    # The server answers two chunks (8 requests), then holds the next requests: the run is killed while it
    # waits there, with exactly two chunks journaled, however slowly a loaded machine runs it.
    handler.hold_after = 8
    data = _write(tmp_path / "in.jsonl", [CONVS[0]] * 24)
    out = tmp_path / "s"
    cmd = [
        sys.executable,
        "-m",
        "flashdraft",
        "prepare",
        str(data),
        "--target",
        str(target),
        "--out",
        str(out),
        "--regenerate",
        "--server-url",
        url,
        "--chunk",
        "4",
        "--concurrency",
        "2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # both of its connections held: nothing else is in flight, and chunk 3 starts after chunk 2 is journaled
        assert handler.wait_held(2), "prepare never reached its third chunk"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    journal = out / "regenerated.jsonl"
    kept = read_journal(journal)
    assert len(kept) == 8 and not (out / "manifest.json").exists()
    asked_before = len(handler.seen)
    handler.release()
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    lines = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    keys = [r["key"] for r in lines]
    assert len(keys) == len(set(keys)) == 24  # no duplicate, no loss (identical conversations: distinct keys)
    assert len(handler.seen) - asked_before == 24 - len(kept)  # finished ones were not asked again
    assert json.loads((out / "manifest.json").read_text())["samples"] == 24


def test_in_process_regeneration_is_the_targets_own_greedy_answer(tmp_path, target, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    data = _write(tmp_path / "in.jsonl", [CONVS[0]])
    out = tmp_path / "s"
    args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
    # The random target does not end its turn within 6 tokens: the answer is journaled with its finish
    # reason, and with --cut-answers drop not taught (the only conversation is dropped: nothing is kept).
    assert main([*args, "--max-new-tokens", "6", "--cut-answers", "drop"]) == 2
    assert "1 answer cut at --max-new-tokens 6" in capsys.readouterr().err
    (regenerated,) = read_journal(out / "regenerated.jsonl").values()
    assert regenerated.finish_reasons == ["length"]
    answer = regenerated.messages[-1]["content"]
    tok = make_tokenizer("qwen")
    model = AutoModelForCausalLM.from_pretrained(target)
    prompt = tok.apply_chat_template(CONVS[0]["messages"][:2], add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    # an explicit mask: the prompt contains the eos id, which generate() would otherwise take for padding
    expected = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )
    assert answer == tok.decode(expected[0, len(prompt) :], skip_special_tokens=True)


def test_an_answer_cut_at_max_new_tokens_is_dropped_and_counted(tmp_path, target):
    """Guard: a regenerated answer that ended at the token limit is not taught as a finished answer."""
    with fake_chat_server(lambda body: ("cut sho", "length") if "2+2" in str(body) else "ok") as fake:
        data = _write(tmp_path / "in.jsonl", CONVS)
        out = tmp_path / "s"
        args = ["prepare", str(data), "--target", str(target), "--out", str(out), "--regenerate"]
        assert main([*args, "--server-url", fake.url, "--max-new-tokens", "7", "--cut-answers", "drop"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dropped"]["answer cut at --max-new-tokens 7"] == 1
    assert manifest["conversations"] == len(CONVS) - 1
    reasons = [r.finish_reasons for r in read_journal(out / "regenerated.jsonl").values()]
    assert ["length"] in [sorted(set(r)) for r in reasons]
