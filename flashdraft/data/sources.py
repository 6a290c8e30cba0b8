"""Conversation records from local files: JSONL, JSON lists, Parquet, and `datasets` save-to-disk folders."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from flashdraft.data.chat import read_records
from flashdraft.errors import FlashdraftError


def iter_records(
    paths: list[str], on_error: Callable[[FlashdraftError], None] | None = None
) -> Iterator[tuple[dict, str]]:
    """(record, where) for every record of every input, in order; `where` names file and line or row.
    Malformed JSON lines raise, or go to `on_error` and are skipped."""
    for raw in paths:
        path = Path(raw)
        markers = ("dataset_info.json", "state.json", "dataset_dict.json")
        if path.is_dir() and any((path / m).exists() for m in markers):
            yield from _from_datasets_dir(path)
        elif path.is_dir():
            files = sorted([*path.glob("*.jsonl"), *path.glob("*.json"), *path.glob("*.parquet")])
            if not files:
                raise FlashdraftError(f"{path}: no .jsonl, .json or .parquet files")
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
    table = pq.read_table(path)
    for i, row in enumerate(table.to_pylist()):
        yield row, f"{path} row {i}"


def _from_datasets_dir(path: Path) -> Iterator[tuple[dict, str]]:
    try:
        import datasets
    except ImportError:
        raise FlashdraftError(
            f"{path}: reading a save_to_disk folder needs datasets (pip install datasets)"
        ) from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise FlashdraftError(f"{path}: a DatasetDict without a 'train' split ({list(data)})")
        data = data["train"]
    for i, row in enumerate(data):
        yield dict(row), f"{path} row {i}"
