"""`prepare` and the data loader never destroy a user's file, never leave a half-written shard set, and
turn every bad input into one line naming the file and line, the field or the flag."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from flashdraft.cli import main
from flashdraft.config import load_config
from flashdraft.data.regenerate import read_journal
from flashdraft.data.shards import write_shards
from flashdraft.data.tokens import load_token_dataset
from flashdraft.errors import FlashdraftError
from flashdraft.model.tiny import save_tiny_target
from flashdraft.run.doctor import _data
from flashdraft.train.trainer import train
from tests.filesystems import tmpfs

from .helpers import fake_chat_server, make_tokenizer

CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hi there"},
    ]
}
PAIR = {"prompt": "why", "response": "because 2+2 4"}
# Gemma / Mistral style: the template itself refuses a system turn.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write(path: Path, records, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prepare(inputs, target, out, *extra) -> list[str]:
    return ["prepare", *map(str, inputs), "--target", str(target), "--out", str(out), *extra]


def _one_line_error(capsys, argv) -> str:
    capsys.readouterr()  # earlier output (warnings of earlier steps) is not this error
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: ") and "\n" not in err
    return err


def _samples(out: Path) -> list[list[int]]:
    data = load_token_dataset([str(out)], max_length=4096, block_size=2)
    return [data[i].input_ids.tolist() for i in range(len(data))]


@pytest.fixture()
def no_tokenizer_load(monkeypatch):
    """The output checks must come before the (long) tokenizer load and regeneration."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the output was checked")

    monkeypatch.setattr("flashdraft.data.prepare.load_target_tokenizer", refuse)


# ---------------------------------------------------------------- never destroy the user's files


def test_out_containing_an_input_is_refused_and_the_input_survives(tmp_path, target, capsys):
    raw = _write(tmp_path / "shard-00000.jsonl", [CHAT])  # the user's own file with a shard's name
    before = raw.read_bytes()
    err = _one_line_error(capsys, _prepare([raw], target, tmp_path))
    assert f"--out {tmp_path} contains input {raw}" in err
    assert raw.read_bytes() == before
    assert "same path as input" in _one_line_error(capsys, _prepare([raw], target, raw))
    err = _one_line_error(capsys, _prepare([raw], target, target / "shards"))
    assert "lies inside --target" in err and not (target / "shards").exists()


def test_existing_directory_that_prepare_did_not_make_is_refused_without_force(tmp_path, target, capsys):
    data = _write(tmp_path / "in.jsonl", [CHAT, PAIR])
    out = tmp_path / "mine"
    out.mkdir()
    (out / "shard-00000.jsonl").write_text("my raw data\n")
    err = _one_line_error(capsys, _prepare([data], target, out))
    assert "no flashdraft manifest.json" in err and "--force" in err
    assert (out / "shard-00000.jsonl").read_text() == "my raw data\n"
    assert main([*_prepare([data], target, out), "--force"]) == 0  # the user said so
    assert len(_samples(out)) == 2


def test_rerun_into_its_own_output_replaces_it_but_not_a_foreign_file_inside(tmp_path, target, capsys):
    data = _write(tmp_path / "in.jsonl", [CHAT])
    out = tmp_path / "shards"
    assert main(_prepare([data], target, out)) == 0
    _write(data, [CHAT, PAIR])
    assert main(_prepare([data], target, out)) == 0  # normal usage: no --force needed
    assert len(_samples(out)) == 2
    (out / "notes.txt").write_text("keep me")
    err = _one_line_error(capsys, _prepare([data], target, out))
    assert "did not write (notes.txt)" in err and (out / "notes.txt").read_text() == "keep me"


def test_out_that_is_a_file_or_in_a_read_only_place_is_refused_before_any_work(
    tmp_path, target, capsys, no_tokenizer_load
):
    data = _write(tmp_path / "in.jsonl", [CHAT])
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert "is a file, not a directory" in _one_line_error(capsys, _prepare([data], target, a_file))
    assert "is a file, not a directory" in _one_line_error(capsys, _prepare([data], target, a_file / "sub"))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    assert "symbolic link" in _one_line_error(capsys, _prepare([data], target, link))
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as ro:
        err = _one_line_error(capsys, _prepare([data], target, ro / "shards"))
    assert "cannot write in" in err and "Read-only file system" in err


def test_disk_full_during_prepare_keeps_the_previous_shard_set(tmp_path, target, capsys):
    small = _write(tmp_path / "small.jsonl", [CHAT, PAIR])
    large = _write(tmp_path / "large.jsonl", [CHAT, PAIR] * 600)
    with tmpfs(tmp_path / "disk", "96k") as disk:
        out = disk / "shards"
        assert main(_prepare([small], target, out)) == 0
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        err = _one_line_error(capsys, _prepare([large], target, out))
        assert "No space left on device" in err and "previous shard set is unchanged" in err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert len(_samples(out)) == 2  # complete and readable
        assert [p.name for p in disk.iterdir()] == ["shards"]  # no temporary left


def test_incomplete_shards_are_refused_by_the_loader(tmp_path, target):
    data = _write(tmp_path / "in.jsonl", [CHAT, PAIR])
    out = tmp_path / "shards"
    assert main(_prepare([data], target, out)) == 0
    ids = out / "shard-00000.ids.u32"
    ids.write_bytes(ids.read_bytes()[:-4])  # a truncated copy
    with pytest.raises(FlashdraftError, match=r"shard-00000.ids.u32: \d+ bytes, its manifest.json says \d+"):
        _samples(out)


# ---------------------------------------------------------------- inputs: encodings, gzip, shapes


def test_gzipped_jsonl_and_json_inputs_are_read(tmp_path, target):
    jsonl = _write(tmp_path / "a.jsonl.gz", [CHAT], opener=gzip.open)
    with gzip.open(tmp_path / "b.json.gz", "wt") as handle:
        json.dump([PAIR], handle)
    out = tmp_path / "shards"
    assert main(_prepare([jsonl, tmp_path / "b.json.gz"], target, out)) == 0
    assert len(_samples(out)) == 2


def test_non_utf8_input_names_file_and_line_and_a_bom_is_accepted(tmp_path, target, capsys):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(
        json.dumps(CHAT).encode() + b"\n" + '{"prompt": "caf\xe9", "response": "ok"}\n'.encode("latin-1")
    )
    err = _one_line_error(capsys, _prepare([bad], target, tmp_path / "s"))
    assert f"{bad} line 2: not UTF-8 text" in err
    assert main([*_prepare([bad], target, tmp_path / "s"), "--skip-bad-records"]) == 0
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(CHAT).encode() + b"\n")
    assert main(_prepare([bom], target, tmp_path / "s2")) == 0


def test_a_chat_template_that_raises_names_the_conversation_and_its_message(tmp_path, capsys):
    tokenizer = make_tokenizer("qwen")
    tokenizer.chat_template = STRICT_TEMPLATE
    strict = save_tiny_target(
        tmp_path / "strict", "qwen3", vocab_size=64, hidden_size=32, num_layers=2, tokenizer=tokenizer
    )
    data = _write(tmp_path / "in.jsonl", [PAIR, CHAT])
    err = _one_line_error(capsys, _prepare([data], strict, tmp_path / "s"))
    assert (
        f"{data} line 2: the target's chat template refused this conversation: System role not supported"
        in err
    )
    assert main([*_prepare([data], strict, tmp_path / "s"), "--skip-bad-records"]) == 0
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["dropped"] == {"bad record": 1} and manifest["samples"] == 1


def test_vague_shape_messages_are_now_precise(tmp_path, target, capsys):
    data = _write(tmp_path / "in.jsonl", [{"messages": "hi there"}])
    assert "line 1: 'messages' must be a list of {role, content} objects, found a string" in _one_line_error(
        capsys, _prepare([data], target, tmp_path / "s")
    )
    data = _write(tmp_path / "in.jsonl", [{"question": "hi"}])
    assert "found keys 'question'" in _one_line_error(capsys, _prepare([data], target, tmp_path / "s"))
    data = _write(tmp_path / "in.jsonl", [{"prompt": "why", "completion": "because"}])
    assert main(_prepare([data], target, tmp_path / "s")) == 0  # the {prompt, completion} shape


def test_no_sample_kept_names_the_inputs_and_the_reasons(tmp_path, target, capsys):
    data = _write(tmp_path / "in.jsonl", [CHAT, PAIR])
    err = _one_line_error(capsys, _prepare([data], target, tmp_path / "s", "--max-length", "5"))
    assert f"no sample kept from {data} (2 longer than 5 tokens)" in err


# ---------------------------------------------------------------- manifests and tokenizers


@pytest.mark.parametrize(
    "manifest,needle",
    [
        ([1, 2], "expected a JSON object, found list"),
        ({"samples": 1}, "no 'shards' list"),
        ({"shards": ["shard-00000.jsonl", "shard-00001.jsonl"]}, "lists shard 'shard-00001.jsonl'"),
    ],
)
def test_bad_manifest_is_one_line_in_train_and_fails_the_doctor(tmp_path, target, manifest, needle):
    out = tmp_path / "shards"
    out.mkdir()
    (out / "shard-00000.jsonl").write_text(
        json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n"
    )
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FlashdraftError, match="manifest.json: " + needle.replace("(", r"\(")):
        _samples(out)
    config = load_config(None, [f"model.target={target}", f"data.train=[{out}]"])
    check = _data(config)
    assert check.ok is False and needle in check.detail and "manifest.json" in check.detail


def test_unverifiable_tokenizer_warns_and_ids_beyond_the_vocabulary_name_file_and_line(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    load_token_dataset([str(raw)], max_length=64, block_size=2, fingerprint={"tokenizer_sha256": "x"})
    assert f"warning: data {raw} has no flashdraft manifest.json: cannot verify" in capsys.readouterr().err

    shards = tmp_path / "shards"
    write_shards(shards, [([1, 2, 3], [0, 1, 1])], {"tokenizer_sha256": "y"})
    load_token_dataset(
        [str(shards)],
        max_length=64,
        block_size=2,
        fingerprint=None,
        target="T",
        allow_unverified_tokenizer=True,
    )
    assert "no tokenizer files next to T" in capsys.readouterr().err

    (raw / "a.jsonl").write_text(
        (raw / "a.jsonl").read_text() + json.dumps({"input_ids": [1, 64], "loss_mask": [0, 1]})
    )
    with pytest.raises(FlashdraftError, match=r"a.jsonl line 2: token id 64 >= the target vocabulary \(64\)"):
        load_token_dataset([str(raw)], max_length=64, block_size=2, vocab_size=64)


# ---------------------------------------------------------------- the regeneration journal


@pytest.fixture()
def server():
    """Answers with a word that depends on the question, so a stale answer is visible."""
    with fake_chat_server(
        lambda body: {"hi": "ok", "why": "because"}.get(body["messages"][-1]["content"], "sure")
    ) as fake:
        yield fake


def test_rerun_with_other_input_or_settings_never_reuses_a_stale_answer(tmp_path, target, server):
    data, out = tmp_path / "in.jsonl", tmp_path / "shards"
    regen = ["--regenerate", "--server-url", server.url]
    _write(data, [{"messages": [{"role": "user", "content": "hi"}]}])
    assert main([*_prepare([data], target, out), *regen]) == 0
    _write(data, [{"messages": [{"role": "user", "content": "why"}]}])  # same position, other question
    assert main([*_prepare([data], target, out), *regen]) == 0
    answers = {
        r.messages[0]["content"]: r.messages[-1]["content"]
        for r in read_journal(out / "regenerated.jsonl").values()
    }
    assert answers == {"hi": "ok", "why": "because"} and len(server.seen) == 2
    assert main([*_prepare([data], target, out), *regen]) == 0  # same input and settings: reused
    assert len(server.seen) == 2
    assert main([*_prepare([data], target, out), *regen, "--temperature", "0.5"]) == 0  # other settings
    assert len(server.seen) == 3 and server.seen[-1]["temperature"] == 0.5


def test_skip_bad_records_also_skips_conversations_that_cannot_be_rendered(tmp_path, target, capsys):
    starts_with_answer = {
        "messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "ok"}]
    }
    data = _write(tmp_path / "in.jsonl", [PAIR, starts_with_answer])
    assert "line 2: the conversation starts with an assistant turn" in _one_line_error(
        capsys, _prepare([data], target, tmp_path / "s")
    )
    assert main([*_prepare([data], target, tmp_path / "s"), "--skip-bad-records"]) == 0
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["dropped"] == {"bad record": 1} and manifest["samples"] == 1


def test_shards_against_a_target_without_tokenizer_files_are_refused_unless_allowed(tmp_path, target, capsys):
    """A target that ships no tokenizer cannot show the shards' ids are its own: train refuses, in one line
    naming the key that allows it, and trains once data.allow_unverified_tokenizer=true is set."""
    shards = tmp_path / "s"
    assert main(_prepare([_write(tmp_path / "in.jsonl", [CHAT, PAIR])], target, shards)) == 0
    bare = tmp_path / "bare-target"  # the same weights, no tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(target / name)
    overrides = [
        f"model.target={bare}",
        "model.num_layers=1",
        "model.block_size=2",
        "model.mask_token_id=60",
        f"data.train=[{shards}]",
        "train.max_steps=1",
        "train.num_anchors=4",
        "train.device=cpu",
        "train.resume=never",
        f"train.out_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(FlashdraftError) as refused:
        train(load_config(None, overrides))
    message = str(refused.value)
    assert "\n" not in message and f"data {shards}: made with tokenizer" in message
    assert "ships no tokenizer files" in message and "data.allow_unverified_tokenizer=true" in message
    capsys.readouterr()
    train(load_config(None, [*overrides, "data.allow_unverified_tokenizer=true"]))
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir()
    assert "cannot verify its token ids" in capsys.readouterr().err
