"""The drafter's optimizer: AdamW with global-norm gradient clipping, in one of two precisions.

- fp32 parameters (the CPU, or `train.master_weights=false` under bf16 autocast): torch's AdamW. On CUDA
  the fused kernel, with the clip folded into its `grad_scale` (the hook GradScaler uses): the same update
  as `clip_grad_norm_` + step, one pass over all gradients fewer.
- bf16 parameters with fp32 master weights (the GPU default): the model holds bf16 weights, so the
  forward pass casts nothing and the backward pass writes bf16 gradients; this optimizer keeps fp32
  master weights and moments. Each parameter group lives in flat buffers (the model's weights become
  views of them), so one compiled elementwise kernel updates masters and moments and writes the new bf16
  weights for the whole group: 28 bytes per parameter, plus 4 to gather the gradients into the flat
  buffer. Measured on the H200 (docs/benchmarks.md): torch's fused AdamW, which needs fp32 gradients
  and a separate copy out, took 16.6 ms a step for a 1.05B-parameter drafter against 8.5 ms for a
  compiled update; and a compiled update over a list of tensors took 9.6 s to compile for a one-layer
  drafter, growing with the tensor count, where the flat one is the same small graph for any drafter.
  Gradients of several micro-batches, or of several ranks, are summed in fp32, not in bf16.

Both expose the same calls the trainer uses: `accumulate_gradients()` between micro-batches,
`gradients(fp32=...)` (the tensors to all-reduce), `grad_norm()` (checked for finiteness before any
update, docs/training-safety.md), `clip_and_step(max_norm, norm)`, and `discard_gradients()` (after a
step, or instead of a skipped one). `ClippedTorchOptimizer` and `MasterWeightOptimizer` hold those calls
apart from the update, so train/muon.py's Muon has them too (`train.optimizer=muon`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")


def global_norm(grads: list[Tensor]) -> Tensor:
    """The L2 norm of all gradients together, accumulated in fp32 (a device scalar: no sync)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def sharded_norm(grads: list[DTensor]) -> Tensor:
    """The L2 norm of whole gradients held as FSDP2 shards: the shards' squared norms summed over the mesh."""
    squares = global_norm([g.to_local() for g in grads]).square()
    torch.distributed.all_reduce(squares, group=grads[0].device_mesh.get_group())
    return squares.sqrt()


def _params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _ensure_grads(params: list[Tensor]) -> list[Tensor]:
    """Every parameter's gradient; a parameter that got none (e.g. unused this step) gets zeros, so ranks agree."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


class ClippedTorchOptimizer:
    """The trainer's calls over one of torch's optimizers of fp32 parameters (mixed in before it: `class
    X(ClippedTorchOptimizer, torch.optim.Y)`); fp32 `.grad` accumulates over backward passes by itself."""

    param_groups: list[dict]
    defaults: dict

    def accumulate_gradients(self) -> None:
        pass

    def gradients(self, fp32: bool = False) -> list[Tensor]:
        return _ensure_grads(_params(self))

    def grad_norm(self) -> Tensor:
        """The global L2 norm of the gradients (a device scalar: no sync). Over FSDP2 shards (DTensors) the
        norm of the whole: the shards' norms meet in one all-reduce."""
        grads = self.gradients()
        if isinstance(grads[0], DTensor):
            return sharded_norm(grads)
        if not self.defaults.get("fused"):
            return torch.nn.utils.get_total_norm(grads)  # what clip_grad_norm_ computes
        return global_norm(grads)

    def clip_and_step(self, max_norm: float, norm: Tensor | None = None) -> Tensor:
        """Clip gradients to `max_norm` (global L2 norm), step, and return the pre-clip norm (a tensor: no sync).
        `norm` is `grad_norm()` when the caller has it already."""
        params = _params(self)
        norm = self.grad_norm() if norm is None else norm
        if not self.defaults.get("fused"):
            if isinstance(
                params[0], DTensor
            ):  # the same factor clip_grads_with_norm_ applies, shard by shard
                factor = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
                torch._foreach_mul_([p.grad for p in params if p.grad is not None], factor)
            else:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            self.step()
            return norm
        self.grad_scale = torch.clamp(norm / max_norm, min=1.0).float()  # the fused kernel divides by it
        try:
            self.step()
        finally:
            self.grad_scale = None
        return norm

    def discard_gradients(self) -> None:
        self.zero_grad(set_to_none=True)


class ClippedAdamW(ClippedTorchOptimizer, torch.optim.AdamW):
    """torch's AdamW over fp32 parameters, with the trainer's calls."""


def adamw_update(
    grad: Tensor,
    weights: Tensor,
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    hyper: Tensor,
    grad_multiplier: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update of flat fp32 masters and moments that also writes the rounded `weights`.

    `hyper` = [lr, 1 - beta1^t, sqrt(1 - beta2^t)] and `grad_multiplier` (the clip factor) are device
    tensors, so the compiled version neither recompiles nor syncs as they change. The same arithmetic
    as torch.optim.AdamW (decoupled decay, bias-corrected moments). Compiled, it is one elementwise
    kernel over the whole group: 28 bytes per parameter with bf16 gradients.
    """
    lr, bias_correction1, bias_correction2_sqrt = hyper[0], hyper[1], hyper[2]
    g = grad.float() * grad_multiplier
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.sub_(exp_avg / denom * (lr / bias_correction1))
    weights.copy_(master)


# Each parameter's slot in the flat buffers starts on a multiple of this many elements (256 bytes of
# fp32, 128 of bf16), so the model's weights stay as aligned as separately allocated tensors.
SLOT_ALIGN = 64


class FlatGroup:
    """One parameter group laid out in flat buffers: the model's low-precision weights (each parameter
    becomes a view of its slot), fp32 masters and the optimizer's `moments` (by name), and the step's
    gradients, gathered into one buffer. One update call then covers the whole group, whatever its tensor
    count."""

    def __init__(self, params: list[Tensor], moments: tuple[str, ...] = ADAMW_MOMENTS):
        first = params[0]
        for p in params:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(
                    f"a master-weight parameter group holds one dtype on one device, got {p.dtype} on {p.device} "
                    f"beside {first.dtype} on {first.device}"
                )
        self.params = params
        self.numels = [p.numel() for p in params]
        self.offsets, total = [], 0
        for n in self.numels:
            self.offsets.append(total)
            total += -(-n // SLOT_ALIGN) * SLOT_ALIGN
        # allocated now: an out-of-memory shows at start-up, not at the first step. The gaps between
        # slots stay zero in every buffer (zero gradient, zero master), so they never change anything.
        self.weights = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.master = torch.zeros(total, dtype=torch.float32, device=first.device)
        self.moments = {name: torch.zeros_like(self.master) for name in moments}  # fp32, as the masters
        self.grad = torch.zeros_like(self.weights)  # the step's gradients, when they are not summed
        self.grad_sum: Tensor | None = None  # fp32 sums of micro-batches or ranks, allocated on first use
        with torch.no_grad():
            for p, weight, master in zip(
                params, self.slots(self.weights), self.slots(self.master), strict=True
            ):
                weight.copy_(p)
                master.copy_(p)
                p.data = weight  # the model computes with the slot the update writes
        self.pointers = [p.data_ptr() for p in params]

    def slots(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's slot of a flat buffer, shaped as the parameter."""
        return [
            flat[o : o + n].view(p.shape)
            for o, n, p in zip(self.offsets, self.numels, self.params, strict=True)
        ]

    def gather(self, into: Tensor, add: bool = False) -> list[Tensor]:
        """Copy the parameters' `.grad` into their slots of the flat buffer `into`, zeroing the slot of a
        parameter that got none (so ranks agree), or with `add`, add them to what the slots hold."""
        slots = self.slots(into)
        pairs = [(s, p.grad) for s, p in zip(slots, self.params, strict=True) if p.grad is not None]
        if pairs:
            targets, grads = (list(side) for side in zip(*pairs, strict=True))
            (torch._foreach_add_ if add else torch._foreach_copy_)(targets, grads)
        if not add:
            for s, p in zip(slots, self.params, strict=True):
                if p.grad is None:
                    s.zero_()
        return slots

    def check_bound(self) -> None:
        """The update writes the slots; a parameter whose tensor was replaced since (a `load_state_dict` with
        `assign=True`, a `.to()` of the model) would silently stop training: refuse instead."""
        for p, pointer in zip(self.params, self.pointers, strict=True):
            if p.data_ptr() != pointer:
                raise RuntimeError(
                    f"a drafter parameter of shape {tuple(p.shape)} no longer lives in the master-weight optimizer's "
                    "flat weight buffer (its tensor was replaced after the optimizer was built); build the "
                    "optimizer after the last change to the model's parameters"
                )


class MasterWeightOptimizer(torch.optim.Optimizer):
    """What every optimizer of low-precision parameters with fp32 master weights shares: each parameter
    group in flat buffers (`FlatGroup`) with the optimizer's fp32 `moments`, the step's gradients gathered
    (and summed in fp32) there, their norm, the clip, and a state dict that keeps the fp32 state exactly.
    A subclass gives the update: `step()`, reading `_flat_gradients()` and `_grad_multiplier`."""

    def __init__(self, params: Iterable[Tensor], defaults: dict, moments: tuple[str, ...]):
        super().__init__(params, defaults)
        self.state_keys = ("master", *moments)  # each parameter's state, as views of the flat buffers
        self.steps = 0
        self._grad_multiplier: Tensor | None = None  # the clip factor, during clip_and_step
        self.groups = [FlatGroup(group["params"], moments) for group in self.param_groups if group["params"]]
        for group in self.groups:
            flats = [group.master, *group.moments.values()]
            slots = zip(*(group.slots(flat) for flat in flats), strict=True)
            for p, views in zip(group.params, slots, strict=True):
                self.state[p].update(zip(self.state_keys, views, strict=True))
        # The step's gradients once gathered (fp32 sums or a copy of the params' .grad), reused by
        # grad_norm(), the all-reduce and step() until the next micro-batch, step or discard.
        self._gathered: list[Tensor] | None = None
        self._summed = False  # the groups' grad_sum buffers hold this step's gradients

    def accumulate_gradients(self) -> None:
        """Add this backward pass's low-precision gradients to the fp32 sums (call between micro-batches)."""
        self._gathered = None
        for group in self.groups:
            if group.grad_sum is None:
                group.grad_sum = torch.zeros_like(group.master)
            # the step's first backward pass is copied (in fp32), the later ones added
            group.gather(group.grad_sum, add=self._summed)
            for p in group.params:
                p.grad = None
        self._summed = True

    def gradients(self, fp32: bool = False) -> list[Tensor]:
        """The step's gradients as views of the groups' flat buffers: the fp32 sums if anything was
        accumulated (or `fp32`, e.g. before an all-reduce), else a copy of the parameters' own `.grad`
        (zeros where a parameter got none, so ranks agree). Reducing these in place changes the step."""
        if self._gathered is not None and (self._summed or not fp32):
            return self._gathered
        if fp32 or self._summed:
            self.accumulate_gradients()
            self._gathered = [s for group in self.groups for s in group.slots(group.grad_sum)]
            return self._gathered
        self._gathered = [s for group in self.groups for s in group.gather(group.grad)]
        return self._gathered

    def _flat_gradients(self) -> list[Tensor]:
        self.gradients()
        return [group.grad_sum if self._summed else group.grad for group in self.groups]

    def _groups_to_step(self) -> Iterator[tuple[FlatGroup, Tensor, dict]]:
        """Count the step, then each flat group (its bound checked) with its flat gradient and its
        settings (the param group's lr, ...): the loop every subclass's `step` runs its update in."""
        flat_grads = self._flat_gradients()
        self.steps += 1
        settings = (g for g in self.param_groups if g["params"])
        for group, flat_grad, setting in zip(self.groups, flat_grads, settings, strict=True):
            group.check_bound()
            yield group, flat_grad, setting

    def _step_done(self) -> None:
        self._gathered = None
        self._summed = False

    def grad_norm(self) -> Tensor:
        """The global L2 norm of the step's gradients, in fp32 (a device scalar: no sync): one reduction
        per flat buffer."""
        norms = [torch.linalg.vector_norm(flat, dtype=torch.float32) for flat in self._flat_gradients()]
        return torch.linalg.vector_norm(torch.stack(norms))

    def discard_gradients(self) -> None:
        """Drop the step's gradients, fp32 sums included (after a step, or instead of a skipped one)."""
        self._step_done()
        for p in _params(self):
            p.grad = None

    def clip_and_step(self, max_norm: float, norm: Tensor | None = None) -> Tensor:
        norm = self.grad_norm() if norm is None else norm
        self._grad_multiplier = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s factor
        try:
            self.step()
        finally:
            self._grad_multiplier = None
        return norm

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "state": [{k: self.state[p][k] for k in self.state_keys} for p in _params(self)],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore fp32 masters and moments exactly (torch's default would cast them to the bf16 param dtype)
        and set the parameters from the masters."""
        params = _params(self)
        saved = state_dict.get("state")
        if (
            saved is None
            or len(saved) != len(params)
            or len(state_dict["param_groups"]) != len(self.param_groups)
        ):
            raise ValueError(
                "optimizer state does not match the drafter (another model, or fp32 weights: "
                "set train.master_weights as in the run that wrote it)"
            )
        for p, entry in zip(params, saved, strict=True):
            for k in self.state_keys:
                if k not in entry:
                    raise ValueError(
                        f"optimizer state: no {k} (the state of another optimizer: train.optimizer?)"
                    )
                if entry[k].shape != p.shape:
                    raise ValueError(
                        f"optimizer state: {k} of shape {tuple(entry[k].shape)} for a parameter of shape {tuple(p.shape)}"
                    )
                self.state[p][k].copy_(entry[k])
        with torch.no_grad():
            for group in self.groups:
                group.weights.copy_(group.master)
        for group, hyper in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(hyper)
        self.steps = state_dict["steps"]


class MasterWeightAdamW(MasterWeightOptimizer):
    """AdamW over low-precision parameters with fp32 master weights, moments and gradient sums, each
    parameter group in flat buffers (`FlatGroup`). `compile` (CUDA) compiles the update into one kernel
    per group."""

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        compile: bool = False,
    ):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, ADAMW_MOMENTS)
        # one graph of a few flat tensors: compiling it takes seconds whatever the drafter's size
        self.update = torch.compile(adamw_update, fullgraph=True, dynamic=False) if compile else adamw_update

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group, flat_grad, setting in self._groups_to_step():
            beta1, beta2 = setting["betas"]
            device = group.master.device
            values = torch.tensor(
                [setting["lr"], 1 - beta1**self.steps, (1 - beta2**self.steps) ** 0.5], dtype=torch.float32
            )
            if device.type == "cuda":  # pinned + non-blocking: no host-device sync
                values = values.pin_memory()
            multiplier = self._grad_multiplier
            self.update(
                flat_grad,
                group.weights,
                group.master,
                group.moments["exp_avg"],
                group.moments["exp_avg_sq"],
                values.to(device, non_blocking=True),
                multiplier if multiplier is not None else torch.ones((), device=device),
                beta1,
                beta2,
                setting["eps"],
                setting["weight_decay"],
            )
        self._step_done()


def make_optimizer(params: list[Tensor], *, lr: float, weight_decay: float, compile: bool = False):
    """fp32 parameters get torch's AdamW (fused on CUDA); lower-precision ones the master-weight AdamW,
    its update compiled with `compile`."""
    if all(p.dtype == torch.float32 for p in params):
        # FSDP2's shards (DTensors) take the foreach kernels: the fused one's grad_scale is a plain tensor
        fused = params[0].device.type == "cuda" and not isinstance(params[0], DTensor)
        return ClippedAdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)
    return MasterWeightAdamW(params, lr=lr, weight_decay=weight_decay, compile=compile)


def named_optimizer_state(state: dict, names: list[str]) -> dict:
    """torch AdamW's state dict (parameters by position) keyed by parameter name instead: the layout FSDP2's
    full optimizer state dict uses (docs/distributed.md), so a checkpoint moves between the two."""
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def positional_optimizer_state(state: dict, names: list[str]) -> dict:
    """The inverse of `named_optimizer_state`."""
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }
