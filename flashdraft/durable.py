"""Durable, atomic writes: the one way flashdraft writes a file or a directory (docs/files.md).

Policy: write under a temporary name beside the final one, flush and fsync every file, rename into
place, fsync the parent directory. A reader sees the old content or the new, never half of either; once
a call returns, a crash or a power cut keeps the new content. On any failure the temporary is removed
and the final path is untouched, so nothing half-written is ever left under a name a reader trusts.

Writers do not always raise `OSError` on a full disk (`torch.save` raises `RuntimeError`, safetensors
its own error): `disk_full_reason` recognises a full disk from the filesystem itself, whatever the
exception.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Below this much free space after a failed write, the write failed because the disk is full.
_FULL_DISK_BYTES = 16 * 2**20


def _tmp_name(path: Path, suffix: str = "tmp") -> Path:
    # pid and thread: two writers of one file (ranks, the supervisor's threads) never share a temporary.
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident() % 100000}.{suffix}")


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and directory under `root` (files first, then their directories)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def atomic_write_by(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """For writers that take a path (a profiler's trace export, say): `write` writes a temporary beside
    `path`, which is then renamed into place whole; on failure the temporary is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    def write(tmp: Path) -> None:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    return atomic_write_by(path, write)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, data: Any, indent: int | None = 1) -> Path:
    return atomic_write_bytes(path, (json.dumps(data, indent=indent, default=str) + "\n").encode("utf-8"))


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for every thread, for a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def widen_to_umask(root: str | Path) -> None:
    """Give every file under `root` the read bits the umask allows: writers that go through their own
    private temporary (safetensors' save_file leaves 0600) would otherwise leave files only their owner
    can read, beside the 0644 ones written normally."""
    readable = 0o444 & ~_umask()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode) and (mode & readable) != readable:
                os.chmod(path, stat.S_IMODE(mode) | readable)


@contextlib.contextmanager
def atomic_directory(final: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside `final`; when the block ends without an exception its
    files are fsynced and it is renamed to `final`. An existing `final` is an error unless `replace`,
    and then it is swapped out only once the new directory is complete."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not replace:
        raise FileExistsError(errno.EEXIST, "already exists", str(final))
    tmp = _tmp_name(final, "partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        widen_to_umask(tmp)
        fsync_tree(tmp)
        if final.exists():
            old = _tmp_name(final, "old")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_partial(path: Path) -> bool:
    """A temporary left behind by a writer that died (`.NAME.PID-TID.partial|tmp|old`)."""
    return path.name.startswith(".") and path.name.endswith((".partial", ".tmp", ".old"))


def remove_partials(directory: str | Path) -> list[Path]:
    """Remove the temporaries of dead writers in `directory` (never anything else); returns them."""
    directory = Path(directory)
    removed = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if not is_partial(entry):
            continue
        pid = entry.name[1:].rsplit(".", 2)[-2].split("-")[0] if entry.name.count(".") >= 3 else ""
        if pid.isdigit() and _pid_alive(int(pid)):
            continue  # a live writer's temporary
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_bytes(path: str | Path) -> int | None:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def disk_full_reason(exc: BaseException, path: str | Path) -> str | None:
    """'No space left on device (N MiB free on PATH)' when `exc` came from a full disk, else None."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        full = True
    else:
        text = str(exc).lower()
        free = free_bytes(path)
        full = "no space left" in text or "enospc" in text or (free is not None and free < _FULL_DISK_BYTES)
    if not full:
        return None
    free = free_bytes(path)
    where = f"{free / 2**20:.1f} MiB free on {path}" if free is not None else str(path)
    return f"No space left on device ({where})"
