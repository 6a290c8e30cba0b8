"""Checks on an output path, made before any long work starts (docs/inputs-and-outputs.md).

flashdraft never deletes or overwrites what it did not write: an output that is a file where a directory
is wanted (or the other way round), a symbolic link, or an existing non-empty directory that flashdraft
did not make is refused unless the user passes --force; and even --force never touches an input (the
target model, the data files): an output equal to, inside or around an input is always refused.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from flashdraft.errors import FlashdraftError


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def refuse_overlap(out: str | Path, flag: str, inputs: dict[str, str | Path]) -> None:
    """`out` must not be an input, lie inside one (a directory), or contain one: writing it would replace
    or delete the user's data. `inputs` maps a label ('--target') to a path."""
    real_out = _real(out)
    for label, raw in inputs.items():
        real_in = _real(raw)
        if real_out == real_in:
            raise FlashdraftError(f"{flag} {out} is the same path as {label} {raw}; choose another {flag}")
        if real_in in real_out.parents:
            raise FlashdraftError(f"{flag} {out} lies inside {label} {raw}; choose a path outside it")
        if real_out in real_in.parents:
            raise FlashdraftError(
                f"{flag} {out} contains {label} {raw}; replacing it would delete that input"
            )


def _check_parent_writable(out: Path, flag: str) -> None:
    """The nearest existing ancestor must be a writable directory (found now, not after hours of work)."""
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FlashdraftError(f"{flag} {out}: {ancestor} is a file, not a directory")
    _check_writable(ancestor, out, flag)


def _check_writable(directory: Path, out: Path, flag: str) -> None:
    # A probe rather than os.access: root passes access() on a directory it cannot write (read-only mount).
    try:
        probe = tempfile.mkdtemp(prefix=".flashdraft-probe-", dir=directory)
        os.rmdir(probe)
    except OSError as exc:
        raise FlashdraftError(
            f"{flag} {out}: cannot write in {directory} ({exc.strerror or exc}); choose a writable {flag}"
        ) from None


def check_writable_dir(out: str | Path, flag: str) -> None:
    """An output directory that may already hold this command's own files (a training run continued):
    it must be a directory, or creatable, and writable; found before any work, not at the first write."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise FlashdraftError(f"{flag} {out} is a file, not a directory; choose another {flag}")
    if path.is_dir():
        _check_writable(path, path, flag)
    else:
        _check_parent_writable(path, flag)


def check_output_dir(
    out: str | Path,
    flag: str,
    *,
    force: bool = False,
    inputs: dict[str, str | Path] | None = None,
    ours: Callable[[Path], str | None] | None = None,
) -> None:
    """Refuse `out` as an output directory unless it is absent, empty, ours, or `force` is given.

    `ours(path)` returns None when the existing directory is one this command made and may replace, else
    the reason it is not (named in the error)."""
    path = Path(out)
    refuse_overlap(path, flag, inputs or {})
    if path.is_symlink():
        raise FlashdraftError(f"{flag} {out} is a symbolic link; give the real directory path")
    if path.exists() and not path.is_dir():
        raise FlashdraftError(f"{flag} {out} is a file, not a directory; choose another {flag}")
    _check_parent_writable(path, flag)
    if not path.exists() or not any(path.iterdir()) or force:
        return
    reason = "it is not empty" if ours is None else ours(path)
    if reason is not None:
        raise FlashdraftError(
            f"{flag} {out} already exists and {reason}; pass --force to replace it, or choose another {flag}"
        )


def check_output_file(
    out: str | Path,
    flag: str,
    *,
    force: bool = False,
    inputs: dict[str, str | Path] | None = None,
    ours: Callable[[Path], bool] | None = None,
) -> None:
    """Refuse `out` as an output file: a directory or a link always, an existing file unless `force` or
    `ours(path)` says this command wrote it."""
    path = Path(out)
    refuse_overlap(path, flag, inputs or {})
    if path.is_symlink():
        raise FlashdraftError(f"{flag} {out} is a symbolic link; give the real file path")
    if path.is_dir():
        raise FlashdraftError(f"{flag} {out} is a directory; give a file path (inside it or elsewhere)")
    _check_parent_writable(path, flag)
    if path.exists() and not force and not (ours is not None and ours(path)):
        raise FlashdraftError(
            f"{flag} {out} already exists and flashdraft did not write it; pass --force to overwrite it"
        )
