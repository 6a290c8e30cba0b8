"""A target sharded by tensor parallelism over a group of ranks (`distributed.target_parallel`,
docs/distributed.md "Target tensor parallelism").

Consecutive ranks form a group of `target_parallel` ranks that hold ONE target: each rank keeps its share
of every decoder layer's attention heads and MLP columns. The sharding is applied from outside with
torch.distributed.tensor (ColwiseParallel / RowwiseParallel), torchtitan's layering: the Hugging Face
model code knows nothing of it. Each micro-batch the group gathers its members' batches, runs the
sharded target once on all of them, and every rank keeps its own rows of the features, which come back
as ordinary full tensors (the row-parallel projections end in an all-reduce).

What stays whole on every rank: the embedding, the LM head and the final norm (the drafter's objective
reads them as plain weights), the norms, and the small parts of a Gated-DeltaNet layer (why: the
plan's docstring).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from flashdraft.distributed.shard_loading import ShardLoadUnsupported, load_sharded
from flashdraft.errors import FlashdraftError
from flashdraft.model.gguf import is_gguf_target, target_directory
from flashdraft.model.target import TargetModel, _decoder, default_dtype, load_target_config

FIELD = "distributed.target_parallel"


def check_group_size(target_parallel: int, world_size: int) -> None:
    """Groups are consecutive ranks: their size must divide the number of processes."""
    if target_parallel < 1 or world_size % target_parallel:
        raise FlashdraftError(
            f"{FIELD}={target_parallel} does not divide the {world_size} processes "
            "(flashdraft launch --nproc-per-node): every target group needs the same number of ranks"
        )


def check_divisible(config, target_parallel: int, name: str = "target") -> None:
    """Every dimension the plan splits must split evenly: a clear error naming the first that does not."""
    fields = ["num_attention_heads", "num_key_value_heads", "intermediate_size"]
    if "linear_attention" in (getattr(config, "layer_types", None) or []):
        # The gathered projections of a Gated-DeltaNet layer split their outputs (see `layer_plan`).
        fields += ["linear_num_key_heads", "linear_num_value_heads", "hidden_size"]
    for field in fields:
        value = getattr(config, field, None)
        if value is not None and int(value) % target_parallel:
            raise FlashdraftError(
                f"{FIELD}={target_parallel}: {name} has {field}={value}, which does not divide into "
                f"{target_parallel} equal shards; choose a {FIELD} that divides it"
            )


def group_mesh(target_parallel: int, device: torch.device) -> DeviceMesh:
    """This rank's 1-D mesh over its target group (ranks g·n .. g·n+n-1). Every rank of the world must
    call it: the groups of all ranks are created together."""
    world = dist.get_world_size()
    check_group_size(target_parallel, world)
    mesh = init_device_mesh(
        device.type, (world // target_parallel, target_parallel), mesh_dim_names=("groups", "target")
    )
    return mesh["target"]


def layer_plan(layer: nn.Module, index: int) -> dict[str, ParallelStyle]:
    """How decoder layer `index` is split, found by structure (attention and MLP projection names shared
    by the Llama, Qwen3 and Qwen3.5 families).

    - attention: q/k/v by heads (column-parallel: each rank computes its heads, HF's attention reshapes
      with -1 heads so local heads work), o_proj row-parallel (its all-reduce gives the full output);
    - MLP: gate/up column-parallel, down row-parallel;
    - Gated-DeltaNet (linear attention, Qwen3.5/3.6): the large projections in_proj_qkv, in_proj_z and
      out_proj are column-parallel with their output gathered whole, the rest (in_proj_a/b, the causal
      conv, the decay and the gated norm) stays replicated, and the recurrence runs whole on every rank.
      Why not by heads: in_proj_qkv packs all q heads, then all k, then all v, so an even column split
      would not give a rank matching heads, and the conv and norm would need the same cut. Gathering keeps
      it exact for any head layout; the weights of these three projections are most of the layer's, so
      their memory is still split (on the 27B: ~5.5 GB per rank less than replicating them). The cost is
      the recurrence computed on every rank of the group.
    """
    plan: dict[str, ParallelStyle] = {}
    attention = getattr(layer, "self_attn", None)
    if attention is not None and all(hasattr(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        plan.update({f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
        plan["self_attn.o_proj"] = RowwiseParallel()
    linear = getattr(layer, "linear_attn", None)
    if linear is not None and all(hasattr(linear, p) for p in ("in_proj_qkv", "in_proj_z", "out_proj")):
        for p in ("in_proj_qkv", "in_proj_z", "out_proj"):
            plan[f"linear_attn.{p}"] = ColwiseParallel(output_layouts=Replicate())
    if not plan:
        raise FlashdraftError(
            f"{FIELD}: decoder layer {index} ({type(layer).__name__}) has no attention flashdraft knows how to "
            f"split (self_attn.q/k/v/o_proj or linear_attn.in_proj_qkv/in_proj_z/out_proj); set {FIELD}=1"
        )
    mlp = getattr(layer, "mlp", None)
    if mlp is None or not all(
        isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")
    ):
        raise FlashdraftError(
            f"{FIELD}: decoder layer {index} ({type(layer).__name__}) has no dense gate/up/down MLP "
            f"(a mixture of experts?), which flashdraft does not split yet; set {FIELD}=1"
        )
    plan.update({f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")})
    plan["mlp.down_proj"] = RowwiseParallel()
    return plan


def shard_layers(layers: nn.ModuleList, mesh: DeviceMesh) -> None:
    """Split every decoder layer in place over `mesh`; the replaced whole weights are freed."""
    plans = [layer_plan(layer, i) for i, layer in enumerate(layers)]  # all checked before any is cut
    for layer, plan in zip(layers, plans, strict=True):
        # Every rank holds the same weights (or meta tensors): each cuts its own shard, nothing is
        # scattered from one rank. (Set here: parallelize_module overrides a style's own src_data_rank.)
        parallelize_module(layer, mesh, plan, src_data_rank=None)


class GroupTarget(TargetModel):
    """A target sharded over a group of ranks: `features` is a collective of the group (every member calls
    it once per micro-batch, in the same order), and returns this rank's own features."""

    def __init__(
        self, model: nn.Module, layer_ids, mesh: DeviceMesh, name: str = "target", sharded: bool = False
    ):
        """`model` whole (its layers are split here) or, with `sharded`, already split over `mesh`."""
        super().__init__(model, layer_ids, name=name)
        self.mesh = mesh
        self.group = mesh.get_group()
        self.group_size = mesh.size()
        self.group_rank = mesh.get_local_rank()
        check_divisible(self.config, self.group_size, name)
        if not sharded:
            shard_layers(self.layers, mesh)

    def close(self) -> None:
        """Before the group is destroyed: drop the references to its process groups that flashdraft owns,
        this object's and the registry of the mesh it was cut from (every DTensor parameter reaches that
        mesh). torch's functional collectives keep more of their own, so `flashdraft train` also ends
        without the interpreter's teardown (docs/distributed.md, "Shutting down"). The target cannot run
        after this."""
        self.__dict__.pop("group", None)
        for registry in self.mesh_registries():
            registry.clear()

    def mesh_registries(self) -> list[dict]:
        """The registries of process groups kept by the mesh and by the mesh it was cut from (torch's
        DeviceMesh._pg_registry, where this torch has one)."""
        meshes = (self.mesh, getattr(self.mesh, "_root_mesh", None))
        return [r for r in (getattr(m, "_pg_registry", None) for m in meshes) if r is not None]

    def _gather(self, tensor: Tensor, rows: int, length: int, fill: int) -> Tensor:
        """Every member's [b, s] tensor, padded to [rows, length] with `fill` and stacked in rank order."""
        padded = tensor.new_full((rows, length), fill)
        padded[: tensor.shape[0], : tensor.shape[1]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.group_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat(parts)

    @torch.no_grad()
    def features(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """This rank's features [b, s, n_feat*H], computed by one forward of the group's gathered batch.
        Members' batches may differ in rows and length: each is padded at the end (right padding leaves a
        causal model's earlier positions unchanged) and its own rows and positions are cut back out."""
        b, s = input_ids.shape
        shape = torch.tensor(
            [b, s, attention_mask is not None, position_ids is not None], device=input_ids.device
        )
        shapes = [torch.empty_like(shape) for _ in range(self.group_size)]
        dist.all_gather(shapes, shape, group=self.group)
        table = torch.stack(shapes).tolist()
        rows, length = max(r[0] for r in table), max(r[1] for r in table)
        ids = self._gather(input_ids, rows, length, 0)
        mask = positions = None
        if any(r[2] for r in table):  # a member without a mask attends to all its positions
            own = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            mask = self._gather(own, rows, length, 0)
        if any(r[3] for r in table):  # a member without position ids counts from 0 (transformers' default)
            own = (
                torch.arange(s, device=input_ids.device).expand(b, s)
                if position_ids is None
                else position_ids
            )
            # Padding positions restart at 0: a packed row's padding is a sample of its own (docs/packing.md).
            positions = self._gather(own, rows, length, 0)
        everything = super().features(ids, attention_mask=mask, position_ids=positions)
        start = self.group_rank * rows
        return everything[start : start + b, :s].contiguous()


def load_group_target(
    path: str,
    layer_ids,
    device: torch.device,
    target_parallel: int,
    dtype: torch.dtype | None = None,
    whole: bool = False,
) -> GroupTarget:
    """The target with only this rank's shard of its layers on this rank's device. Every rank of the world
    calls it (the group meshes are made together).

    Each rank reads only its shard of the split weights from the checkpoint (`shard_loading`), so the
    whole target never sits on one device. Where that cannot reproduce a normal load (a GGUF target,
    renamed or converted checkpoint names, ...: docs/distributed.md) it says why in one line and falls back
    to loading the whole target onto the device and cutting it there; `whole=True` asks for that path."""
    why_whole = None if not is_gguf_target(path) else "a GGUF target is converted to a whole model first"
    path = target_directory(path)  # a GGUF target: converted once, before anything else
    config = load_target_config(path)
    check_divisible(config, target_parallel, f"target {path}")  # before the (long) load
    mesh = group_mesh(target_parallel, device)
    dtype = dtype or default_dtype(device)
    name = f"target {path}"
    if not whole and why_whole is None:
        try:
            model = load_sharded(
                path, dtype, device, lambda m: shard_layers(_decoder(m, config.num_hidden_layers)[0], mesh)
            )
            return GroupTarget(model, layer_ids, mesh, name=name, sharded=True)
        except ShardLoadUnsupported as why:
            why_whole = str(why)
    if why_whole is not None and mesh.get_local_rank() == 0:  # one line per group
        print(
            f"{name}: loading the whole target on each rank of its group and cutting it there, "
            f"not only each rank's shard: {why_whole}",
            flush=True,
        )
    plain = TargetModel.load(path, layer_ids, device=device, dtype=dtype)
    target = GroupTarget(plain.model, layer_ids, mesh, name=name)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the whole weights replaced by shards
    return target
