"""The `static` regeneration engine: flashdraft's own batched decode loop around the target's forward.

Plain `model.generate` spends most of a decode step at batch 500 on a small target in Python and kernel
launches (mask building, cache concatenation, logits processors), not in GPU work. This loop does the
minimum per step (docs/regeneration.md, "The static engine"):
- prompts sorted by length and left-padded so that all end at one column; prefilled once, in row chunks
  each as wide as its own longest prompt (short prompts are not computed over the longest one's padding);
- per-layer K/V buffers allocated once (`kv_cache.StaticKVCache`, the fast engine's too), written in place
  at one shared column per step;
- per-row position ids and a 4-D attention mask buffer updated in place (nothing rebuilt per step);
- greedy argmax, or `seeded_token` (per-row counter-based noise: the answer does not depend on its batch);
- stop ids checked on the device; the host looks at the finished flags only every `check_every` steps;
- on a GPU each decode step is captured once in a CUDA graph per attended-width bucket and replayed
  (no torch.compile); a failed capture falls back to eager steps and `describe()` says so;
- the 1-token decode attention reads each cached K and V once (`decode_attention.py`): the model is
  switched to it for the call and switched back after; with one batch, its rows (sorted longest prompt
  first) go in up to `row_groups` groups, each reading only the columns from its longest prompt's start
  (the rest is left padding, masked for all of them);
- `describe()` reports where the time went: prefill, capture and decode seconds, decode steps, rows;
- `on_answer`, when given, gets each answer at the first finished-flag check after its row stops.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from flashdraft.config import Sampling
from flashdraft.errors import FlashdraftError
from flashdraft.generate.decode_attention import KERNELS, use_decode_attention
from flashdraft.generate.engines import OnAnswer, batch_size_for_memory, cut_at_stop, report_rest
from flashdraft.generate.kv_cache import StaticKVCache
from flashdraft.generate.sampling import seeded_token
from flashdraft.model.target import text_config

_GPU_PAD_MULTIPLE = 64  # prompt widths and attended widths round up to this on a GPU (aligned SDPA masks)


def unsupported_reason(model) -> str | None:
    """Why the loop cannot drive this model's forward (None: it can). It needs every layer to be a full
    attention layer that stores its keys and values through `cache.update` and accepts explicit position
    ids and a ready 4-D mask (Llama, Qwen3 and their kin on transformers 5.17 and 5.24)."""
    text = text_config(model.config)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its layers are {', '.join(sorted(kinds))}: the static engine handles full attention only"
    if getattr(text, "layer_types", None) is None and getattr(text, "sliding_window", None):
        return "it has a sliding attention window: the static engine handles full attention only"
    accepted = inspect.signature(model.forward).parameters
    if not {"position_ids", "logits_to_keep"} <= set(accepted) or _cache_argument(model) is None:
        return "its forward takes no position ids, logits_to_keep or cache"
    return None


def _cache_argument(model) -> str | None:
    """transformers 5.24 names the cache argument `cache` (`past_key_values` is deprecated); 5.17 uses
    `past_key_values`."""
    accepted = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in accepted), None)


class StaticEngine:
    """`generate_ids(prompts, seeds)` with the lean decode loop; CUDA graphs on a GPU (see the module doc)."""

    name = "static"

    def __init__(
        self,
        model,
        sampling: Sampling,
        stops: list[int],
        pad_id: int,
        batch_size: int = 0,
        *,
        cuda_graphs: bool | None = None,
        bucket: int = 0,
        check_every: int = 16,
        prefill_tokens: int = 0,
        attention: str = "grouped",
        row_groups: int = 4,
    ):
        if attention not in (*KERNELS, "model"):
            raise FlashdraftError(
                f"static engine attention {attention!r}: expected one of {[*KERNELS, 'model']}"
            )
        reason = unsupported_reason(model)
        if reason:
            raise FlashdraftError(f"--engine static: cannot drive this target: {reason}; use --engine hf")
        self.model, self.sampling, self.stops, self.pad_id = model.eval(), sampling, stops, pad_id
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        on_gpu = self.device.type == "cuda"
        self.batch_size = batch_size  # 0: from free memory on a GPU, 64 on the CPU
        self.cuda_graphs = on_gpu if cuda_graphs is None else cuda_graphs
        self.pad_multiple = _GPU_PAD_MULTIPLE if on_gpu else 1
        self.bucket = bucket or (_GPU_PAD_MULTIPLE if on_gpu else 16)  # attended width rounds up to this
        self.check_every = check_every
        self.prefill_tokens = prefill_tokens or (65536 if on_gpu else 4096)  # rows x width per prefill
        self.cache_argument = _cache_argument(model)
        self.graph_failure: str | None = None  # why capture failed (then every step ran eagerly)
        self.graphs_captured = 0
        self.last_rows = 0
        self.attention = attention  # a kernel of decode_attention.KERNELS, or "model": its own attention
        self.attention_used = "not run yet"
        # decode attention by row groups of similar prompt length, each reading only its own columns
        # (decode_attention.by_row_groups); `groups` holds the current batch's (first row, end, column)
        self.row_groups = row_groups
        self.groups: tuple[tuple[int, int, int], ...] | None = None
        # totals over every generate_ids call: the manifest's record of where the time went
        self.timing = {"batches": 0, "decode_steps": 0, "prefill_s": 0.0, "capture_s": 0.0, "decode_s": 0.0}
        # the first batch's prefill, chunk by chunk: [rows, width, seconds] (where a slow prefill goes)
        self.prefill_chunks: list[list] = []

    # -- buffers of one generate_ids call -------------------------------------------------------------
    def _allocate(self, rows: int, total: int) -> None:
        device, max_new = self.device, self.sampling.max_new_tokens
        self.cache = StaticKVCache(self.model.config, rows, total, self.dtype, device)
        self.mask = torch.zeros(rows, 1, 1, total, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)
        self.generated = torch.zeros(rows, dtype=torch.long, device=device)  # new tokens so far per row
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.out = torch.zeros(rows, max_new + 1, dtype=torch.long, device=device)  # last column: discard
        self.stop_ids = torch.tensor(self.stops or [-1], dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _forward(self, **kwargs) -> torch.Tensor:
        kwargs[self.cache_argument] = self.cache
        return self.model(use_cache=True, **kwargs).logits[:, -1]

    def _advance(self, logits: torch.Tensor, rows: slice) -> None:
        """Choose each row's next token, record it and update the row's counters and finished flag."""
        generated, done = self.generated[rows], self.done[rows]
        if self.sampling.temperature > 0:
            choice = seeded_token(logits, self.seeds[rows], generated, self.sampling)
        else:
            choice = logits.argmax(-1)
        where = generated.masked_fill(done, self.sampling.max_new_tokens)  # a finished row writes nowhere
        self.out[rows].scatter_(1, where[:, None], choice[:, None])
        generated += (~done).long()
        stopped = (choice[:, None] == self.stop_ids[None, :]).any(-1)
        done |= stopped | (generated >= self.sampling.max_new_tokens)
        self.tokens[rows] = choice[:, None]

    def _step(self, visible: int) -> None:
        """One decode step for every row: the same kernels every time (this is what a CUDA graph holds)."""
        self.cache.visible = visible
        self.mask.scatter_(3, self.cache.columns[:, None, None, :], True)
        groups = {"row_groups": self.groups} if self.groups else {}
        logits = self._forward(
            input_ids=self.tokens,
            position_ids=self.positions,
            attention_mask=self.mask[..., :visible],
            **groups,
        )
        self._advance(logits, slice(None))
        self.cache.columns += 1
        self.positions += 1

    # -- CUDA graphs ----------------------------------------------------------------------------------
    def _graph(self, visible: int) -> torch.cuda.CUDAGraph | None:
        """The captured step for this attended width, or None: run the step eagerly."""
        if not self.cuda_graphs or self.graph_failure:
            return None
        return self.graphs.get(visible)

    def _decode_widths(self, first_column: int, total: int) -> list[int]:
        """The attended widths of the decode steps that write columns `first_column`.. (the first decode
        step writes at the batch's prompt width): the only ones worth a captured graph."""
        return sorted({self._visible(column, total) for column in range(first_column, total)})

    def _capture_all(self, widths: list[int]) -> None:
        """Capture one step per attended width of `widths`. Capturing runs nothing; the warm-up steps
        before it do run (on a side stream), which is harmless here: the prefill that follows resets
        every buffer they touched."""
        if not self.cuda_graphs or self.graph_failure or not widths:
            return
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: lazy initialisations happen outside capture
                for _ in range(2):
                    self._step(widths[0])
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.pool = torch.cuda.graph_pool_handle()
            for visible in widths:
                graph = torch.cuda.CUDAGraph()
                # every graph's own tensors are dead after its replay (results land in the buffers made
                # in _allocate), so one memory pool serves all of them
                with torch.cuda.graph(graph, pool=self.pool):
                    self._step(visible)
                self.graphs[visible] = graph
            self.graphs_captured = len(self.graphs)
        except Exception as exc:  # any capture failure: eager steps, recorded in describe()
            self.graphs.clear()
            self.graph_failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _clock(self) -> float:
        """Seconds now, after the device has finished what was queued (kernels run asynchronously on a
        GPU; called only between phases, never inside the decode loop)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _padded(self, length: int) -> int:
        """`length` rounded up to the padding multiple (tensor-core-friendly widths on a GPU)."""
        return -(-length // self.pad_multiple) * self.pad_multiple

    def _column_groups(self, lengths: list[int], width: int) -> tuple[tuple[int, int, int], ...] | None:
        """Up to `row_groups` groups of consecutive rows of one batch (lengths sorted longest first, every
        prompt ending at column `width`), each with the first column any of its rows needs (its longest
        prompt's start, rounded down to the padding multiple); None when no group could skip a column."""
        rows = len(lengths)
        count = max(1, min(self.row_groups, rows))
        groups: list[tuple[int, int, int]] = []
        for g in range(count):
            r0, r1 = g * rows // count, (g + 1) * rows // count
            if r0 == r1:
                continue
            first = width - self._padded(lengths[r0])
            if groups and groups[-1][2] == first:  # the same columns: one group
                groups[-1] = (groups[-1][0], r1, first)
            else:
                groups.append((r0, r1, first))
        return tuple(groups) if any(c0 > 0 for _, _, c0 in groups) else None

    def _visible(self, column: int, total: int) -> int:
        return min(total, -(-(column + 1) // self.bucket) * self.bucket)

    # -- one batch --------------------------------------------------------------------------------------
    def _prefill(self, prompts: list[list[int]], seeds: list[int], width: int) -> None:
        rows, device = len(prompts), self.device
        self.mask.zero_()
        self.generated.zero_()
        self.done.zero_()
        self.seeds.copy_(torch.tensor(seeds, dtype=torch.int64))
        self.cache.columns.fill_(width)
        record = not self.prefill_chunks  # the first batch only: the record stays short
        start = 0
        while start < rows:
            started = self._clock() if record else 0.0
            # Each chunk is only as wide as its own longest prompt (the batch comes sorted longest first),
            # so short prompts are not computed over the batch's widest padding; its keys go to the
            # columns that end at `width`, where every prompt of the batch ends.
            chunk = max(1, self.prefill_tokens // self._padded(len(prompts[start])))
            part = prompts[start : start + chunk]
            own = self._padded(max(len(prompt) for prompt in part))
            ids = torch.full((len(part), own), self.pad_id, dtype=torch.long)
            real = torch.zeros(len(part), own, dtype=torch.bool)
            for row, prompt in enumerate(part):  # left padding: every prompt ends at the last column
                ids[row, own - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
                real[row, own - len(prompt) :] = True
            ids, real = ids.to(device), real.to(device)
            lengths = real.sum(-1, keepdim=True)
            positions = (torch.arange(own, device=device)[None, :] - (own - lengths)).clamp(min=0)
            causal = torch.ones(own, own, dtype=torch.bool, device=device).tril()
            # a padding query sees only itself: a query that sees nothing would give NaN states, which
            # masked-out keys and values would still carry into real rows (0 x NaN)
            mask = (causal[None] & real[:, None, :]) | torch.eye(own, dtype=torch.bool, device=device)[None]
            rows_here = slice(start, start + len(part))
            with self.cache.prefilling(rows_here, slice(width - own, width)):
                logits = self._forward(
                    input_ids=ids, position_ids=positions, attention_mask=mask[:, None], logits_to_keep=1
                )
            self.mask[rows_here, 0, 0, width - own : width] = real
            self.positions[rows_here] = lengths
            self._advance(logits, rows_here)
            start += len(part)
            if record:
                self.prefill_chunks.append([len(part), own, round(self._clock() - started, 4)])

    def _decode(self, width: int, total: int, report: Callable[[], bool] | None = None) -> int:
        """Decode steps until every row has finished or `max_new_tokens`; returns the steps run. `report`
        (hands on the rows finished so far; True when all are) replaces the all-finished check."""
        steps = 0
        for n in range(1, self.sampling.max_new_tokens):
            column = width + n - 1
            visible = self._visible(column, total)
            graph = self._graph(visible)
            if graph is not None:
                graph.replay()
            else:
                self._step(visible)
            steps += 1
            if n % self.check_every:
                continue
            if report() if report is not None else bool(self.done.all()):  # the only host sync of the loop
                break
        return steps

    @torch.inference_mode()
    def generate_ids(
        self, prompts: list[list[int]], seeds: list[int], on_answer: OnAnswer | None = None
    ) -> list[list[int]]:
        with self._attention() as switched:
            if switched:
                self.attention_used = f"{self.attention} (K and V read once per step)"
            elif self.attention != "model":
                self.attention_used = "the model's own (it cannot switch its attention implementation)"
            else:
                self.attention_used = "the model's own (asked for)"
            # row groups live in our decode attention: only when the model runs on it
            return self._generate(prompts, seeds, our_attention=switched, on_answer=on_answer)

    def _attention(self):
        """The context that runs the model on the chosen decode attention (yields whether it took)."""
        return (
            nullcontext(False)
            if self.attention == "model"
            else use_decode_attention(self.model, self.attention)
        )

    def _generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        our_attention: bool,
        on_answer: OnAnswer | None = None,
    ) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        if not order:
            return out
        if any(not prompts[i] for i in order):
            raise FlashdraftError("--engine static: an empty prompt (the chat template rendered nothing)")
        max_new = self.sampling.max_new_tokens
        width = self._padded(len(prompts[order[0]]))
        total = width + max_new
        cap = self._rows(total)
        batches = -(-len(order) // cap)
        rows = -(-len(order) // batches)  # even batches: 1000 + 1000, not 1024 + 976
        self.last_rows = rows
        self._allocate(rows, total)
        # Row groups need the batch's prompt lengths when the steps are captured: with one batch (the
        # usual case on a GPU, where the rows come from free memory) they are known before the capture.
        self.groups = (
            self._column_groups([len(prompts[i]) for i in order], width)
            if batches == 1 and our_attention
            else None
        )
        # Graphs only for the widths a decode step attends to: from the narrowest batch's prompt width
        # on (a step never attends to fewer columns than its batch's prompts fill).
        first_column = min(self._padded(len(prompts[order[start]])) for start in range(0, len(order), rows))
        reported: set[int] = set()  # prompts whose answer on_answer has had
        timing, started = self.timing, self._clock()
        self._capture_all(self._decode_widths(first_column, total))
        timing["capture_s"] += self._clock() - started
        for start in range(0, len(order), rows):
            batch = order[start : start + rows]
            # rows beyond the batch repeat its last prompt (their answers are dropped): the shapes stay
            filled = batch + [batch[-1]] * (rows - len(batch))
            batch_width = self._padded(len(prompts[batch[0]]))
            started = self._clock()
            self._prefill([prompts[i] for i in filled], [seeds[i] for i in filled], batch_width)
            prefilled = self._clock()
            report = self._reporter(batch, on_answer, reported) if on_answer is not None else None
            timing["decode_steps"] += self._decode(batch_width, total, report)
            timing["decode_s"] += self._clock() - prefilled
            timing["prefill_s"] += prefilled - started
            timing["batches"] += 1
            counts = self.generated.tolist()
            for row, ids in enumerate(self.out[: len(batch)].tolist()):
                out[batch[row]] = cut_at_stop(ids[: counts[row]], self.stops)
            report_rest(on_answer, out, reported, batch)
        return out

    def _reporter(self, batch: list[int], on_answer: OnAnswer, reported: set[int]) -> Callable[[], bool]:
        """The decode loop's finished check that also hands each newly finished row of `batch` (prompt
        indices by row) to `on_answer`; returns whether every row has finished."""

        def report() -> bool:
            done = self.done.tolist()
            new = [row for row in range(len(batch)) if done[row] and batch[row] not in reported]
            if new:
                counts = self.generated.tolist()
                for row in new:
                    reported.add(batch[row])
                    on_answer(batch[row], cut_at_stop(self.out[row, : counts[row]].tolist(), self.stops))
            return all(done)

        return report

    @contextmanager
    def decode_step(self, rows: int, columns: int) -> Iterator[Callable[[], None]]:
        """A decode step of `rows` rows attending to `columns` filled columns (random keys and values), run
        as `generate_ids` runs it (its attention, a CUDA graph on a GPU), ready to be called repeatedly:
        for timing and profiling one step without a whole run (`flashdraft bench regen --step-time`)."""
        with torch.inference_mode(), self._attention():
            self._allocate(rows, columns)
            self._capture_all([columns])
            for buffer in self.cache.keys + self.cache.values:
                buffer.normal_()
            self.mask.fill_(True)
            self.positions.fill_(columns - 1)
            graph = self._graph(columns)

            def step() -> None:
                self.cache.columns.fill_(columns - 1)  # every step writes the last column again
                if graph is not None:
                    graph.replay()
                else:
                    self._step(columns)

            step()  # lazy initialisations, first-touch of the buffers
            try:
                yield step
            finally:
                self.graphs.clear()

    def step_seconds(self, rows: int, columns: int, repeats: int = 5) -> float:
        """Mean wall time of one `decode_step`, over `repeats` runs after an untimed one."""
        with self.decode_step(rows, columns) as step:
            started = self._clock()
            for _ in range(repeats):
                step()
            return (self._clock() - started) / repeats

    def _rows(self, total: int) -> int:
        if self.batch_size:
            return self.batch_size
        if self.device.type == "cuda":
            sampled = self.sampling.temperature > 0
            # sampling holds a few [rows, vocab] float64/int64 temporaries per step
            extra = 40 * text_config(self.model.config).vocab_size if sampled else 0
            return batch_size_for_memory(self.model, total, self.device, extra_per_row=extra)
        return 64

    def timing_record(self) -> dict:
        """Where the time of every call so far went (seconds, rounded), and the mean decode step."""
        t = self.timing
        return {
            "batches": t["batches"],
            "decode_steps": t["decode_steps"],
            "decode_s": round(t["decode_s"], 4),
            "decode_ms_per_step": round(1000 * t["decode_s"] / t["decode_steps"], 3)
            if t["decode_steps"]
            else None,
            "prefill_s": round(t["prefill_s"], 4),
            "prefill_chunks": self.prefill_chunks,
            "capture_s": round(t["capture_s"], 4),
        }

    def describe(self) -> dict:
        graphs = self.cuda_graphs and not self.graph_failure
        record = {
            "engine": self.name,
            "batch_size": self.batch_size or "auto",
            "rows": self.last_rows,
            "cuda_graphs": graphs,
            "kv_bucket": self.bucket,
            "decode_attention": self.attention_used,
            # the last batch's row groups: [first row, end row, first column read], or none
            "row_groups": [list(group) for group in self.groups] if self.groups else None,
            **self.timing_record(),
        }
        if self.cuda_graphs and self.graph_failure:
            record["cuda_graphs_failed"] = f"fell back to eager steps: {self.graph_failure}"
        return record
