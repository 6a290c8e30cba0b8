"""The one place that decides the drafter's device placement, precision, compilation and activation
checkpointing; it knows the model and the run's settings, nothing of the trainer.

Model code stays plain single-device PyTorch; this module applies, in order (as torchtitan does):
parameter precision (bf16 weights with fp32 master weights in the optimizer, or fp32 weights under
bf16 autocast), activation checkpointing per drafter layer, then torch.compile per layer (fullgraph),
under compile settings that make every silent degradation an error. `Placement.compiled` tells the
loss to compile its own kernels (the BlockMask needs no compile: model/block_mask.py). Compilation
happens on the calling (main) thread of a process that owns one GPU: torch.compile is not thread-safe,
and a racing or failed compile must never fall back silently to dense attention (docs/processes.md).

With several processes, data parallelism is applied last, from outside (docs/distributed.md): DDP
(bucketed all-reduce overlapped with the backward, summed in fp32) or FSDP2 (`fully_shard` per drafter
layer, then the root; fp32 parameter shards are the master weights, bf16 compute by its
MixedPrecisionPolicy, fp32 reduction). The drafter and the loss know nothing of it; `DataParallel` is
what the trainer calls.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from flashdraft.distributed.float8 import PRECISIONS, check_float8_device, convert_to_float8
from flashdraft.distributed.target_parallel import GroupTarget
from flashdraft.errors import FlashdraftError
from flashdraft.model.attention import BlockMask
from flashdraft.model.drafter import DFlashDraftModel, DrafterLayer
from flashdraft.model.fused_decoder import (
    STEP_TOLERANCE,
    FusedProjections,
    StepKernels,
    checked_difference,
    fused_decoder_step,
    fused_layer_step,
    fusion_refusal,
)
from flashdraft.model.fused_stack import FusedStack, stack_epilogue, stack_prologue, stack_refusal
from flashdraft.model.split_attention import triton
from flashdraft.model.target import CACHE_PARAMETERS, TargetModel

# A batch's context (its padded length) changes from step to step. Compiled with every input static, a
# drafter layer compiles for the first length, then again at the first other one with that length made
# symbolic ("automatic dynamic"): a second compile in step 2 (issue 28). These are the inputs that second
# compile makes dynamic (read from TORCH_LOGS=dynamic), as dynamo names the compiled layer's inputs
# (DrafterLayer.forward's arguments, the BlockMask's fields). Marked dynamic from the start, the first
# compile builds the graph later steps used anyway, and none follows. The block mask's context length
# reaches its mask_mod as a tensor (train/blocks.py): an int there would be one more constant.
CONTEXT_DYNAMIC_SOURCES = (
    "L['ctx']:1",
    "L['ctx_cos']:1",
    "L['ctx_sin']:1",
    "L['mask']:3",  # a dense (sdpa) mask [b, 1, Q, C + Q]
    "L['mask'].seq_lengths[1]",  # a BlockMask's key length, C + Q
    "L['mask'].kv_indices:3",  # its tiles: [b, 1, q tiles, kv tiles] ...
    "L['mask'].full_kv_indices:3",
    "L['mask'].q_num_blocks:2",  # ... and the transposed ones, [b, 1, kv tiles(, q tiles)]
    "L['mask'].q_indices:2",
    "L['mask'].full_q_num_blocks:2",
    "L['mask'].full_q_indices:2",
)


def mark_context_dynamic() -> None:
    """Add CONTEXT_DYNAMIC_SOURCES to torch's `dynamic_sources` (keeping any the user set), once."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "dynamic_sources"):  # an older torch: it recompiles once
        return
    wanted = CONTEXT_DYNAMIC_SOURCES
    if not _per_dim_sources():
        # torch 2.11 reads an entry as a whole source name ("L['ctx']:1" matches nothing, and the layer
        # recompiled at step 2 on the H200): there every dim of these inputs is dynamic from the start.
        # Only the context's dims ever change; the others keep their sizes, so no guard fails on them.
        wanted = tuple(dict.fromkeys(entry.split(":")[0] for entry in wanted))
    present = [s for s in config.dynamic_sources.replace(" ", "").split(",") if s]
    config.dynamic_sources = ",".join([*present, *(s for s in wanted if s not in present)])


def _per_dim_sources() -> bool:
    """Whether this torch's dynamic_sources takes an entry's `:N` suffix as one dim (torch 2.13 does)."""
    try:
        from torch._dynamo.variables.builder import is_dynamic_source
    except ImportError:
        return False
    return "dim" in inspect.signature(is_dynamic_source).parameters


# Dynamo counts compiles per code object, and all drafter layers share DrafterLayer.forward: each layer
# compiles for training and for evaluation (its context length dynamic from the first compile), and may
# again for a rare other batch shape (an epoch's last, short micro-batch). More than this per layer is a
# recompile storm, reported as an error instead of degrading to eager code.
RECOMPILES_PER_LAYER = 8


class _DDP(DistributedDataParallel):
    """DDP that also answers the drafter's own attributes (spec, layer_kinds): the objective calls it as it
    would call the drafter."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def _sum_gradients(group, bucket):  # no annotations: DDP checks them, and these would be strings
    """DDP comm hook: sum (not average: the loss is already divided by the global weight). With more than
    two ranks bf16 buckets are summed in fp32, so N ranks' gradients lose no more than one rounding. With
    two, each element is one addition either way, rounded once to bf16, so the bf16 buffer is summed in
    place: the same bits for half the bytes on the wire (docs/distributed.md)."""
    buffer = bucket.buffer()
    two_ranks = dist.get_world_size(group) == 2
    wide = buffer if buffer.dtype == torch.float32 or two_ranks else buffer.float()
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def write_back(fut: torch.futures.Future) -> torch.Tensor:
        summed = fut.value()[0]
        if summed is buffer:
            return buffer
        return buffer.copy_(summed)

    return future.then(write_back)


@dataclass
class DataParallel:
    """How the drafter's gradients meet across ranks. `module` is what the objective calls: the drafter
    itself (one process, or the manual all-reduce), a DDP wrapper, or the drafter sharded in place by FSDP2.
    `reduces_gradients`: the backward of a synced micro-batch already summed the gradients over ranks."""

    kind: str  # "none", "ddp" or "fsdp"
    module: nn.Module

    @property
    def reduces_gradients(self) -> bool:
        return self.kind != "none"

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp"

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients are reduced only when `enabled` (the
        step's last micro-batch); the others accumulate locally."""
        if self.kind == "ddp" and not enabled:
            with self.module.no_sync():
                yield
        elif self.kind == "fsdp":
            self.module.set_requires_gradient_sync(enabled)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
        else:
            yield

    def close(self) -> None:
        """Before the process group is destroyed: drop every reference the wrapper holds to it (DDP's
        reducer, its logger and its own attribute; FSDP's mesh infos). A C++ reducer that outlives
        `destroy_process_group` holds the last reference to a gloo group, and frees it with the GIL held
        while a gloo worker thread, still freeing a finished collective's tensors, waits for the GIL: the
        process hangs after its last step. A Python owner frees it at interpreter exit, where that worker
        thread cannot get the GIL at all: the rank aborts (docs/distributed.md, "Shutting down"). Dropped
        first, the group's last reference goes with `destroy_process_group`, which frees it without the GIL
        (tests/run/test_group_release.py)."""
        if self.kind == "ddp":  # the logger holds the reducer too; the module, the group itself
            for name in ("reducer", "logger", "process_group"):
                self.module.__dict__.pop(name, None)
        elif self.kind == "fsdp":
            _drop_fsdp_group_references(self.module)


def _drop_fsdp_group_references(module: nn.Module) -> None:
    """FSDP2 keeps the process group it shards over in each sharded module's mesh info (and in its
    parameters'); set to None there, as `close` needs. After this the sharded module cannot run again."""
    from torch.distributed.fsdp import FSDPModule

    for sharded in module.modules():
        if not isinstance(sharded, FSDPModule):
            continue
        param_group = getattr(sharded._get_fsdp_state(), "_fsdp_param_group", None)
        if param_group is None:
            continue
        holders = [param_group, *getattr(param_group, "fsdp_params", ())]
        for holder in holders:
            for name in ("mesh_info", "post_forward_mesh_info"):
                info = getattr(holder, name, None)
                for field, value in list(vars(info).items()) if info is not None else ():
                    if isinstance(value, dist.ProcessGroup):
                        setattr(info, field, None)


def resolve_data_parallel(setting: str, world_size: int) -> str:
    """`distributed.data_parallel` for this world: 'none' for one process, 'auto' means ddp (measured 14%
    faster than fsdp on two H200s; the drafter's replica and optimizer state fit beside the target:
    docs/distributed.md)."""
    if world_size == 1:
        return "none"
    return "ddp" if setting == "auto" else setting


def apply_data_parallel(
    drafter: DFlashDraftModel,
    kind: str,
    device: torch.device,
    *,
    bf16_compute: bool,
    group: dist.ProcessGroup | None = None,
    bucket_mb: float = 25.0,
) -> DataParallel:
    if kind == "none":
        return DataParallel("none", drafter)
    if kind == "ddp":
        # RoPE's inv_freq is a constant: no buffer collective in the forward (the argument's name changed)
        no_buffer_sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
            else {"broadcast_buffers": False}
        )
        ddp = _DDP(
            drafter,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=group,
            gradient_as_bucket_view=True,
            bucket_cap_mb=bucket_mb,
            **no_buffer_sync,
        )
        ddp.register_comm_hook(group, _sum_gradients)
        return DataParallel("ddp", ddp)
    if kind == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16_compute
            else MixedPrecisionPolicy()
        )
        for layer in drafter.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(drafter, mesh=mesh, mp_policy=policy)
        for module in (*drafter.layers, drafter):  # each sharded module reduces its own parameters
            module.set_gradient_divide_factor(1.0)  # a sum: the loss is already divided by the global weight
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.12; NCCL has PREMUL_SUM
                module.set_force_sum_reduction_for_comms(
                    True
                )  # plain SUM collectives (gloo has no PREMUL_SUM)
        return DataParallel("fsdp", drafter)
    raise FlashdraftError(f"distributed.data_parallel must be auto, ddp or fsdp, got {kind!r}")


def full_state_dicts(
    data_parallel: DataParallel,
    drafter: DFlashDraftModel,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The whole drafter's (and optimizer's) state, independent of the world size that trained it.
    Sharded: a collective (every rank calls it) that lands the state on the CPU of the main rank alone (the
    others get empty dicts); the optimizer state is keyed by parameter name."""
    if not data_parallel.sharded:
        return drafter.state_dict(), None if optimizer is None else optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(drafter, options=options)
    if optimizer is None:
        return weights, None
    return weights, get_optimizer_state_dict(drafter, optimizer, options=options)


def load_sharded_optimizer(drafter: DFlashDraftModel, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Scatter a full, name-keyed optimizer state (as `full_state_dicts` returns it) onto this rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(drafter, optimizer, state, options=StateDictOptions(full_state_dict=True))


def unsharded_copy(drafter: DFlashDraftModel, state: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """A plain drafter holding `state` (no allocation beyond it: built on the meta device, then assigned),
    for writing a sharded drafter in the export format."""
    with torch.device("meta"):
        copy = DFlashDraftModel(drafter.config)
    copy.load_state_dict(state, assign=True)
    return copy


@dataclass
class Placement:
    device: torch.device
    attention: str  # "flex" or "sdpa"
    compiled: bool
    autocast_dtype: torch.dtype | None
    param_dtype: torch.dtype  # the drafter's weights; below fp32, the optimizer keeps fp32 master weights
    pad_multiple: int  # sequence lengths are padded to this so compiled shapes repeat
    data_parallel: DataParallel  # what the objective calls, and how gradients meet across ranks
    precision: str = "bf16"  # the drafter's linear GEMMs: "bf16" or "fp8"


def pad_multiple(compiled: bool) -> int:
    """Sequence lengths are padded to this so compiled shapes repeat (the split topology's target side
    pads alike, so both sides collate the same shapes)."""
    return 256 if compiled else 1


def block_input_needs_grad(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a compiled drafter: in training, the embedded blocks (the first layer's input)
    ask for a gradient. Every later layer's input has one, and a compiled layer is specialised on it: without
    this hook the first step compiles the layer twice (6 s of a 5-layer drafter's 20 s first step on the
    H200). The price is layer 0's input gradient, one GEMM of the block rows per step (docs/shards.md,
    "The first step")."""
    if not torch.is_grad_enabled() or not args or args[0].requires_grad:
        return None
    return (args[0].detach().requires_grad_(), *args[1:]), kwargs


# What each compiled code object may compile, by who asked (guard_compile): dynamo has one recompile limit
# for every code object, so it is the largest of these (the drafter's layers and the target's layers are
# separate code objects, each counted against it on its own).
_RECOMPILE_BUDGETS: dict[str, int] = {}


class CheckpointedDrafterLayer(DrafterLayer):
    """A drafter layer whose forward recomputes its activations in the backward
    (train.activation_checkpointing), swapped in as the layer's class, so that the state dict and every
    attribute stay the layer's own. Inside the compiled layer, `checkpoint` becomes dynamo's
    activation-checkpoint region.

    Not a `functools.partial` stored as each layer's `forward`: torch.compile guards on the identity of a
    function stored on a module instance, which compiled one graph per layer, and the compiled call found
    no frame to compile in a partial of `checkpoint` (torch 2.13). Not `forward(*args, **kwargs)` either: the
    compiled frame names its inputs by the forward's parameters, and CONTEXT_DYNAMIC_SOURCES asks for
    `L['ctx']` and `L['mask']`, not `L['args'][1]`; under other names the layer compiled again at step 2
    (stop 64's GPU suite, 12 s)."""

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        ctx_cos: Tensor,
        ctx_sin: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | BlockMask | None,
        past: tuple[Tensor, Tensor] | None = None,
        block_len: int | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        parent = super().forward
        return checkpoint(
            parent, x, ctx, ctx_cos, ctx_sin, cos, sin, mask, past, block_len, use_reentrant=False
        )


def guard_compile(num_layers: int, *, owner: str = "drafter") -> None:
    """Make every silent compile degradation loud (docs/processes.md). `num_layers`: the layers (or layer
    kinds) of `owner` sharing one compiled code object; the recompile limit allows each its
    RECOMPILES_PER_LAYER, and never drops below another owner's need."""
    _RECOMPILE_BUDGETS[owner] = RECOMPILES_PER_LAYER * max(1, num_layers)
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(_RECOMPILE_BUDGETS.values())
    cfg.fail_on_recompile_limit_hit = True
    cfg.suppress_errors = False
    if hasattr(cfg, "error_on_nested_fx_trace"):
        cfg.error_on_nested_fx_trace = True
    warnings.filterwarnings("error", message=".*flex_attention called without torch.compile.*")


def _run_context_projection(module: nn.Module, rows: Tensor) -> Tensor:
    """The drafter's context projection (`fc`) on the target's concatenated features: a code object of its
    own, so its graphs count apart from the norms'."""
    return type(module).forward(module, rows)


def _run_drafter_norm(module: nn.Module, rows: Tensor) -> Tensor:
    """One of the drafter's RMSNorms outside its layers (the context's and the output's): both share its
    graphs."""
    return type(module).forward(module, rows)


def _compiled_in_training(compiled: Callable, module: nn.Module, rows: Tensor) -> Tensor:
    """`compiled(module, rows)` where a gradient is wanted (the training step), its row count (dim 1:
    context length or block rows) dynamic from the first compile, so a batch of another padded length
    compiles nothing. Without one (evaluation, decoding) the module's own forward, as before: decoding
    calls come inside CUDA-graph captures and the fast engine's own compiled steps, where a compile of its
    own has no place."""
    if not torch.is_grad_enabled():
        return type(module).forward(module, rows)
    torch._dynamo.maybe_mark_dynamic(rows, 1)
    return compiled(module, rows)


def compile_drafter(drafter: DFlashDraftModel) -> None:
    """torch.compile each drafter layer (fullgraph), loud on any degradation, its context length dynamic
    from the first compile, and the first layer's input asking for a gradient in training.

    The three modules around the layers are compiled too, for the training step, their `forward` routed
    through a shared compiled function as the target's layers are (so hooks and FSDP stay outside): the
    context projection `fc` and the two norms. Eager, each was a chain of small kernels: an RMSNorm in
    fp32 is six passes, and under train.precision=fp8 the projection's casts of its [H, n_feat*H] weight
    and of its input, and the transposed copies its backward needs, were about ten (at shape (a) on an
    H100, 6.5 ms of the 102 ms FP8 step ran in eager kernels: docs/fp8.md)."""
    guard_compile(len(drafter.layers))
    mark_context_dynamic()
    for layer in drafter.layers:
        layer.compile(fullgraph=True)
    projection = torch.compile(_run_context_projection, fullgraph=True)
    norm = torch.compile(_run_drafter_norm, fullgraph=True)
    drafter.fc.forward = functools.partial(_compiled_in_training, projection, drafter.fc)
    for module in (drafter.hidden_norm, drafter.norm):
        module.forward = functools.partial(_compiled_in_training, norm, module)
    drafter.register_forward_pre_hook(block_input_needs_grad, with_kwargs=True)


def target_compile_refusal(target: TargetModel) -> str | None:
    """Why the target's decoder layers stay eager, or None: hybrid targets' linear-attention layers run
    their own kernels (flash-linear-attention), never traced here; a group-sharded target (tensor
    parallelism) computes through DTensors."""
    layer_types = getattr(target.config, "layer_types", None) or ()
    if "linear_attention" in layer_types:
        return "its linear-attention layers run their own kernels"
    if isinstance(target, GroupTarget):
        return "it is sharded over several GPUs (distributed.target_parallel)"
    return None


def target_layer_kinds(target: TargetModel) -> int:
    """How many graphs the target's compiled layers need: one per layer kind (config.layer_types: full
    attention, sliding attention), since a kind's own attributes (its sliding window, its mask) are baked
    into its graph; the layers of one kind differ only in their weights, which are graph inputs."""
    layer_types = getattr(target.config, "layer_types", None) or ()
    return max(1, len(set(layer_types[: target.num_layers])))


def _run_decoder_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """One decoder layer's own forward, the layer an argument: compiled, this is one code object for every
    layer, and with `inline_inbuilt_nn_modules` the layer's parameters are graph inputs, not constants, so
    every layer of a kind reuses one graph."""
    return type(layer).forward(layer, *args, **kwargs)


def _run_decoding_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`_run_decoder_layer` for decoding steps: a code object of its own, so its graphs are counted apart
    from feature extraction's."""
    return type(layer).forward(layer, *args, **kwargs)


def _run_fused_decoding_layer(layer: nn.Module, fused: FusedProjections, *args: Any) -> Tensor:
    return fused_decoder_step(layer, fused, *args)


@dataclass
class FusedDecoding:
    """The target's decoder layers' fused steps (model/fused_decoder.py), one `FusedProjections` a layer;
    `refusal` says why the layers run their own forward instead: a layer of another shape, or a fused
    step that computed something else than the layer's forward when the two were compared
    (`checked_difference`)."""

    projections: list[FusedProjections]
    refusal: str | None = None
    # why the steps compute with PyTorch's kernels where `step_kernels` chose others (their check failed)
    kernels_note: str | None = None
    # the fused stack's check (generate/fast.py::FastEngine._check_stack), made once for the target
    stack_difference: float | None = None


class CompiledLayerForward:
    """A decoder layer's `forward`: the shared compiled graph of feature extraction (`features`) when the
    call carries no cache; the shared compiled graph of decoding steps (`decoding`) when it carries a cache
    that hands this layer a view of its own (`layer_view`: the fast engine's static cache in a step), as
    the fused step (`fused`, model/fused_decoder.py) where the layer takes one; otherwise the layer's
    eager forward. Decoding through the model's cache reads per-layer attributes such as `layer_idx` to
    find the layer's keys: compiled, that was one graph per layer and per cache state, the recompile storm
    the trainer turned into an error. A view holds that layer's keys alone, so the layer index goes unread
    and every layer of a kind shares one graph."""

    def __init__(self, layer: nn.Module, index: int, features: Any = None, decoding: Any = None):
        self.layer, self.index = layer, index
        self.features, self.decoding = features, decoding
        self.fused: FusedDecoding | None = None
        self.fused_decoding: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        name = next((n for n in CACHE_PARAMETERS if kwargs.get(n) is not None), None)
        if name is None:
            if self.features is not None:
                return self.features(self.layer, *args, **kwargs)
        elif self.decoding is not None:
            layer_view = getattr(kwargs[name], "layer_view", None)
            view = layer_view(self.index) if layer_view is not None else None
            if view is not None:
                _dynamic_widths(view.attended, kwargs.get("attention_mask"))
                kwargs = {**kwargs, name: view}
                fused = self.fused
                if fused is None or fused.refusal is not None:
                    return self.decoding(self.layer, *args, **kwargs)
                hidden_states = args[0] if args else kwargs["hidden_states"]
                step = (hidden_states, kwargs["attention_mask"], kwargs["position_embeddings"], view)
                return self.fused_decoding(self.layer, fused.projections[self.index], *step)
        return type(self.layer).forward(self.layer, *args, **kwargs)


def _dynamic_widths(*tensors: Any) -> None:
    """A decoding step's attended width (the last dim of each tensor given) is dynamic from the first
    compile: one graph for every width, where dynamo alone compiles the first width static and only the
    second dynamic."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 1)


def _layer_forward(target: TargetModel, index: int) -> CompiledLayerForward:
    """Layer `index`'s routing object, installed as its `forward` on first use (see CompiledLayerForward)."""
    layer = target.layers[index]
    if not isinstance(layer.__dict__.get("forward"), CompiledLayerForward):
        layer.forward = CompiledLayerForward(layer, index)
    return layer.forward


def compile_decoder_layers(target: TargetModel) -> None:
    """Route each decoder layer's `forward`, not its call, through one compiled function, so that the
    capture hooks, which stop the forward after the last feature layer, run outside the compiled code. All
    layers of a kind share one graph, dynamic in batch and length from the first compile (a new padded
    length compiles nothing); calls with a cache (decoding) stay eager. The causal mask and RoPE are still
    built by the model's own forward, uncompiled: with no padding, SDPA takes `is_causal`. The recompile
    limit counts the target's graphs beside the drafter's (`guard_compile`)."""
    guard_compile(target_layer_kinds(target), owner="target")
    compiled = torch.compile(_run_decoder_layer, fullgraph=True, dynamic=True)
    for index in range(len(target.layers)):
        _layer_forward(target, index).features = compiled


def compile_target(target: TargetModel, *, _on_cpu: bool = False) -> bool:
    """Compile the frozen target's decoder layers for feature extraction on a GPU (docs/fp8.md, "The
    target's forward"); returns whether it did (on the CPU, or see `target_compile_refusal`, it does not).
    `_on_cpu`: tests only, compile on the CPU too (inductor runs there), through the trainer's own path."""
    if (target.device.type != "cuda" and not _on_cpu) or target_compile_refusal(target) is not None:
        return False
    compile_decoder_layers(target)
    return True


@dataclass
class DecodingCompile:
    """What `compile_for_decoding` compiled: the target's decoder layers for steps through a cache with
    layer views, and the drafter's calls of a decoding step (None: eager). `refusal`: why not, if not."""

    target: TargetModel
    drafter_forward: Any = None
    context_key_values: Any = None
    refusal: str | None = None
    fused: FusedDecoding | None = None
    stack: FusedStack | None = None
    stack_refusal: str | None = None

    def undo(self) -> None:
        """Back to eager code (a compile or capture that failed): the target's layers and the drafter."""
        for index, layer in enumerate(self.target.layers):
            if isinstance(layer.__dict__.get("forward"), CompiledLayerForward):
                routing = _layer_forward(self.target, index)
                routing.decoding = routing.fused_decoding = None
        self.drafter_forward = self.context_key_values = self.stack = None

    def layers_fused(self) -> bool:
        """Whether the decoder layers take the fused step (model/fused_decoder.py)."""
        return self.fused is not None and self.fused.refusal is None

    def layer_note(self) -> str | None:
        """Why the decoder layers run their own forward, not the fused step, or why the step runs through
        the model's forward, not the fused stack; None when both are fused."""
        refusal = self.fused.refusal if self.fused is not None else "not fused"
        if refusal is not None:
            return f"decoder layers on their own forward: {refusal}"
        notes = [self.fused.kernels_note]
        if self.stack is None:
            notes.append(f"step through the model's forward: {self.stack_refusal or 'not stacked'}")
        return "; ".join(filter(None, notes)) or None

    def step_kernels(self) -> dict | None:
        """The fused steps' `StepKernels` as a record, or None where the layers are not fused."""
        return asdict(self.fused.projections[0].kernels) if self.layers_fused() else None

    def refuse_stack(self, reason: str) -> None:
        """The step goes through the model's forward from now on (the layers stay fused), for `reason`."""
        self.stack, self.stack_refusal = None, reason


def _run_drafter(drafter: DFlashDraftModel, *args: Any) -> Any:
    return type(drafter).forward_cached(drafter, *args)


def _drafter_step(
    compiled: Any, drafter: DFlashDraftModel, embedded: Tensor, positions: Tensor, masks: dict, *args: Any
) -> Tensor:
    """The compiled `forward_cached`, its masks' context width dynamic from the first compile."""
    _dynamic_widths(*masks.values())
    return compiled(drafter, embedded, positions, masks, *args)


def _run_context_key_values(drafter: DFlashDraftModel, *args: Any) -> Any:
    return type(drafter).context_key_values(drafter, *args)


def _stack_prologue_step(
    compiled: Any,
    embed: nn.Module,
    rotary: nn.Module,
    ids: Tensor,
    positions: Tensor,
    masks: dict,
    groups: int,
) -> Any:
    """The compiled `stack_prologue`, its masks' width dynamic from the first compile."""
    _dynamic_widths(*masks.values())
    return compiled(embed, rotary, ids, positions, masks, groups)


def _stack_layer_step(
    compiled: Any,
    layer: nn.Module,
    fused: FusedProjections,
    residual: Tensor,
    update: Tensor,
    bias: Tensor,
    rotary: tuple,
    view: Any,
) -> Any:
    """The compiled `fused_layer_step`, its mask's and its keys' width dynamic from the first compile."""
    _dynamic_widths(view.attended, bias)
    return compiled(layer, fused, residual, update, bias, rotary, view)


@functools.cache
def _decoding_functions() -> dict[str, Any]:
    """The compiled decoding functions, made once per process: dynamo keeps its graphs per code object and
    backend, so a second `torch.compile` of the same function would compile everything again."""
    functions = {
        "layer": _run_decoding_layer,
        "fused_layer": _run_fused_decoding_layer,
        "drafter": _run_drafter,
        "context": _run_context_key_values,
        "prologue": stack_prologue,
        "stack_layer": fused_layer_step,
        "epilogue": stack_epilogue,
    }
    return {name: torch.compile(f, fullgraph=True) for name, f in functions.items()}


@functools.cache
def compiled_engine_function(function: Callable, width_args: tuple[int, ...] = ()) -> Any:
    """A decoding engine's own step function (generate/fast.py::StepFunctions: the drafter's inputs, its
    drafts, the acceptance, the rows' settling) compiled whole, once per process for each function; the
    last dim of the positional arguments `width_args` (an attended width) dynamic from the first compile."""
    compiled = torch.compile(function, fullgraph=True)
    if not width_args:
        return compiled

    def call(*args: Any) -> Any:
        _dynamic_widths(*(args[index] for index in width_args))
        return compiled(*args)

    return call


def step_kernels(target: TargetModel) -> StepKernels:
    """The kernels a compiled fused step computes with on the target's device: on a CUDA GPU, split
    attention (with Triton); on the CPU, PyTorch's own (docs/decoding.md, "Split attention")."""
    return StepKernels(split_attention=target.device.type == "cuda" and triton is not None)


def _fused_step_refusal(target: TargetModel, kernels: StepKernels) -> str | None:
    """Why the fused step is not the first layer's own forward (`checked_difference`), or None."""
    try:
        difference = checked_difference(target.layers[0], kernels)
    except Exception as exc:  # a layer the check cannot run is one the fused step is not proven on
        return f"its fused step could not be checked: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    if difference > STEP_TOLERANCE:
        return f"its fused step differed from its own forward by {difference:.3g} (relative, fp32)"
    return None


def _fused_decoding(target: TargetModel) -> FusedDecoding:
    """The target's fused decoder steps, made once (its layers' weights then view the fused ones), or
    refused with the reason: a layer's shape (`fusion_refusal`) or the check's (`_fused_step_refusal`)."""
    made = _layer_forward(target, 0).fused
    if made is not None:
        return made
    refusal = next(filter(None, (fusion_refusal(layer) for layer in target.layers)), None)
    kernels, kernels_note = step_kernels(target), None
    if refusal is None:
        refusal = _fused_step_refusal(target, kernels)
        if refusal is not None and kernels != StepKernels():  # PyTorch's kernels before no fused step
            kernels, kernels_note = StepKernels(), f"PyTorch's kernels: with {kernels}, {refusal}"
            refusal = _fused_step_refusal(target, kernels)
    if refusal is not None:
        fused = FusedDecoding([], refusal=refusal)
    else:
        projections = [FusedProjections(layer, kernels) for layer in target.layers]
        fused = FusedDecoding(projections, kernels_note=kernels_note)
    for index in range(len(target.layers)):
        _layer_forward(target, index).fused = fused
    return fused


def compile_for_decoding(target: TargetModel, drafter: DFlashDraftModel | None) -> DecodingCompile:
    """Compile a decoding step's model code for the fast engine (docs/decoding.md, "Compiled steps"): each
    target decoder layer through one graph per layer kind, fed a view of its own keys by the static cache
    (`CompiledLayerForward`), as the fused step where the layer takes one (`FusedDecoding`), and the
    drafter's block forward and context projection, whole. A step of a small model is bound by its kernel
    count (about 43 eager kernels a decoder layer: RMSNorm, RoPE and SiLU·mul are several each); inductor
    fuses the element-wise ones around each GEMM, the fused step halves the GEMMs' count, and the fused
    stack (model/fused_stack.py) takes the embedding, the masks, the final norm and the LM head into
    its graphs too. The prefill stays eager. Refused, with the reason, where the target's
    layers are not traced here (`target_compile_refusal`)."""
    refusal = target_compile_refusal(target)
    if refusal is not None:
        return DecodingCompile(target, refusal=refusal)
    # a kind's graph compiles once per (rows, block width) a process decodes with (plain and speculative,
    # batch 1 and N), first with static attended widths, then with dynamic ones (a new width then compiles
    # nothing): 8 such, RECOMPILES_PER_LAYER, per kind
    guard_compile(target_layer_kinds(target), owner="decoding")
    functions = _decoding_functions()
    for index in range(len(target.layers)):
        routing = _layer_forward(target, index)
        routing.decoding, routing.fused_decoding = functions["layer"], functions["fused_layer"]
    compiled = DecodingCompile(target, fused=_fused_decoding(target))
    if compiled.fused.refusal is None:
        compiled.stack_refusal = stack_refusal(target)
        if compiled.stack_refusal is None:
            stack = compiled.stack = FusedStack(target, compiled.fused.projections)
            stack.prologue = functools.partial(_stack_prologue_step, functions["prologue"])
            stack.layer_step = functools.partial(_stack_layer_step, functions["stack_layer"])
            stack.epilogue = functions["epilogue"]
    if drafter is not None:
        compiled.drafter_forward = functools.partial(_drafter_step, functions["drafter"], drafter)
        compiled.context_key_values = functools.partial(functions["context"], drafter)
    return compiled


def parallelize(
    drafter: DFlashDraftModel,
    *,
    device: torch.device,
    attention: str = "auto",
    compile: bool = True,
    activation_checkpointing: bool = False,
    dtype: str = "auto",
    master_weights: bool = True,
    precision: str = "bf16",
    fp8_recipe: str = "tensorwise",
    data_parallel: str = "none",
    group: dist.ProcessGroup | None = None,
    bucket_mb: float = 25.0,
) -> Placement:
    """`data_parallel` is resolved already ('none', 'ddp' or 'fsdp': `resolve_data_parallel`).
    `precision` 'fp8': the drafter's linear layers compute in FP8 (distributed/float8.py, docs/fp8.md)."""
    on_gpu = device.type == "cuda"
    if precision not in PRECISIONS:
        raise FlashdraftError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp8":
        check_float8_device(device)
        if dtype == "fp32":
            raise FlashdraftError(
                "train.precision=fp8 needs bf16 compute around its GEMMs: set train.dtype=bf16"
            )
        if data_parallel == "fsdp":
            raise FlashdraftError(
                "train.precision=fp8 with distributed.data_parallel=fsdp is not supported yet: use ddp"
            )
    attention = ("flex" if on_gpu else "sdpa") if attention == "auto" else attention
    compile = compile and on_gpu
    if attention == "flex" and not on_gpu:
        raise FlashdraftError(
            "train.attention=flex needs a CUDA GPU; use train.attention=sdpa (exact) on the CPU"
        )
    if attention == "flex" and not compile:
        raise FlashdraftError(
            "train.attention=flex needs train.compile=true (eager flex_attention materialises dense scores)"
        )
    if dtype == "auto":
        dtype = "bf16" if on_gpu else "fp32"
    autocast_dtype = torch.bfloat16 if dtype == "bf16" else None
    param_dtype = torch.bfloat16 if autocast_dtype is not None and master_weights else torch.float32
    bf16_compute = autocast_dtype is not None
    if data_parallel == "fsdp":
        # FSDP2 maps train.master_weights itself: the fp32 parameter shards are the master weights (a plain
        # AdamW updates them), its MixedPrecisionPolicy gathers them as bf16 for compute and reduces in fp32.
        param_dtype, autocast_dtype = torch.float32, None

    drafter.to(device)
    for param in drafter.parameters():  # parameters only: buffers such as RoPE's inv_freq stay fp32
        param.data = param.data.to(param_dtype)
    drafter.rotary_emb.to(device)
    if precision == "fp8":  # before compiling: the compiled layers trace the FP8 casts and GEMMs
        # Compiled, context lengths are padded to 256 and blocks of 16 rows give whole multiples of 16
        # tokens: the weight-gradient GEMMs need no padding copies (distributed/float8.py::float8_config).
        aligned = compile and drafter.block_size % 16 == 0
        convert_to_float8(drafter, fp8_recipe, pad_inner_dim=not aligned)
    if activation_checkpointing:
        for layer in drafter.layers:
            layer.__class__ = CheckpointedDrafterLayer
    if compile:
        compile_drafter(drafter)
    parallel = apply_data_parallel(
        drafter, data_parallel, device, bf16_compute=bf16_compute, group=group, bucket_mb=bucket_mb
    )
    return Placement(
        device,
        attention,
        compile,
        autocast_dtype,
        param_dtype,
        pad_multiple=pad_multiple(compile),
        data_parallel=parallel,
        precision=precision,
    )
