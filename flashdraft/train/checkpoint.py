"""Training checkpoints: the drafter in the export format plus everything `resume` needs.

`<out_dir>/checkpoints/step-00000100/` holds `drafter/` (config.json + model.safetensors in the weights'
dtype) and `trainer_state.pt` (optimizer, with the fp32 master weights when the drafter trains in bf16;
scheduler, sampler position, RNG states, step, the run's resolved config and world size). The format and
its guarantees are in docs/training-safety.md:

- written through `durable.atomic_directory`: every file fsynced, then one rename, so a crash or a full
  disk leaves the previous checkpoints and no half-written one under a `step-*` name;
- `trainer_state.pt` holds tensors and plain values only and is read with `weights_only=True`: a
  checkpoint from someone else cannot run code when it is resumed;
- `resume=auto` verifies the latest checkpoint and falls back to the one before when it is damaged.
"""

from __future__ import annotations

import copy as copy_module
import pickle
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from flashdraft.durable import atomic_directory, disk_full_reason, remove_partials
from flashdraft.errors import FlashdraftError
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import CONFIG_NAME, WEIGHTS_NAME, load_drafter, save_drafter
from flashdraft.run_protocol import resume_hint

_STEP_DIR = re.compile(r"^step-(\d{8})$")
STATE_NAME = "trainer_state.pt"
DRAFTER_DIR = "drafter"
# Bumped when trainer_state.pt changes shape; a checkpoint of another format is refused by name.
STATE_FORMAT = 2


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Every `step-N` directory, oldest first (complete or not: `find_resume` verifies them)."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def remove_stale_partials(out_dir: str | Path) -> list[Path]:
    """Remove the temporary checkpoint directories of writers that died (a crash, a full disk)."""
    return remove_partials(checkpoint_root(out_dir))


# --------------------------------------------------------------------------- RNG states as tensors
# weights_only loading accepts tensors and plain values, not numpy arrays or arbitrary tuples' contents.


def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- writing


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    drafter: DFlashDraftModel,
    trainer_state: dict[str, Any],
    keep_last: int,
    rng: dict[str, Any] | None = None,
) -> Path:
    """Write `step-N` atomically and durably, then keep the last `keep_last`. Any failure removes the
    temporary directory; a full disk is reported as such (torch and safetensors do not raise OSError).
    `rng`: the RNG states to record, taken when the state was (default: now)."""
    rng = rng_state() if rng is None else rng
    root = checkpoint_root(out_dir)
    final = root / f"step-{step:08d}"
    full: str | None = None
    try:
        with atomic_directory(final, replace=True) as tmp:
            try:
                # In the weights' own dtype: with bf16 weights the fp32 masters are in the optimizer state,
                # and an fp32 copy of bf16 values would only add 2 bytes per parameter to every write.
                save_drafter(drafter, tmp / DRAFTER_DIR, dtype=next(drafter.parameters()).dtype)
                torch.save({**trainer_state, "format": STATE_FORMAT, "rng": rng}, tmp / STATE_NAME)
            except Exception as exc:
                full = disk_full_reason(exc, root)  # measured while the temporary still fills the disk
                raise
    except (OSError, RuntimeError, SafetensorError) as exc:
        full = full or disk_full_reason(exc, root)
        if full:
            raise FlashdraftError(
                f"checkpoint step {step}: disk full writing {root}: {full}; the earlier checkpoints are intact "
                f"(free space, or lower train.keep_last, then {resume_hint()})"
            ) from None
        raise FlashdraftError(
            f"checkpoint step {step}: cannot write {root}: {type(exc).__name__}: {exc}"
        ) from exc
    for old in list_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- writing off the step's path


@dataclass
class WrittenCheckpoint:
    step: int
    path: Path
    copy_seconds: float  # on the step's path: waiting for the previous write, then the copy to the host
    write_seconds: float  # in the writer's thread: files, fsync, rename, pruning

    def line(self) -> str:
        return (
            f"checkpoint step {self.step}: {_megabytes(self.path)} written in {self.write_seconds:.2f} s in the background "
            f"(the step paid {self.copy_seconds:.2f} s for the copy) -> {self.path}"
        )


def _megabytes(directory: Path) -> str:
    """A checkpoint's size on disk, for the line that says it was written."""
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return f"{size / 1e6:.1f} MB"


class CheckpointWriter:
    """Checkpoints off the step's path: `save` copies the state to host memory (pinned, reused from one
    save to the next, on CUDA; a plain copy on the CPU) and returns; a thread writes it through
    `save_checkpoint` (fsync, rename: crash safety unchanged). A second `save` waits only while the first
    still writes. `poll` (every step) reports a finished write (its line with the write's own seconds,
    the heartbeat's `checkpoint` and `checkpoint_write_seconds`) and raises a failed write's error; `wait` does both after the last
    write, and the final save and a stop go through it. The thread is not a daemon: a job that fails
    meanwhile still completes the write before its interpreter exits."""

    def __init__(self, heartbeat: Any = None, say: Callable[[str], None] = print):
        self.heartbeat, self.say = heartbeat, say
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written: list[WrittenCheckpoint] = []
        self._host: dict[str, torch.Tensor] = {}  # host buffers by place in the state, reused
        self._reserving: threading.Thread | None = None  # allocating them ahead of the first save

    def reserve(self, drafter: DFlashDraftModel, trainer_state: dict[str, Any]) -> None:
        """Allocate, in a background thread, the pinned host buffers that `save` copies the state into.
        Pinned memory for a multi-GB state takes seconds to allocate (14 s of a 5-layer drafter's 14.7 GB
        on an H200, docs/distributed.md), which the first save would otherwise pay on the step's path; the
        copy itself then costs a fraction of a second. Called once the optimizer's state exists (after a
        step); a no-op for a state on the CPU, whose copies need no pinned memory."""
        places: list[tuple[str, torch.Tensor]] = []
        self._to_host(drafter.state_dict(), "weights", into=places)
        self._to_host(trainer_state, "state", into=places)
        wanted = [(where, t.shape, t.dtype) for where, t in places if t.is_cuda]
        if wanted and self._reserving is None:
            self._reserving = threading.Thread(
                target=self._allocate, args=(wanted,), name="checkpoint-host-buffers", daemon=True
            )
            self._reserving.start()

    def _allocate(self, wanted: list[tuple[str, torch.Size, torch.dtype]]) -> None:
        for where, shape, dtype in wanted:  # torch.empty lets the GIL go: the training thread runs on
            self._host[where] = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)

    def save(
        self,
        out_dir: str | Path,
        step: int,
        drafter: DFlashDraftModel,
        trainer_state: dict[str, Any],
        keep_last: int,
    ) -> None:
        started = time.perf_counter()
        if self._reserving is not None:  # the buffers `reserve` allocates (long done, normally)
            self._reserving.join()
        self.wait()  # the previous write, if it still runs (and its error, if it failed)
        rng = rng_state()  # the step's RNG states, as a synchronous save took them
        on_device = drafter.state_dict()
        weights = self._to_host(on_device, "weights")
        state = self._to_host(trainer_state, "state")
        if any(t.is_cuda for t in on_device.values()):
            torch.cuda.synchronize()  # the non-blocking copies have landed before the thread reads them
        with torch.device("meta"):
            copy = type(drafter)(drafter.config)  # holds the host copy; nothing allocated beyond it
        copy.load_state_dict(weights, assign=True)
        copy_seconds = time.perf_counter() - started
        self._thread = threading.Thread(
            target=self._write,
            args=(out_dir, step, copy, state, keep_last, rng, copy_seconds),
            name=f"checkpoint-writer-{step}",
        )
        self._thread.start()

    def _write(self, out_dir, step, drafter, state, keep_last, rng, copy_seconds) -> None:
        started = time.perf_counter()
        try:
            path = save_checkpoint(out_dir, step, drafter, state, keep_last, rng=rng)
        except BaseException as exc:  # raised in the training thread, at its next poll
            self._error = exc
            return
        written = WrittenCheckpoint(step, path, copy_seconds, time.perf_counter() - started)
        self._written.append(written)

    def _to_host(self, tree: Any, where: str, into: list[tuple[str, torch.Tensor]] | None = None) -> Any:
        """A copy of `tree` that the training loop cannot change: tensors into host buffers, containers
        anew (the sampler's state dict, say, moves on with the next step). With `into`: nothing copied,
        each tensor and the buffer place it would take listed there instead (for `reserve`)."""
        if isinstance(tree, torch.Tensor):
            tensor = tree.detach()
            if into is not None:
                into.append((where, tensor))
                return None
            buffer = self._host.get(where)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(
                    tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda
                )
                self._host[where] = buffer
            return buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if isinstance(tree, dict):
            return {k: self._to_host(v, f"{where}/{k}", into) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(self._to_host(v, f"{where}/{i}", into) for i, v in enumerate(tree))
        return None if into is not None else copy_module.deepcopy(tree)

    def poll(self) -> list[WrittenCheckpoint]:
        """Report the writes finished since the last call; raise the error of one that failed."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        written, self._written = self._written, []
        for done in written:
            self.say(done.line())
            if self.heartbeat is not None:
                self.heartbeat.beat(
                    checkpoint=str(done.path), checkpoint_write_seconds=round(done.write_seconds, 3)
                )
        return written

    def settle(self, run_error: BaseException, out_dir: str | Path) -> BaseException:
        """On the way out of a failing run: let the write in progress finish and report it; return the
        error to raise. That is the run's, unless both came from a full disk: the checkpoint's error then
        says it best (the step, the earlier checkpoints intact, how to resume), and a write elsewhere (the
        metrics, say) can lose the race to it under load. Otherwise the write's error is printed."""
        try:
            self.wait()
        except Exception as exc:
            if disk_full_reason(run_error, out_dir) and disk_full_reason(exc, out_dir):
                return exc
            self.say(f"the checkpoint being written when the run failed was not completed: {exc}")
        return run_error

    def wait(self) -> list[WrittenCheckpoint]:
        """Until the write in progress, if any, is complete; then as `poll`."""
        if self._thread is not None:
            if self.heartbeat is not None and self._thread.is_alive():
                self.heartbeat.beat("checkpointing")
            self._thread.join()
        return self.poll()


# --------------------------------------------------------------------------- reading and resuming


def load_trainer_state(path: Path) -> dict[str, Any]:
    """Read `trainer_state.pt` with `weights_only=True`; a pickle that needs more than tensors and plain
    values (it could run code) is refused, naming the file and the object it asked for."""
    file = path / STATE_NAME
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found is None:  # not an object it refused: bytes that are no pickle torch writes (damaged)
            reason = re.search(
                r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", " ".join(str(exc).split())
            )
            raise FlashdraftError(
                f"{file}: cannot read: not a trainer state ({reason.group(1) if reason else 'unpickling failed'}); "
                "the file is damaged"
            ) from None
        raise FlashdraftError(
            f"{file}: refused: it holds a pickled object ({found.group(1)}) beyond tensors and plain values, "
            "which could run code when loaded; flashdraft writes none, so this file was not written by this "
            "version of flashdraft or was tampered with"
        ) from None
    except Exception as exc:  # garbage makes the unpickler fail in its own ways (IndexError, KeyError...)
        raise FlashdraftError(
            f"{file}: cannot read ({type(exc).__name__}: {exc}); the file is damaged".replace("\n", " ")
        ) from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise FlashdraftError(
            f"{file}: trainer state format {got!r}, expected {STATE_FORMAT} (written by another flashdraft "
            "version); start over in a new train.out_dir"
        )
    return state


@dataclass
class ResumePoint:
    """A verified checkpoint: its directory, its trainer state and its drafter (fp32, on the CPU)."""

    path: Path
    state: dict[str, Any]
    drafter: DFlashDraftModel


def verify_checkpoint(path: Path) -> ResumePoint:
    """Every file present, the trainer state loads, the drafter loads; else a FlashdraftError saying why."""
    for name in (STATE_NAME, f"{DRAFTER_DIR}/{CONFIG_NAME}", f"{DRAFTER_DIR}/{WEIGHTS_NAME}"):
        if not (path / name).is_file():
            raise FlashdraftError(f"checkpoint {path}: {name} is missing")
    state = load_trainer_state(path)
    drafter = load_drafter(path / DRAFTER_DIR, dtype=torch.float32)
    return ResumePoint(path, state, drafter)


def find_resume(
    resume: str, out_dir: str | Path, *, log: Callable[[str], None] = print, set_aside: bool = True
) -> ResumePoint | None:
    """'auto': the latest checkpoint in out_dir that verifies, if any; 'never': none; else that path.

    With 'auto', a damaged checkpoint (a torn file, a missing one) is skipped with a line saying which
    and why, renamed `step-N.damaged` when `set_aside` (so that pruning and later resumes pass it by),
    and the one before is used. 'never' into an out_dir that holds another run's checkpoints is an error:
    the two runs' step directories would interleave, and a later `resume=auto` could pick the older
    run's latest step."""
    if resume == "never":
        found = list_checkpoints(out_dir)
        if found:
            raise FlashdraftError(
                f"train.resume=never, but train.out_dir={out_dir} already holds checkpoints of a run "
                f"({found[0].name} .. {found[-1].name}); continue it with train.resume=auto, or start over in "
                f"another train.out_dir (or delete {checkpoint_root(out_dir)})"
            )
        return None
    if resume == "auto":
        found = list_checkpoints(out_dir)
        for path in reversed(found):
            try:
                point = verify_checkpoint(path)
            except FlashdraftError as exc:
                aside = path.with_name(f"{path.name}.damaged")
                moved = ""
                if set_aside:
                    try:
                        path.rename(aside)
                        moved = f"; moved to {aside.name}"
                    except OSError:
                        pass
                log(f"resume: skipping checkpoint {path.name}: {exc}{moved}")
                continue
            return point
        if found:
            raise FlashdraftError(
                f"train.resume=auto: none of the {len(found)} checkpoint(s) in {checkpoint_root(out_dir)} is "
                "complete (see the lines above); resume from a path or start over in another train.out_dir"
            )
        return None
    path = Path(resume)
    if not (path / STATE_NAME).is_file():
        raise FlashdraftError(f"train.resume={resume}: not a checkpoint directory (no {STATE_NAME})")
    return verify_checkpoint(path)
