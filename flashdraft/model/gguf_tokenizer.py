"""The tokenizer a GGUF conversion writes, the file's own whichever transformers is installed
(docs/real-target.md, "The tokenizer of a GGUF file").

A llama.cpp file of tokenizer model `llama` (SentencePiece: Gemma, Llama 2, Mistral) stores its pieces with
a score each and no merge list: llama.cpp encodes by cutting the text at its user-defined pieces, then
repeatedly joining the adjacent pair whose joined piece has the best score. transformers rebuilds a
tokenizer from these fields itself, differently from one version to the next: 5.17 makes Gemma 3's a
Unigram model that cuts every word into characters ("The" -> "T", "h", "e") and adds no `<bos>`; 5.25 makes
a BPE that agrees except on runs of more than 31 spaces. Shards prepared under one version and a target
converted under another must not disagree, so the conversion builds the tokenizer here (`spm_tokenizer`),
the same everywhere, and checks it on a probe text against the rule written plainly (`spm_encode`). A
byte-level BPE file (`gpt2`: SmolLM2) carries its merges and keeps transformers' tokenizer, with the special
tokens the file names (5.17 names SmolLM2's bos, `<|im_start|>`, as its eos too).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from flashdraft.errors import FlashdraftError

# llama.cpp's token types (gguf.TokenType): normal pieces merge; control tokens (<bos>, <start_of_turn>)
# appear only where a template writes them; user-defined ones ("\n\n", runs of spaces, "<table>") are
# matched whole in the raw text before any merging; byte tokens (<0x41>) spell characters the pieces lack
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space

# what the check encodes: words, a number, punctuation, indented code, blank lines, a tab, characters only
# byte tokens can spell, and a multi-space run (the user-defined whitespace pieces)
PROBE = (
    "The capital of France is Paris. Tokenizers split 1234567 words, don't they?\n\n"
    "def mean(values):\n    return sum(values) / len(values)  # average\n\tx = [1, 2]\n"
    "Überraschung: naïve café, 東京, 🙂 and  two spaces."
)


@dataclass(frozen=True)
class GgufVocabulary:
    """The tokenizer fields of a GGUF file: its tokenizer model (`llama`: SentencePiece; `gpt2`: byte-level
    BPE), pieces, scores and token types, and the special tokens it names."""

    model: str
    pieces: list[str]
    scores: list[float] | None
    types: list[int]
    has_merges: bool
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_space_prefix: bool
    chat_template: str | None

    @property
    def sentencepiece(self) -> bool:
        """Pieces with scores and no merge list: the tokenizer is rebuilt here (module docstring)."""
        return self.model == "llama" and not self.has_merges and self.scores is not None

    @cached_property
    def ids(self) -> dict[str, int]:
        """Each piece's id (built once: 262K entries for Gemma 3)."""
        return {piece: i for i, piece in enumerate(self.pieces)}

    def of_type(self, kind: int) -> list[str]:
        return [piece for piece, t in zip(self.pieces, self.types, strict=True) if t == kind]

    def special_tokens(self) -> dict[str, str]:
        """bos, eos, unk and pad as the file names them."""
        named = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id}
        named["pad_token"] = self.pad_id
        return {
            key: self.pieces[i] for key, i in named.items() if i is not None and 0 <= i < len(self.pieces)
        }


def read_gguf_vocabulary(gguf_file: Path) -> GgufVocabulary | None:
    """The file's tokenizer fields, or None where it has no vocabulary. (Reading a 262K-piece file takes
    ~15 s, most of it the gguf reader's own parsing.)"""
    import gguf

    fields = gguf.GGUFReader(str(gguf_file)).fields

    def value(key: str, default=None):
        field = fields.get(f"tokenizer.ggml.{key}")
        return default if field is None else field.contents()

    pieces = value("tokens")
    if not pieces:
        return None
    scores, template = value("scores"), fields.get("tokenizer.chat_template")
    return GgufVocabulary(
        model=str(value("model", "")),
        pieces=list(pieces),
        scores=None if scores is None else [float(s) for s in scores],
        types=[int(t) for t in value("token_type", [NORMAL] * len(pieces))],
        has_merges="tokenizer.ggml.merges" in fields,
        bos_id=value("bos_token_id"),
        eos_id=value("eos_token_id"),
        unk_id=value("unknown_token_id"),
        pad_id=value("padding_token_id"),
        add_bos=bool(value("add_bos_token", True)),
        add_space_prefix=bool(value("add_space_prefix", True)),
        chat_template=None if template is None else template.contents(),
    )


def spm_encode(text: str, vocab: GgufVocabulary) -> list[int]:
    """llama.cpp's encoding of `text` (no special tokens added), written for clarity, not speed: the raw
    text is cut at user-defined pieces (longest first), and each stretch between them, spaces made
    visible (and one put in front where the file adds a space prefix), is merged pair by pair, the
    best-scoring joined piece first (the leftmost on a tie); characters no piece holds are spelled in byte
    tokens."""
    whole = sorted(vocab.of_type(USER_DEFINED), key=len, reverse=True)
    out: list[int] = []
    stretch, at = "", 0
    while at < len(text):
        match = next((p for p in whole if text.startswith(p, at)), None)
        if match is None:
            stretch, at = stretch + text[at], at + 1
            continue
        out += _merge_stretch(stretch, vocab)
        out.append(vocab.ids[match])
        stretch, at = "", at + len(match)
    return out + _merge_stretch(stretch, vocab)


def _merge_stretch(text: str, vocab: GgufVocabulary) -> list[int]:
    ids = vocab.ids
    if not text:
        return []
    symbols = list((SPACE if vocab.add_space_prefix else "") + text.replace(" ", SPACE))
    while True:
        best, where = None, -1
        for i in range(len(symbols) - 1):
            joined = ids.get(symbols[i] + symbols[i + 1])
            if joined is None or vocab.types[joined] != NORMAL:
                continue
            if best is None or vocab.scores[joined] > vocab.scores[best]:
                best, where = joined, i
        if best is None:
            break
        symbols[where : where + 2] = [symbols[where] + symbols[where + 1]]
    out = []
    for symbol in symbols:
        if symbol in ids:
            out.append(ids[symbol])
        else:
            out += [ids[f"<0x{byte:02X}>"] for byte in symbol.encode("utf-8")]
    return out


def spm_merges(vocab: GgufVocabulary) -> list[tuple[str, str]]:
    """The merge list of a BPE that joins pieces as llama.cpp does: every split of a normal piece into
    two pieces the vocabulary holds, ranked by the joined piece's score (best first); the splits of one
    piece follow each other, the better-scoring halves first."""
    ids = vocab.ids
    ranked = []
    for joined, piece in enumerate(vocab.pieces):
        if vocab.types[joined] != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = ids.get(piece[:cut]), ids.get(piece[cut:])
            if left is not None and right is not None:
                order = (-vocab.scores[joined], joined, -vocab.scores[left], -vocab.scores[right])
                ranked.append((order, piece[:cut], piece[cut:]))
    ranked.sort(key=lambda item: item[0])
    return [(left, right) for _, left, right in ranked]


def spm_tokenizer(vocab: GgufVocabulary):
    """A transformers fast tokenizer that encodes as `spm_encode` does: a BPE over the file's pieces with
    `spm_merges`, byte fallback, the user-defined pieces and control tokens matched whole, and `<bos>`
    added in front where the file says so."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials = vocab.special_tokens()
    backend = Tokenizer(
        BPE(
            vocab.ids,
            spm_merges(vocab),
            unk_token=specials.get("unk_token"),
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Replace(" ", SPACE)]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    undo = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        undo + ([decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else [])
    )
    backend.add_tokens([AddedToken(p, normalized=False) for p in vocab.of_type(USER_DEFINED)])
    backend.add_special_tokens(
        [AddedToken(p, normalized=False, special=True) for p in vocab.of_type(CONTROL)]
    )
    bos = specials.get("bos_token")
    if vocab.add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)]
        )
    if "<mask>" in vocab.ids:
        specials["mask_token"] = "<mask>"
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)


def disagreement(tokenizer, vocab: GgufVocabulary, text: str = PROBE) -> str | None:
    """Where `tokenizer` encodes `text` unlike llama.cpp (its first differing piece), or None."""
    expected = spm_encode(text, vocab)
    if vocab.add_bos and vocab.bos_id is not None:
        expected.insert(0, vocab.bos_id)
    got = list(tokenizer(text).input_ids)
    if got == expected:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
        min(len(got), len(expected)),
    )

    def show(ids: list[int]) -> str:
        return " ".join(repr(vocab.pieces[i]) for i in ids[max(0, at - 2) : at + 4])

    return (
        f"{len(got)} ids where the file's rule gives {len(expected)}; from id {at}: {show(got)} "
        f"where the file's rule has {show(expected)}"
    )


def file_tokenizer(gguf_file: Path, label: str):
    """The tokenizer a conversion writes. For a SentencePiece file, the BPE built here from its ranked
    pieces, with the file's chat template, the same whatever transformers is installed, checked against
    the file's rule on `PROBE` (a file it cannot encode rightly is refused, naming both encodings). For a
    byte-level BPE file, what transformers makes of its merges, with bos, eos, unk and pad as the file
    names them."""
    vocab = read_gguf_vocabulary(gguf_file)
    if vocab is None or not vocab.sentencepiece:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        for key, piece in (vocab.special_tokens() if vocab else {}).items():
            setattr(tokenizer, key, piece)
        return tokenizer
    tokenizer = spm_tokenizer(vocab)
    if vocab.chat_template:
        tokenizer.chat_template = vocab.chat_template
    problem = disagreement(tokenizer, vocab)
    if problem is not None:
        raise FlashdraftError(
            f"{label} {gguf_file}: flashdraft's tokenizer for its SentencePiece vocabulary does not encode as "
            f"the file's rule does ({problem})"
        )
    return tokenizer
