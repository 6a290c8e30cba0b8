"""Conversation records from local files: JSONL, JSON lists (either gzipped), Parquet, and `datasets`
save-to-disk folders. Text must be UTF-8 (a byte-order mark is accepted); every problem names the file and
line."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from flashdraft.data.chat import load_json, parse_json_object
from flashdraft.errors import FlashdraftError

TEXT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def _read_bytes(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise FlashdraftError(f"{path}: a directory, not a file") from None
    except OSError as exc:
        raise FlashdraftError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if path.name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise FlashdraftError(f"{path}: not a readable gzip file ({exc})") from None
    return data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not part of the text


def decode_line(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FlashdraftError(
            f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}: {exc.reason}); "
            "convert the file to UTF-8"
        ) from None


def text_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of every line of a possibly gzipped text file, streamed (shards are large)."""
    path = Path(path)
    number = 0
    try:
        with gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb") as handle:
            for number, raw in enumerate(handle, 1):
                if number == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")
                yield number, raw.rstrip(b"\r\n")
    except IsADirectoryError:
        raise FlashdraftError(f"{path}: a directory, not a file") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise FlashdraftError(f"{path} line {number + 1}: not a readable gzip file ({exc})") from None
    except OSError as exc:
        raise FlashdraftError(f"{path}: cannot read ({exc.strerror or exc})") from None


def json_lines(
    path: str | Path, on_error: Callable[[FlashdraftError], None] | None = None
) -> Iterator[tuple[dict, str]]:
    """(object, 'file line N') for every non-blank line of a JSONL file (gzipped or not). A line that is
    not UTF-8 or not a JSON object raises, or with `on_error` is reported to it and skipped."""
    for number, raw in text_lines(path):
        if not raw.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = parse_json_object(decode_line(raw, where), where)
        except FlashdraftError as exc:
            if on_error is None:
                raise
            on_error(exc)
            continue
        yield record, where


def read_records(
    path: str | Path, on_error: Callable[[FlashdraftError], None] | None = None
) -> list[tuple[dict, str]]:
    """(record, 'file line N') from a JSONL file, or from a JSON file holding a list (either may be
    gzipped). A malformed line is an error naming file and line, or, with `on_error`, reported to it and
    skipped (the other lines are kept)."""
    path = Path(path)
    if not path.exists():
        raise FlashdraftError(f"{path}: no such file")
    if path.name.endswith((".json", ".json.gz")):
        raw = _read_bytes(path)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise FlashdraftError(
                f"{path} line {line}: not UTF-8 text ({exc.reason}); convert the file to UTF-8"
            ) from None
        try:
            data = load_json(text, str(path))
        except json.JSONDecodeError as exc:
            raise FlashdraftError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise FlashdraftError(f"{path}: expected a JSON list of records, found {type(data).__name__}")
        records = []
        for i, record in enumerate(data):
            if isinstance(record, dict):
                records.append((record, f"{path} item {i}"))
                continue
            exc = FlashdraftError(f"{path} item {i}: expected a JSON object")
            if on_error is None:
                raise exc
            on_error(exc)
        return records
    return list(json_lines(path, on_error))


def iter_records(
    paths: list[str], on_error: Callable[[FlashdraftError], None] | None = None
) -> Iterator[tuple[dict, str]]:
    """(record, where) for every record of every input, in order; `where` names file and line or row.
    Malformed lines raise, or go to `on_error` and are skipped."""
    for raw in paths:
        path = Path(raw)
        markers = ("dataset_info.json", "state.json", "dataset_dict.json")
        if path.is_dir() and any((path / m).exists() for m in markers):
            yield from _from_datasets_dir(path)
        elif path.is_dir():
            files = sorted(
                p for p in path.iterdir() if p.is_file() and p.name.endswith((*TEXT_SUFFIXES, ".parquet"))
            )
            if not files:
                raise FlashdraftError(f"{path}: no .jsonl, .json, .jsonl.gz, .json.gz or .parquet files")
            yield from iter_records([str(f) for f in files], on_error)
        elif path.suffix == ".parquet":
            yield from _from_parquet(path)
        elif path.is_file():
            yield from read_records(path, on_error)
        else:
            raise FlashdraftError(f"{path}: no such file or directory")


def _from_parquet(path: Path) -> Iterator[tuple[dict, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise FlashdraftError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid / ArrowException types
        raise FlashdraftError(f"{path}: not a readable Parquet file ({exc})") from None
    for i, row in enumerate(table.to_pylist()):
        yield row, f"{path} row {i}"


def _from_datasets_dir(path: Path) -> Iterator[tuple[dict, str]]:
    try:
        import datasets
    except ImportError:
        raise FlashdraftError(
            f"{path}: reading a save_to_disk folder needs datasets (pip install datasets)"
        ) from None
    try:
        data = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise FlashdraftError(f"{path}: not a readable datasets folder ({exc})") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise FlashdraftError(f"{path}: a DatasetDict without a 'train' split ({list(data)})")
        data = data["train"]
    for i, row in enumerate(data):
        yield dict(row), f"{path} row {i}"
