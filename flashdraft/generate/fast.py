"""Speculative and plain decoding on static buffers, batched, CUDA graphs on a GPU (docs/decoding.md,
"The fast engine").

The eager loop (`speculative.py`) pays transformers' per-token Python and a growing `DynamicCache` at
every step. This engine keeps the same algorithm and changes only where the state lives:

- the target's K/V sit in the one static cache (`kv_cache.StaticKVCache`: per layer `[rows, KV heads,
  width, head dim]`), written in place at each row's own columns; the drafter's context K/V likewise
  (`_context`), so nothing grows;
- a rejected draft needs no rollback for full or sliding attention: a row's keys past its committed length
  are masked out by the next step's mask and overwritten by its next verify (sliding layers keep every
  key and their mask sees only the window);
- a Gated DeltaNet hybrid's linear layers keep their conv and recurrent states in per-row buffers of the
  cache (`linear_state.StaticHybridCache`): a verify leaves them unchanged and, after acceptance, each row
  takes the state of its own committed tokens in one batched pass (a gather and a masked replay of the
  delta rule), inside the step a CUDA graph holds;
- rows are ragged: each has its own committed length, accepts its own count per step, finishes on its
  own, and is refilled with the next prompt at once (`generate` over many prompts);
- acceptance, the stop check, the output writes and the next anchor are computed on the device; the host
  reads one small tensor per run of steps (how many tokens each row committed in each, and which rows
  still decode: the stop check), `sync_every` steps on a GPU, every step on the CPU;
- on a GPU one step (draft forward, verify forward, acceptance) is captured in a CUDA graph per attended
  width bucket and replayed, the step's model code compiled first (`compile_for_decoding`: the target's
  decoder layers, fused and run as one loop where they can be, the drafter's block forward and context
  projection, the acceptance; docs/decoding.md, "Compiled steps"); on the CPU, or when capture fails,
  the same step runs eagerly.

Block size 1 skips the drafter: plain decoding through the same engine, the speedup's baseline.
Sampled decoding follows the eager loop draw for draw: each row has its own `torch.Generator`, seeded
with its prompt's seed when the row is admitted, and draws per step what the eager loop draws with that
generator (Exp(1) races for the drafts, B-1 uniforms and one Exp(1) row for the acceptance, whatever the
row's block was cut to at the token limit), so a prompt's tokens do not depend on its batch. A row whose
remaining budget is shorter than the block proposes only that many drafts, as the eager loop's cut block
does: the drafter's mask hides the block positions past it.
What it does not decode (`unsupported_reason`) runs on the eager loop, which stays the reference this
engine is tested against.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashdraft.distributed.parallelize import DecodingCompile, compile_for_decoding, compiled_engine_function
from flashdraft.generate import linear_state
from flashdraft.generate.kv_cache import StaticKVCache, step_masks
from flashdraft.generate.sampling import (
    check_sampling,
    exponential_noise,
    one_hot_probs,
    race,
    rejection_rows,
    sample,
    sampling_probs,
)
from flashdraft.generate.speculative import Generation
from flashdraft.model.attention import LayerKind, decoding_attention_kernels, dense_mask
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.fused_decoder import FusedProjections
from flashdraft.model.fused_stack import STACK_TOLERANCE, FusedStack, stack_difference, stack_twin
from flashdraft.model.target import TargetModel

_GPU_BUCKET = 64  # attended widths round up to this on a GPU (one CUDA graph per bucket)
# steps run between two looks of the host on a GPU, where each look costs an idle GPU: the step's sync,
# the copy back, the host's bookkeeping and the next launch (a third of a small model's step)
_GPU_SYNC_EVERY = 8
_MAX_SYNC_EVERY = 64
_CPU_BUCKET = 16


def unsupported_reason(
    target: TargetModel, drafter: DFlashDraftModel | None, temperature: float
) -> str | None:
    """Why the fast engine cannot decode this (None: it can). It needs a target whose layers are full or
    sliding-window attention storing their keys through `cache.update` and taking a per-layer-type dict
    of ready 4-D masks (Llama, Qwen3 and their kin), or Gated DeltaNet linear attention (Qwen3.5/3.6,
    Qwen3-Next: `linear_state.py`); a DFlash2 drafter decodes greedily only (its sampled candidate walk
    draws through `torch.multinomial`, row by row)."""
    from flashdraft.generate.static import unsupported_reason as static_reason

    text = target.config
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if "hybrid" in kinds:
        return "its hybrid layers hold attention keys and a recurrent state in one layer"
    if kinds - {"full_attention", "sliding_attention", "linear_attention"}:
        return (
            f"its layers are {', '.join(sorted(kinds))}: the fast engine handles full and sliding attention "
            "and Gated DeltaNet linear attention"
        )
    if kinds == {"full_attention"}:
        reason = static_reason(target.model)
        if reason:
            return reason
    elif "sliding_attention" in kinds and not isinstance(getattr(text, "sliding_window", None), int):
        return "its sliding layers name no sliding_window"
    elif not {"position_ids", "logits_to_keep"} <= set(inspect.signature(target.model.forward).parameters):
        return "its forward takes no position ids or logits_to_keep"
    if "linear_attention" in kinds:
        reason = linear_state.unsupported_reason(target)
        if reason:
            return reason
    if temperature != 0 and drafter is not None and getattr(drafter, "candidate_selector", None) is not None:
        return "a DFlash2 drafter samples its candidate walk on the eager loop"
    return None


@dataclass
class _Row:
    """What the host keeps of a row in flight: which prompt it decodes and its acceptance lengths."""

    prompt: int
    prompt_len: int
    accepted: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0


def greedy_acceptance(logits: Tensor, block_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification of every row's block `block_ids` [rows, B] (anchor, then B-1 drafts) against
    the target's `logits` [rows, B, V]: the tokens each row would commit (the target's after each block
    position) and how many, the accepted drafts (those equal to the target's token) and the bonus."""
    committed = logits.argmax(-1)
    produced = torch.ones(block_ids.shape[0], dtype=torch.long, device=block_ids.device)
    if block_ids.shape[1] > 1:
        produced = produced + (block_ids[:, 1:] == committed[:, :-1]).long().cumprod(-1).sum(-1)
    return committed, produced


def draft_inputs(
    embed: Callable[[Tensor], Tensor],
    anchor: Tensor,
    start: Tensor,
    offsets: Tensor,
    proposed: Tensor,
    context_columns: Tensor,
    mask_id: int,
    kinds: tuple[LayerKind, ...],
) -> tuple[Tensor, dict[str, Tensor]]:
    """The drafter's input of a step: every row's block (its `anchor`, then B-1 mask tokens) embedded, and
    per layer kind its mask [rows, 1, B, visible + B]: the block at the row's `start` attends to the
    row's context columns before its anchor (`context_columns`, the attended width's) and to its first
    `proposed` + 1 block positions (a block cut at the token limit, as the eager loop cuts it)."""
    rows, block = anchor.shape[0], offsets.shape[0]
    ids = torch.cat([anchor[:, None], anchor.new_full((rows, block - 1), mask_id)], 1)
    visible = context_columns.shape[0]
    in_block = (offsets[None, :] <= proposed[:, None])[:, None, None, :]  # [rows, 1, 1, B]
    keep = torch.ones(rows, 1, dtype=torch.bool, device=anchor.device)
    masks = {}
    for kind in kinds:
        mask = dense_mask(start[:, None], keep, context_columns[None].expand(rows, -1), block, kind)
        masks[kind.key] = torch.cat([mask[..., :visible], mask[..., visible:] & in_block], -1)
    return embed(ids), masks


def stack_check_layout(queries: int, device: torch.device | str = "cpu") -> tuple[int, Tensor]:
    """The fused stack check's cache width and its two rows' positions [2, queries]: one block near the
    cache's start, one ending a column before its end. Both lie inside the cache at any block size: an
    index past it is a device-side assert on a GPU, which no `except` catches (a fixed width of 16 made
    every block of 14 or more abort the first compiled step)."""
    width = max(16, queries + 8)
    starts = torch.tensor([[3], [width - queries - 1]], device=device)
    return width, starts + torch.arange(queries, device=device)


def greedy_drafts(drafter: DFlashDraftModel, hidden: Tensor, lm_head_weight: Tensor) -> Tensor:
    """The drafter's greedy tokens [rows, B-1] of its hidden states at the block positions 1..."""
    return drafter.compute_logits(hidden, lm_head_weight).argmax(-1)


def candidate_walk(
    drafter: DFlashDraftModel, hidden: Tensor, anchor: Tensor, lm_head_weight: Tensor
) -> Tensor:
    """A DFlash2 drafter's greedy tokens [rows, B-1]: its candidate walk over the block (about nine small
    kernels a position eager, one graph compiled; a step cost 1.42 ms against DFlash's 1.19 ms with it
    eager, docs/real-target.md)."""
    return drafter.propose(hidden, anchor, lm_head_weight, 0.0)[0]


def write_context(
    context_kv: list[tuple[Tensor, Tensor]], new: list[tuple[Tensor, Tensor]], positions: Tensor
):
    """Each drafter layer's context keys and values [rows, heads, n, d] of a step written into its cache
    at every row's own columns, the `positions` [rows, n]."""
    for (k, v), (keys, values) in zip(new, context_kv, strict=True):
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        keys.scatter_(2, index, k)
        values.scatter_(2, index, v)


def settle(
    committed: Tensor,
    produced: Tensor,
    active: Tensor,
    count: Tensor,
    start: Tensor,
    anchor: Tensor,
    out: Tensor,
    stop_ids: Tensor,
    offsets: Tensor,
    max_new: int,
    report: Tensor,
    step_index: Tensor,
) -> Tensor:
    """Every row's step settled in place: of the `produced` first tokens of `committed` [rows, B], those up
    to the row's first stop token and within its token budget are kept (an idle row keeps none) and
    written to `out` at the row's count; the row's anchor, position (`start`), count and `active` advance.
    The kept counts go to `report`'s row `step_index` (which advances) and the rows' activity to its last
    row, for the host to read after a run of steps; returns the kept counts."""
    block = committed.shape[1]
    in_reach = offsets[None, :] < produced[:, None]
    stop_hit = (committed[:, :, None] == stop_ids).any(-1) & in_reach
    first_stop = torch.where(stop_hit, offsets[None, :], block).min(-1).values
    produced = torch.minimum(produced, first_stop + 1)
    produced = torch.minimum(produced, max_new - count)
    produced = torch.where(active, produced, 0)
    write = offsets[None, :] < produced[:, None]
    columns = torch.where(write, count[:, None] + offsets, max_new)
    out.scatter_(1, columns, committed)
    last = committed.gather(1, (produced - 1).clamp(min=0)[:, None])[:, 0]
    anchor.copy_(torch.where(produced > 0, last, anchor))
    start += produced
    count += produced
    stopped = (stop_hit & write).any(-1)
    active &= ~(stopped | (count >= max_new))
    report.index_copy_(0, (step_index % (report.shape[0] - 1)).view(1), produced[None])
    report[-1] = active.long()
    step_index += 1
    return produced


@dataclass(frozen=True)
class StepFunctions:
    """A step's own code around the model calls (some fifty small kernels eager): as written, or each
    compiled whole with the model code (`compiled`)."""

    greedy_acceptance: Callable = greedy_acceptance
    settle: Callable = settle
    draft_inputs: Callable = draft_inputs
    greedy_drafts: Callable = greedy_drafts
    write_context: Callable = write_context
    candidate_walk: Callable = candidate_walk

    @classmethod
    def compiled(cls) -> StepFunctions:
        """Each function compiled once per process; the drafter's context width is dynamic from the
        first compile (one graph for every width)."""
        return cls(
            *map(compiled_engine_function, (greedy_acceptance, settle)),
            compiled_engine_function(draft_inputs, width_args=(5,)),
            *map(compiled_engine_function, (greedy_drafts, write_context, candidate_walk)),
        )


class FastEngine:
    """`generate(prompts, seeds)`: speculative decoding (plain with block size 1) of many prompts, `rows`
    at a time, greedy or sampled; every output and every acceptance length equals the eager loop's
    (tests/infer/test_fast_engine*.py, tests/generate/test_fast_engine*.py)."""

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDraftModel | None,
        max_new_tokens: int,
        *,
        block_size: int | None = None,
        stop_token_ids: list[int] | None = None,
        rows: int = 1,
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        bucket: int = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        draft_sampling: str = "sample",
        sync_every: int | None = None,
    ):
        check_sampling(temperature, top_p, top_k)
        if sync_every is not None and not 1 <= sync_every <= _MAX_SYNC_EVERY:
            raise ValueError(f"sync_every {sync_every}: expected 1 to {_MAX_SYNC_EVERY}")
        if draft_sampling not in ("sample", "argmax"):
            raise ValueError(f"draft_sampling {draft_sampling!r}: expected 'sample' or 'argmax'")
        reason = unsupported_reason(target, drafter, temperature)
        if reason:
            raise ValueError(f"the fast engine cannot decode this: {reason}")
        self.target, self.drafter = target, drafter
        self.block = 1 if drafter is None else (block_size or drafter.block_size)
        if self.block > 1 and drafter is None:
            raise ValueError("a block size above 1 needs a drafter")
        if drafter is not None:
            drafter.eval()
        self.max_new = max_new_tokens
        self.stops = list(stop_token_ids or [])
        self.rows = rows
        self.device = target.device
        on_gpu = self.device.type == "cuda"
        self.cuda_graphs = on_gpu if cuda_graphs is None else cuda_graphs
        self.bucket = bucket or (_GPU_BUCKET if on_gpu else _CPU_BUCKET)
        self.sync_every = sync_every or (_GPU_SYNC_EVERY if self.cuda_graphs else 1)
        self.graph_failure: str | None = None
        # the fused stack against the model forward (`_check_stack`)
        self.stack_difference: float | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the step's model code compiled (docs/decoding.md, "Compiled steps"): by default where graphs are
        self.compiled: DecodingCompile | None = None
        self.compile_note: str | None = None
        if self.cuda_graphs if compile is None else compile:
            compiled = compile_for_decoding(target, drafter)
            self.compiled = None if compiled.refusal else compiled
            self.compile_note = f"eager model code: {compiled.refusal}" if compiled.refusal else None
        # the step's own code around the model calls: compiled with the model code
        self.step_functions = StepFunctions.compiled() if self.compiled is not None else StepFunctions()
        self.cache_argument = target._cache_kwarg
        sliding = "sliding_attention" in (getattr(target.config, "layer_types", None) or [])
        self.window: int | None = int(target.config.sliding_window) if sliding else None
        # Gated DeltaNet layers: their states sit in the cache's per-row buffers (linear_state.py)
        self.mixers = linear_state.linear_mixers(target)
        self.timing = {"steps": 0, "decode_s": 0.0, "prefill_s": 0.0, "capture_s": 0.0}
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.sampled = temperature > 0
        self.draft_sampling = draft_sampling
        self.selector = getattr(drafter, "candidate_selector", None)  # a DFlash2 drafter's
        # the drafter's attention kinds, each with its own block mask (`draft_inputs`)
        kinds = set(drafter.layer_kinds()) if drafter is not None else set()
        self.draft_kinds = tuple(sorted(kinds, key=lambda kind: kind.key))
        # one random stream per row, reseeded with each prompt's seed when the row is admitted
        self.generators = [torch.Generator(device=self.device) for _ in range(rows)]

    # -- buffers ---------------------------------------------------------------------------------------
    def _allocate(self, width: int) -> None:
        rows, block, device = self.rows, self.block, self.device
        self.width = width
        config, dtype = self.target.model.config, self.target.dtype
        # compiled, the buffers keep one column that is never attended: dynamo takes a slice that spans a
        # whole buffer for a special case and would fix the graph's width there
        columns = width + 1 if self.compiled is not None else width
        if self.mixers:
            self.kv = linear_state.StaticHybridCache(
                config, self.mixers, rows, width, dtype, device, queries=block
            )
        else:
            self.kv = StaticKVCache(
                config, rows, columns, dtype, device, queries=block, layer_views=self.compiled is not None
            )
        self.anchor = torch.zeros(rows, dtype=torch.long, device=device)  # each row's last committed token
        self.start = torch.zeros(rows, dtype=torch.long, device=device)  # the anchor's position
        self.count = torch.zeros(rows, dtype=torch.long, device=device)  # tokens generated so far
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        # what the host reads after a run of steps: each step's committed counts, then the rows' activity
        self.report = torch.zeros(_MAX_SYNC_EVERY + 1, rows, dtype=torch.long, device=device)
        self.step_index = torch.zeros((), dtype=torch.long, device=device)  # the run's step, its report row
        self.out = torch.zeros(rows, self.max_new + 1, dtype=torch.long, device=device)  # last: discard
        self.stop_ids = torch.tensor(self.stops or [-1], dtype=torch.long, device=device)
        self.offsets = torch.arange(block, device=device)
        self.column_index = torch.arange(width, device=device)
        if self.drafter is not None:
            layer = self.drafter.layers[0].self_attn
            shape = (rows, layer.num_kv_heads, columns, layer.head_dim)
            dtype = self.drafter.fc.weight.dtype
            self.context_kv = [
                (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                for _ in self.drafter.layers
            ]
        self.graphs.clear()

    def _masks(self, columns: Tensor, positions: Tensor) -> Tensor | dict[str, Tensor | None]:
        """The target's attention masks (`step_masks`); a hybrid's linear layers take none (no padding)."""
        masks = step_masks(columns, positions, self.window)
        if not self.mixers:
            return masks
        by_kind = masks if isinstance(masks, dict) else {"full_attention": masks}
        return {**by_kind, "linear_attention": None}

    def _bucketed(self, columns: int) -> int:
        """`columns` rounded up to the bucket (split attention's alignment rule)."""
        return -(-columns // self.bucket) * self.bucket

    def _visible(self, end: int) -> int:
        """The attended width for keys up to column `end` (exclusive), rounded up to the bucket."""
        return min(self.width, self._bucketed(end))

    # -- the drafter's context cache -----------------------------------------------------------------
    def _context(self, features: Tensor, positions: Tensor, rows: slice | None = None) -> None:
        """Write the drafter's context K/V of target `features` [r, n, F] at absolute `positions` [r, n]
        (which are also their columns), for `rows` (all when None). The same projections as the drafter's
        own forward: fc, hidden_norm, rope, and each layer's key_value."""
        if rows is not None:  # a prompt's (any length): eager, at columns 0..n-1
            for (k, v), (keys, values) in zip(
                self.drafter.context_key_values(features, positions), self.context_kv, strict=True
            ):
                keys[rows, :, : k.shape[2]] = k
                values[rows, :, : k.shape[2]] = v
            return
        project = (
            self.drafter.context_key_values if self.compiled is None else self.compiled.context_key_values
        )
        self.step_functions.write_context(self.context_kv, project(features, positions), positions)

    def _draft(self, positions: Tensor, visible: int, proposed: Tensor) -> Tensor:
        """The drafter's hidden states [rows, B-1, H] at block positions 1.. of every row's block (its
        anchor, then mask tokens) at `positions` (`draft_inputs`)."""
        embedded, masks = self.step_functions.draft_inputs(
            self.target.embed,
            self.anchor,
            self.start,
            self.offsets,
            proposed,
            self.column_index[:visible],
            self.mask_id,
            self.draft_kinds,
        )
        forward = self.drafter.forward_cached if self.compiled is None else self.compiled.drafter_forward
        return forward(embedded, positions, masks, self.context_kv, self.block)[:, 1:]

    def _proposals(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """Draft tokens [rows, B-1] and, when sampling, the distributions q [rows, B-1, V] they came from
        (as the eager loop's `_propose`: argmax, an Exp(1) race per row from its generator, or a DFlash2
        drafter's greedy candidate walk)."""
        vocab = self.target.vocab_size
        if self.selector is not None:  # DFlash2, greedy (sampled DFlash2 is refused up front)
            return self.step_functions.candidate_walk(
                self.drafter, hidden, self.anchor, self.target.lm_head_weight
            ), None
        if not self.sampled:
            return self.step_functions.greedy_drafts(self.drafter, hidden, self.target.lm_head_weight), None
        logits = self.drafter.compute_logits(hidden, self.target.lm_head_weight)
        if self.draft_sampling == "argmax":
            drafts = logits.argmax(-1)
            return drafts, one_hot_probs(drafts, vocab)
        q = sampling_probs(logits, self.temperature, self.top_p, self.top_k)
        shape = (self.block - 1, q.shape[-1])
        noise = torch.stack([exponential_noise(shape, g, self.device) for g in self.generators])
        return race(q, noise), q

    # -- one step: what a CUDA graph holds -------------------------------------------------------------
    def _step(self, visible: int) -> None:
        """Draft, verify and accept for every row; writes the outputs and advances the rows in place."""
        block = self.block
        positions = self.start[:, None] + self.offsets  # [rows, B]
        # drafts each row proposes: B-1, or fewer where its token budget ends first (the eager loop's cut)
        proposed = torch.clamp(self.max_new - self.count, min=0, max=block - 1)
        block_ids, draft_probs = self.anchor[:, None], None
        if block > 1:
            drafts, draft_probs = self._proposals(self._draft(positions, visible, proposed))
            block_ids = torch.cat([block_ids, drafts], 1)
        logits, features = self._verify(block_ids, positions, visible)
        # committed [rows, B]: the tokens each row would commit, the first `produced` of them kept
        if self.sampled:
            committed, produced = self._sampled_accept(logits, block_ids, draft_probs, proposed)
        else:
            committed, produced = self.step_functions.greedy_acceptance(logits, block_ids)
        if block > 1:  # the verified positions' features: the context of the rows' next blocks
            self._context(features, positions)
        produced = self.step_functions.settle(
            committed,
            produced,
            self.active,
            self.count,
            self.start,
            self.anchor,
            self.out,
            self.stop_ids,
            self.offsets,
            self.max_new,
            self.report,
            self.step_index,
        )
        if self.mixers and block > 1:  # each row's linear states: its committed tokens' (an idle row's: kept)
            self.kv.commit(produced)

    def _verify(self, block_ids: Tensor, positions: Tensor, visible: int) -> tuple[Tensor, Tensor]:
        """The target's logits and features of every row's block at `positions`, its keys written at their
        columns: through the fused stack where the step has one, else through the model's forward."""
        mask = self._masks(self.column_index[:visible], positions)
        self.kv.columns.copy_(positions)
        self.kv.visible = visible
        if self.compiled is not None and self.compiled.stack is not None:
            return self.compiled.stack.step(block_ids, positions, mask, self.kv)
        rollback = bool(self.mixers) and self.block > 1  # linear states: kept as they were until `commit`
        with self.kv.verifying() if rollback else nullcontext():
            output, features = self.target._run_with_capture(
                stop_early=False,
                input_ids=block_ids,
                position_ids=positions,
                attention_mask=mask,
                use_cache=True,
                **{self.cache_argument: self.kv},
            )
        return output.logits, features

    def _check_stack(self) -> None:
        """The fused stack's step against the model's own forward (transformers' layers, eager) on an fp32
        copy of the target's first two layers (`stack_twin`), random tokens at random positions over a
        cache of random keys, so that a model forward doing more than the stack's loop is caught before
        it decodes anything; a difference past `STACK_TOLERANCE` sends the steps through the model's
        forward, and the engine's record says why."""
        if self.compiled is None or self.compiled.stack is None:
            return
        known = self.compiled.fused.stack_difference  # the target's, checked by an engine before
        try:
            self.stack_difference = known if known is not None else self._stack_difference()
        except Exception as exc:  # a loop the check cannot run is one it has not proven
            self.compiled.refuse_stack(f"its fused stack could not be checked: {_first_line(exc)}")
            return
        self.compiled.fused.stack_difference = self.stack_difference
        if self.stack_difference > STACK_TOLERANCE:
            self.compiled.refuse_stack(
                f"its fused stack differed from its model forward by {self.stack_difference:.3g} "
                "(relative, fp32)"
            )

    def _stack_difference(self) -> float:
        twin = stack_twin(self.target)
        g = torch.Generator(device=self.device).manual_seed(0)
        width, positions = stack_check_layout(self.block, self.device)
        rows, queries = positions.shape
        ids = torch.randint(0, twin.vocab_size, positions.shape, generator=g, device=self.device)
        masks = step_masks(torch.arange(width, device=self.device), positions, self.window)
        caches = []
        for views in (False, True):  # the same random keys in both
            cache = StaticKVCache(
                twin.model.config, rows, width, torch.float32, self.device, queries, layer_views=views
            )
            g.manual_seed(1)
            for buffer in [*cache.keys, *cache.values]:
                buffer.copy_(torch.randn(buffer.shape, generator=g, device=self.device))
            cache.columns.copy_(positions)
            caches.append(cache)
        kernels = self.compiled.stack.projections[0].kernels  # the check computes as the steps do
        stack = FusedStack(twin, [FusedProjections(layer, kernels) for layer in twin.layers])
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # no TF32: fp32 rounding only
        try:
            reference = twin._run_with_capture(
                stop_early=False,
                input_ids=ids,
                position_ids=positions,
                attention_mask=masks,
                use_cache=True,
                **{self.cache_argument: caches[0]},
            )
            stacked = stack.step(ids, positions, masks, caches[1])
        finally:
            torch.set_float32_matmul_precision(precision)
        return stack_difference((reference[0].logits, reference[1]), stacked)

    def _sampled_accept(
        self, logits: Tensor, block_ids: Tensor, draft_probs: Tensor | None, proposed: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Rejection sampling of every row's drafts (`sampling.rejection_rows`), each row's randomness from
        its own generator as the eager loop draws it: B-1 uniforms, then one Exp(1) row. Returns the
        committed tokens [rows, B] (the accepted drafts, then the sampled token) and their count."""
        vocab = logits.shape[-1]
        p = sampling_probs(logits, self.temperature, self.top_p, self.top_k)  # [rows, B, V]
        if self.block == 1:  # plain sampled decoding: one token from p, as the eager loop's pick
            noise = torch.cat([exponential_noise((1, vocab), g, self.device) for g in self.generators])
            return race(p[:, 0], noise)[:, None], torch.ones_like(proposed)
        uniforms = torch.stack(
            [torch.rand(self.block - 1, generator=g, device=self.device) for g in self.generators]
        )
        noise = torch.cat([exponential_noise((1, vocab), g, self.device) for g in self.generators])
        drafts = block_ids[:, 1:]
        accepted, token = rejection_rows(drafts, draft_probs, p, proposed, uniforms, noise)
        committed = torch.cat([drafts, token[:, None]], 1).scatter(1, accepted[:, None], token[:, None])
        return committed, accepted + 1

    # -- compiled steps and CUDA graphs ---------------------------------------------------------------
    def _warm_up(self, widths: list[int]) -> None:
        """Eager steps on idle rows (they change nothing a later admission does not reset), before any row
        is admitted and before any capture: one, for CUDA graphs alone (lazy initialisation stays out of the
        capture); with compiled model code, at the first width twice and at the last once: it builds its
        graphs here (widths dynamic from the first compile; the last width would show a graph that needed
        another), never inside a capture. A compile that fails leaves the model
        code eager, and the engine's record says why."""
        side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else nullcontext():
            warm_widths = (widths[0], widths[0], widths[-1]) if self.compiled is not None else (widths[0],)
            try:
                self._check_stack()
                for visible in warm_widths:
                    self._step(visible)
            except Exception as exc:
                if self.compiled is None:
                    raise
                self.compiled.undo()
                self.compiled, self.kv.layer_views = None, False
                self.step_functions = StepFunctions()
                self.compile_note = f"compile failed, eager model code: {_first_line(exc)}"
                self._step(widths[0])
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)

    def _capture(self, widths: list[int]) -> None:
        """One graph per attended width, captured after the warm-up (`_warm_up`)."""
        if not self.cuda_graphs or self.graph_failure or not widths:
            return
        if self.sampled and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
            self.graph_failure = "this torch cannot register per-row generators with a CUDA graph"
            return
        try:
            pool = torch.cuda.graph_pool_handle()
            for visible in widths:
                graph = torch.cuda.CUDAGraph()
                if self.sampled:  # each replay advances every row's random stream as an eager step does
                    for generator in self.generators:
                        graph.register_generator_state(generator)
                with torch.cuda.graph(graph, pool=pool):
                    self._step(visible)
                self.graphs[visible] = graph
        except Exception as exc:  # any capture failure: eager steps, recorded in describe()
            self.graphs.clear()
            self.graph_failure = _first_line(exc)
            torch.cuda.synchronize(self.device)

    def _run_step(self, visible: int) -> None:
        graph = self.graphs.get(visible)
        if graph is not None:
            graph.replay()
        else:
            self._step(visible)

    # -- rows ------------------------------------------------------------------------------------------
    def _admit(self, row: int, prompt: Tensor, seed: int) -> bool:
        """Prefill `prompt` [1, P] into `row` (its generator reseeded with `seed`); returns whether the row
        decodes on (its first token is neither a stop nor the last allowed)."""
        length = prompt.shape[1]
        positions = torch.arange(length, device=self.device)[None]
        mask = self._masks(torch.arange(length, device=self.device), positions)
        with self.kv.prefilling(slice(row, row + 1), slice(0, length)):
            output, features = self.target._run_with_capture(
                stop_early=False,
                input_ids=prompt.to(self.device),
                position_ids=positions,
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_argument: self.kv},
            )
        logits = output.logits[0, -1]
        if self.sampled:
            generator = self.generators[row].manual_seed(seed)
            first = sample(sampling_probs(logits, self.temperature, self.top_p, self.top_k), generator)
        else:
            first = logits.argmax(-1)
        if self.drafter is not None:
            self._context(features, positions, rows=slice(row, row + 1))
        self.out[row].zero_()
        self.out[row, 0] = first
        self.anchor[row] = first
        self.start[row] = length
        self.count[row] = 1
        goes_on = int(first) not in self.stops and self.max_new > 1
        self.active[row] = goes_on
        return goes_on

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.inference_mode()
    def generate(
        self, prompts: list[Tensor], seeds: list[int] | None = None, min_width: int = 0
    ) -> list[Generation]:
        """Every prompt [1, P] decoded; `rows` of them in flight at once, each finished row refilled with
        the next prompt. Calls that need the same buffer width (at least `min_width`: give the longest
        prompt's, plus max_new_tokens and the block, to decode prompts one call at a time) reuse the
        buffers and the graphs already captured, as a refilled row reuses its row. Sampled, prompt i draws from a generator seeded with `seeds[i]` (default i): its
        tokens equal the eager loop's with `torch.Generator().manual_seed(seeds[i])`. Per row,
        `decode_seconds` is its share of the steps it was in (each step's time split evenly among the rows
        decoding in it), so the rows' seconds add up to the decode time."""
        if not prompts:
            return []
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        self.mask_id = self.drafter.mask_token_id if self.drafter is not None else 0
        self.timing = {"steps": 0, "decode_s": 0.0, "prefill_s": 0.0, "capture_s": 0.0}  # this call's
        longest = max(p.shape[1] for p in prompts)
        with decoding_attention_kernels():
            # a bucket multiple, so every attended width is one
            width = self._bucketed(max(longest + self.max_new + self.block, min_width))
            if getattr(self, "width", None) != width:
                self._allocate(width)  # new buffers: the graphs of the old ones are dropped
            started = self._sync()
            shortest = min(p.shape[1] for p in prompts)
            widths = {self._visible(end + self.block) for end in range(shortest, self.width - self.block + 1)}
            todo = sorted(widths - set(self.graphs))
            if todo and (self.compiled is not None or (self.cuda_graphs and not self.graph_failure)):
                self._warm_up(todo)
            self._capture(todo)
            self.timing["capture_s"] += self._sync() - started
            return self._decode_all(prompts, seeds)

    def _decode_all(self, prompts: list[Tensor], seeds: list[int]) -> list[Generation]:
        results: list[Generation | None] = [None] * len(prompts)
        in_flight: dict[int, _Row] = {}
        waiting = list(range(len(prompts)))
        starts = [0] * self.rows  # the host's copy of each row's anchor position (for the attended width)

        def finish(row: int) -> None:
            state = in_flight.pop(row)
            count = int(self.count[row])
            results[state.prompt] = Generation(
                prompt_len=state.prompt_len,
                tokens=self.out[row, :count].tolist(),
                accepted=state.accepted,
                decode_seconds=state.decode_seconds,
                prefill_seconds=state.prefill_seconds,
            )

        def fill() -> None:
            for row in range(self.rows):
                while row not in in_flight and waiting:
                    index = waiting.pop(0)
                    began = self._sync()
                    goes_on = self._admit(row, prompts[index], seeds[index])
                    in_flight[row] = _Row(index, prompts[index].shape[1])
                    in_flight[row].prefill_seconds = self._sync() - began
                    self.timing["prefill_s"] += in_flight[row].prefill_seconds
                    starts[row] = prompts[index].shape[1]
                    if not goes_on:
                        finish(row)

        fill()
        while in_flight:
            # steps before the host looks again: no more than any row's token budget surely lasts (a row
            # commits at most a block a step), so that only a stop token leaves a row idle till the look
            budgets = [self.max_new - (starts[r] - in_flight[r].prompt_len + 1) for r in in_flight]
            steps = max(1, min(self.sync_every, -(-min(budgets) // self.block)))
            furthest = max(starts[row] for row in in_flight)
            self.step_index.zero_()
            began = time.perf_counter()
            for step in range(steps):  # each step's width: for rows that commit a whole block every step
                self._run_step(self._visible(furthest + (step + 1) * self.block))
            report = self.report.tolist()  # the one host sync of `steps` steps: the stop check
            seconds = time.perf_counter() - began
            self.timing["steps"] += steps
            self.timing["decode_s"] += seconds
            for produced in report[:steps]:  # each step's time shared by the rows decoding in it
                decoding = [row for row in in_flight if produced[row] > 0] or list(in_flight)
                for row in decoding:
                    state = in_flight[row]
                    if produced[row] > 0:
                        state.accepted.append(produced[row])
                    state.decode_seconds += seconds / steps / len(decoding)
                    starts[row] += produced[row]
            for row in [row for row in in_flight if not report[-1][row]]:
                finish(row)
            fill()
        return [r for r in results if r is not None]

    def describe(self) -> dict:
        """The engine's record for the eval report: rows, CUDA graphs, where the time went."""
        record = {
            "engine": "fast",
            "rows": self.rows,
            "block_size": self.block,
            "temperature": self.temperature,
            "cuda_graphs": bool(self.cuda_graphs and not self.graph_failure),
            "graphs_captured": len(self.graphs),
            "compiled": self.compiled is not None,
            "fused_layers": self.compiled is not None and self.compiled.layers_fused(),
            "fused_stack": self.compiled is not None and self.compiled.stack is not None,
            "stack_difference": self.stack_difference,
            "step_kernels": self.compiled.step_kernels() if self.compiled is not None else None,
            "kv_bucket": self.bucket,
            "sync_every": self.sync_every,
            "linear_attention_layers": len(self.mixers),
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in self.timing.items()},
            # a decode step's wall time, the host's looks included (plain against speculative: one token
            # against a verify of a block and the drafter's forward)
            "decode_ms_per_step": round(1e3 * self.timing["decode_s"] / max(1, self.timing["steps"]), 4),
        }
        if self.cuda_graphs and self.graph_failure:
            record["cuda_graphs_failed"] = f"fell back to eager steps: {self.graph_failure}"
        notes = [self.compile_note, self.compiled.layer_note() if self.compiled is not None else None]
        if any(notes):
            record["compile_note"] = "; ".join(filter(None, notes))
        return record


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
