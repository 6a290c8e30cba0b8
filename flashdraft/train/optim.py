"""The drafter's optimizer: AdamW with global-norm gradient clipping, in one of two precisions.

- fp32 parameters (the CPU, or `train.master_weights=false` under bf16 autocast): torch's AdamW. On CUDA
  the fused kernel, with the clip folded into its `grad_scale` (the hook GradScaler uses): the same update
  as `clip_grad_norm_` + step, one pass over all gradients fewer.
- bf16 parameters with fp32 master weights (the GPU default): the model holds bf16 weights, so the
  forward pass casts nothing and the backward pass writes bf16 gradients; this optimizer keeps fp32
  master weights and moments, updates them with torch's fused AdamW kernel (one multi-tensor launch
  for all of a group's tensors, the clip folded into its `grad_scale`) and copies the new bf16
  weights out in one more. Gradients of several micro-batches, or of several ranks, are summed in
  fp32, not in bf16. No part of it is compiled: a compiled update cost the first step 9.6 s of
  compiling on the H200 for a one-layer drafter, and its dynamo tracing grows with the tensor count
  (docs/shards.md, "The first step").

Both expose the same calls the trainer uses: `accumulate_gradients()` between micro-batches,
`gradients(fp32=...)` (the tensors to all-reduce), `grad_norm()` (checked for finiteness before any
update, docs/training-safety.md), `clip_and_step(max_norm, norm)`, and `discard_gradients()` (after a
step, or instead of a skipped one).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

MASTER_STATE = ("master", "exp_avg", "exp_avg_sq")


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


class ClippedAdamW(torch.optim.AdamW):
    """torch's AdamW over fp32 parameters; fp32 `.grad` accumulates over backward passes by itself."""

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


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over low-precision parameters with fp32 master weights, moments and gradient sums."""

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.steps = 0
        self._grad_multiplier: Tensor | None = None
        # The step's gradients once gathered (fp32 sums or the params' own .grad), reused by grad_norm(),
        # the all-reduce and step() until the next micro-batch, step or discard: gathered once per step.
        self._gathered: list[Tensor] | None = None
        self._gathered_fp32 = False
        for p in _params(self):  # allocated now: an out-of-memory shows at start-up, not at the first step
            self.state[p].update(
                master=p.detach().float().clone(),
                exp_avg=torch.zeros_like(p, dtype=torch.float32),
                exp_avg_sq=torch.zeros_like(p, dtype=torch.float32),
                # the fused kernel reads the step count from a device tensor per parameter, and its
                # wrapper increments them: no host value enters the update, so nothing syncs
                step=torch.zeros((), dtype=torch.float32, device=p.device),
            )

    def accumulate_gradients(self) -> None:
        """Move this backward pass's low-precision gradients into fp32 sums (call between micro-batches)."""
        self._gathered = None
        for p in _params(self):
            if p.grad is None:
                continue
            state = self.state[p]
            if "grad_sum" in state:
                state["grad_sum"].add_(p.grad)
            else:
                state["grad_sum"] = p.grad.float()
            p.grad = None

    def gradients(self, fp32: bool = False) -> list[Tensor]:
        """The step's gradients: fp32 sums if anything was accumulated (or `fp32`, e.g. before an
        all-reduce), else the parameters' own `.grad`. Reducing these in place changes the step."""
        if self._gathered is not None and (self._gathered_fp32 or not fp32):
            return self._gathered
        params = _params(self)
        if fp32 or any("grad_sum" in self.state[p] for p in params):
            self.accumulate_gradients()
            for p in params:  # a parameter without any gradient gets fp32 zeros, so ranks agree
                if "grad_sum" not in self.state[p]:
                    self.state[p]["grad_sum"] = torch.zeros_like(p, dtype=torch.float32)
            self._gathered, self._gathered_fp32 = [self.state[p]["grad_sum"] for p in params], True
        else:
            self._gathered, self._gathered_fp32 = _ensure_grads(params), False
        return self._gathered

    def grad_norm(self) -> Tensor:
        """The global L2 norm of the step's gradients, in fp32 (a device scalar: no sync)."""
        return global_norm(self.gradients())

    def discard_gradients(self) -> None:
        """Drop the step's gradients, fp32 sums included (after a step, or instead of a skipped one)."""
        self._gathered = None
        for p in _params(self):
            p.grad = None
            self.state[p].pop("grad_sum", None)

    def clip_and_step(self, max_norm: float, norm: Tensor | None = None) -> Tensor:
        norm = self.grad_norm() if norm is None else norm
        self._grad_multiplier = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s factor
        try:
            self.step()
        finally:
            self._grad_multiplier = None
        return norm

    @torch.no_grad()
    def step(self, closure=None) -> None:
        grads = self.gradients()
        self.steps += 1
        # clip_grad_norm_'s factor as the fused kernel's grad_scale, which it divides by (a device scalar)
        scale = self._grad_multiplier.reciprocal() if self._grad_multiplier is not None else None
        i = 0
        for group in (g for g in self.param_groups if g["params"]):
            params = group["params"]
            states = [self.state[p] for p in params]
            masters = [state["master"] for state in states]
            beta1, beta2 = group["betas"]
            adamw(
                masters,
                [g if g.dtype == torch.float32 else g.float() for g in grads[i : i + len(params)]],
                [state["exp_avg"] for state in states],
                [state["exp_avg_sq"] for state in states],
                [],
                [state["step"] for state in states],
                fused=True,
                grad_scale=scale,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            torch._foreach_copy_(params, masters)  # the model's weights: the masters, rounded
            for state in states:
                state.pop("grad_sum", None)
            i += len(params)
        self._gathered = None

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "state": [{k: self.state[p][k] for k in MASTER_STATE} for p in _params(self)],
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
            for k in MASTER_STATE:
                if entry[k].shape != p.shape:
                    raise ValueError(
                        f"optimizer state: {k} of shape {tuple(entry[k].shape)} for a parameter of shape {tuple(p.shape)}"
                    )
                self.state[p][k].copy_(entry[k])
            self.state[p]["step"].fill_(state_dict["steps"])
            with torch.no_grad():
                p.copy_(self.state[p]["master"])
        for group, hyper in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(hyper)
        self.steps = state_dict["steps"]


def make_optimizer(params: list[Tensor], *, lr: float, weight_decay: float):
    """fp32 parameters get torch's AdamW (fused on CUDA); lower-precision ones the master-weight AdamW."""
    if all(p.dtype == torch.float32 for p in params):
        # FSDP2's shards (DTensors) take the foreach kernels: the fused one's grad_scale is a plain tensor
        fused = params[0].device.type == "cuda" and not isinstance(params[0], DTensor)
        return ClippedAdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)
    return MasterWeightAdamW(params, lr=lr, weight_decay=weight_decay)


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
