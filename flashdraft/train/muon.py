"""`train.optimizer=muon`: Muon for the drafter's hidden-layer matrices, AdamW for the rest (docs/training-loop.md).

Muon (Keller Jordan; "Muon is Scalable for LLM Training", Moonshot) keeps a momentum of each weight matrix's
gradient, orthogonalises it with a few Newton–Schulz iterations (in bf16, as torch.optim.Muon does) and
steps along the result: every direction of the matrix moves by about as much, whatever its gradient's
singular values. It is meant for the 2-D matrices of hidden layers; embedding-like, 1-D (norms) and
output-side parameters keep AdamW. Which parameters go where: `muon_matrices`.

Two precisions, as with AdamW alone (train/optim.py):
- fp32 parameters: torch.optim.Muon itself (`ClippedMuon`) beside torch's AdamW.
- bf16 parameters with fp32 master weights: `MasterWeightMuon` keeps each matrix's fp32 master and
  momentum in flat buffers (`FlatGroup`), so its gradients are gathered, summed in fp32 and all-reduced
  as the AdamW part's are, and steps matrix by matrix with the same arithmetic as torch.optim.Muon.

`MuonWithAdamW` joins the two parts behind the one interface the trainer calls; both clip by the norm of
all the drafter's gradients together, before the update, as AdamW alone does. `drafter_optimizer` builds
whichever `train.optimizer` names (the trainer's and `bench train`'s one builder).

The learning rate: `adjust_lr_fn="match_rms_adamw"` scales each matrix's step to the RMS of a typical
AdamW step (0.2 sqrt(max(rows, cols)) times the lr), so the AdamW lr (and weight decay) carry over to the
Muon part and one schedule serves both; Keller's "original" adjustment would need its own, much larger lr.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from flashdraft.config import OPTIMIZERS, TrainConfig, muon_peak_lr
from flashdraft.train.optim import (
    ClippedAdamW,
    ClippedTorchOptimizer,
    MasterWeightAdamW,
    MasterWeightOptimizer,
    make_optimizer,
)

# torch.optim.Muon's defaults (Keller Jordan's coefficients, 5 iterations)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR = "match_rms_adamw"
MUON_MOMENTS = ("momentum_buffer",)

# Some torch releases offer Newton–Schulz by plain products (their default) or by addmm; torch 2.13 has
# only addmm. Asked for where offered, so the fp32 path computes what MasterWeightMuon does on any release.
_ADDMM = {"use_addmm": True} if "use_addmm" in inspect.signature(torch.optim.Muon.__init__).parameters else {}


def muon_matrices(drafter: nn.Module) -> list[Tensor]:
    """The parameters Muon updates: the trainable 2-D weights of the drafter's own layers (attention and MLP
    projections; DFlash2's kernel projections) and of the feature fusion `fc`. The rest keeps AdamW: norms,
    DFlash2's convolution base kernels (3-D), and its candidate selector (codebooks are embeddings, and its
    hidden projection feeds the output scores directly, as a head does)."""
    return [
        p
        for name, p in drafter.named_parameters()
        if p.requires_grad and p.ndim == 2 and (name.startswith("layers.") or name == "fc.weight")
    ]


def newton_schulz(matrix: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """The quintic Newton–Schulz orthogonalisation of a 2-D matrix (U S' V^T with S' near 1), in bf16: the
    arithmetic of torch.optim.Muon's, operation by operation."""
    a, b, c = coefficients
    ortho = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's shape-based learning rate of one matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def muon_direction(
    grad: Tensor, momentum_buffer: Tensor, grad_multiplier: Tensor | None, setting: dict
) -> Tensor:
    """Advance a matrix's momentum by its gradient (bf16, or fp32 sums) times the clip factor, and return the
    direction Muon orthogonalises: the Nesterov look-ahead, or the momentum itself."""
    g = grad.float()
    if grad_multiplier is not None:
        g = g * grad_multiplier
    momentum = setting["momentum"]
    momentum_buffer.lerp_(g, 1 - momentum)
    return g.lerp(momentum_buffer, momentum) if setting["nesterov"] else momentum_buffer


def orthogonalise(direction: Tensor, setting: dict) -> Tensor:
    return newton_schulz(direction, setting["ns_coefficients"], setting["ns_steps"], setting["eps"])


def apply_muon_step(master: Tensor, ortho: Tensor, setting: dict) -> None:
    """Decay the fp32 `master` and step it along the orthogonalised direction at the matrix's adjusted lr."""
    lr = setting["lr"]
    master.mul_(1 - lr * setting["weight_decay"])
    master.add_(ortho, alpha=-adjusted_lr(lr, setting["adjust_lr_fn"], master.shape))


def muon_update(
    grad: Tensor,
    master: Tensor,
    momentum_buffer: Tensor,
    grad_multiplier: Tensor | None,
    setting: dict,
) -> None:
    """One Muon update of a matrix's fp32 `master` and momentum from its gradient (bf16, or fp32 sums) times
    the clip factor; `setting` is the parameter group (lr, weight decay, momentum, Newton–Schulz)."""
    direction = muon_direction(grad, momentum_buffer, grad_multiplier, setting)
    apply_muon_step(master, orthogonalise(direction, setting), setting)


def newton_schulz_owners(shapes: list[torch.Size], ranks: int) -> list[int]:
    """Which rank orthogonalises each matrix: the costliest first (Newton–Schulz on an m x n matrix costs about
    m n min(m, n)), each to the least-loaded rank so far, ties to the lower rank and index, so every rank
    computes the same assignment without talking."""
    cost = [s[0] * s[1] * min(s[0], s[1]) for s in shapes]
    load = [0] * ranks
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += cost[i]
    return owners


class ClippedMuon(ClippedTorchOptimizer, torch.optim.Muon):
    """torch.optim.Muon over fp32 matrices, with the trainer's calls (the clip scales the gradients)."""


class MasterWeightMuon(MasterWeightOptimizer):
    """Muon over low-precision 2-D parameters with fp32 master weights and momenta in flat buffers. The update
    runs matrix by matrix (Newton–Schulz needs each whole), eagerly: its cost is the products, not the
    elementwise work a compiled kernel would fuse.

    `split_ranks` (data parallel without sharding: every rank steps from the same summed gradients): the ranks
    of `group` share the Newton–Schulz products, each orthogonalising its share of the matrices
    (`newton_schulz_owners`) and broadcasting the bf16 result to the others; every rank then applies every
    matrix's step. The momenta (elementwise, cheap) advance on every rank. So the ranks end with the same bits
    a single process computes, for 1/N of the products and one bf16 copy of the matrices on the wire."""

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = NS_STEPS,
        eps: float = NS_EPS,
        adjust_lr_fn: str | None = ADJUST_LR,
        split_ranks: bool = False,
        group: dist.ProcessGroup | None = None,
    ):
        params = list(params)
        self.split_ranks = split_ranks and dist.is_initialized() and dist.get_world_size(group) > 1
        self.group = group
        for p in params:
            if p.ndim != 2:
                raise ValueError(f"Muon updates 2-D matrices, got a parameter of shape {tuple(p.shape)}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "ns_steps": ns_steps,
            "eps": eps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults, MUON_MOMENTS)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group, flat_grad, setting in self._groups_to_step():
            matrices = zip(
                group.slots(flat_grad),
                group.slots(group.master),
                group.slots(group.moments["momentum_buffer"]),
                strict=True,
            )
            if self.split_ranks:
                self._split_step(list(matrices), setting)
            else:
                for grad, master, momentum_buffer in matrices:
                    muon_update(grad, master, momentum_buffer, self._grad_multiplier, setting)
            group.weights.copy_(group.master)  # the model's weights: the rounded masters
        self._step_done()

    def _split_step(self, matrices: list[tuple[Tensor, Tensor, Tensor]], setting: dict) -> None:
        """The step with the Newton–Schulz products shared by the ranks (class docstring). The broadcasts are
        issued in matrix order on every rank, asynchronously, so a rank's own products overlap the others'
        transfers."""
        rank, ranks = dist.get_rank(self.group), dist.get_world_size(self.group)
        owners = newton_schulz_owners([master.shape for _, master, _ in matrices], ranks)
        orthos, works = [], []
        for (grad, master, momentum_buffer), owner in zip(matrices, owners, strict=True):
            direction = muon_direction(grad, momentum_buffer, self._grad_multiplier, setting)
            if owner == rank:  # contiguous: a tall matrix's result is a transposed view, and a broadcast
                ortho = orthogonalise(direction, setting).contiguous()  # sends the storage as it lies
            else:
                ortho = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
            source = owner if self.group is None else dist.get_global_rank(self.group, owner)
            works.append(dist.broadcast(ortho, src=source, group=self.group, async_op=True))
            orthos.append(ortho)
        for work in works:
            work.wait()
        for (_, master, _), ortho in zip(matrices, orthos, strict=True):
            apply_muon_step(master, ortho, setting)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for some parameters and AdamW for the others, as one optimizer: its `param_groups` are the
    parts' own (AdamW's first), so the lr schedule scales both; the trainer's calls go to both parts, and
    both clip by the norm of all gradients together."""

    def __init__(self, adamw: torch.optim.Optimizer, muon: torch.optim.Optimizer):
        self.parts = {"adamw": adamw, "muon": muon}
        params = [p for part in self.parts.values() for group in part.param_groups for p in group["params"]]
        super().__init__(params, {})  # torch's bookkeeping (hooks, the scheduler's checks)
        self.param_groups = [group for part in self.parts.values() for group in part.param_groups]
        self._clip: tuple[float, Tensor] | None = None

    @property
    def split_ranks(self) -> bool:
        """Whether the ranks share the Newton–Schulz products (MasterWeightMuon; torch's fp32 Muon does not)."""
        return getattr(self.parts["muon"], "split_ranks", False)

    def accumulate_gradients(self) -> None:
        for part in self.parts.values():
            part.accumulate_gradients()

    def gradients(self, fp32: bool = False) -> list[Tensor]:
        return [g for part in self.parts.values() for g in part.gradients(fp32=fp32)]

    def grad_norm(self) -> Tensor:
        """The global L2 norm of all gradients: the norm of the parts' norms (a device scalar: no sync)."""
        return torch.linalg.vector_norm(torch.stack([part.grad_norm() for part in self.parts.values()]))

    def clip_and_step(self, max_norm: float, norm: Tensor | None = None) -> Tensor:
        """Clip every gradient by the global norm (one factor for both parts), step both, return the norm."""
        norm = self.grad_norm() if norm is None else norm
        self._clip = (max_norm, norm)
        try:
            self.step()  # through self.step: the lr scheduler counts the optimizer's steps there
        finally:
            self._clip = None
        return norm

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for part in self.parts.values():
            if self._clip is None:
                part.step()
            else:
                part.clip_and_step(*self._clip)

    def discard_gradients(self) -> None:
        for part in self.parts.values():
            part.discard_gradients()

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.parts):
            raise ValueError(
                f"optimizer state holds {sorted(state_dict)}, not Muon's and AdamW's parts (another "
                "train.optimizer?)"
            )
        for name, part in self.parts.items():
            part.load_state_dict(state_dict[name])
        # torch's own load_state_dict replaces a part's group dicts: share the new ones again
        self.param_groups = [group for part in self.parts.values() for group in part.param_groups]


def make_muon_optimizer(
    params: list[Tensor],
    matrices: list[Tensor],
    *,
    lr: float,
    muon_lr: float,
    momentum: float,
    weight_decay: float,
    compile: bool = False,
    split_ranks: bool = False,
    group: dist.ProcessGroup | None = None,
) -> MuonWithAdamW:
    """Muon (lr `muon_lr`) for `matrices`, AdamW (lr `lr`) for the rest of `params`; in the precision of the
    parameters, as `make_optimizer` chooses (fp32: torch's optimizers; lower: fp32 master weights, with the
    Newton–Schulz products shared by the ranks of `group` when `split_ranks`: MasterWeightMuon)."""
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError("Muon orthogonalises whole matrices; FSDP shards them (use ddp)")
    chosen = {id(p) for p in matrices}
    others = [p for p in params if id(p) not in chosen]
    if not matrices or not others or len(others) + len(matrices) != len(params):
        raise ValueError(
            f"Muon with AdamW needs both parts among the parameters: {len(matrices)} matrices, "
            f"{len(others)} others of {len(params)}"
        )
    muon_settings = {
        "lr": muon_lr,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "adjust_lr_fn": ADJUST_LR,
    }
    if all(p.dtype == torch.float32 for p in params):
        fused = params[0].device.type == "cuda"
        adamw = ClippedAdamW(others, lr=lr, weight_decay=weight_decay, fused=fused)
        muon = ClippedMuon(matrices, **muon_settings, **_ADDMM)
    else:
        adamw = MasterWeightAdamW(others, lr=lr, weight_decay=weight_decay, compile=compile)
        muon = MasterWeightMuon(matrices, **muon_settings, split_ranks=split_ranks, group=group)
    return MuonWithAdamW(adamw, muon)


# train.optimizer=auto picks Muon up to this drafter width: its Newton-Schulz products grow with the cube of the
# width. At 576 (SmolLM2) Muon trained 7% fewer steps than AdamW in the same minutes and won by 30% real τ; at
# 4,096 (an 8B target) its update costs 193 ms, half the step (docs/training-loop.md). 1,024 takes in targets
# up to ~0.6B (Gemma 3 270M is 640 wide, Qwen3-0.6B 1,024).
AUTO_MUON_MAX_WIDTH = 1024


def resolve_optimizer(
    t: TrainConfig, width: int, data_parallel: str, resumed: dict[str, Any] | None = None
) -> TrainConfig:
    """train.optimizer and train.muon_lr as trained (config.yaml records them): 'auto' is the optimizer of the
    resumed run (`resumed`: its recorded train config) or else Muon for a drafter up to AUTO_MUON_MAX_WIDTH
    wide (AdamW above, and with FSDP, which shards Muon's matrices); Muon's lr left open is the resumed run's,
    or else MUON_LR_SCALE x train.lr."""
    optimizer = t.optimizer
    if optimizer == "auto" and resumed is not None:
        optimizer = resumed.get("optimizer", "adamw")  # a run recorded before the key existed trained AdamW
    if optimizer == "auto":
        optimizer = "muon" if width <= AUTO_MUON_MAX_WIDTH and data_parallel != "fsdp" else "adamw"
    muon_lr = t.muon_lr
    if optimizer == "muon" and muon_lr is None:
        same = resumed is not None and resumed.get("optimizer") == "muon"
        muon_lr = recorded_muon_lr(resumed) if same else muon_peak_lr(t)
    return dataclasses.replace(t, optimizer=optimizer, muon_lr=muon_lr)


def recorded_muon_lr(train: dict[str, Any]) -> float:
    """The Muon lr a recorded Muon run trained at: a run recorded before the default became MUON_LR_SCALE x
    train.lr left train.muon_lr None, which then meant train.lr."""
    return train["muon_lr"] if train.get("muon_lr") is not None else train["lr"]


def drafter_optimizer(
    drafter: torch.nn.Module,
    t: TrainConfig,
    compile: bool,
    split_ranks: bool = False,
    group: dist.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """train.optimizer over the drafter's parameters: AdamW, or Muon for its hidden-layer matrices with
    AdamW for the rest (above). Built after placement: the master weights view the placed weights.
    `split_ranks`: the ranks of `group` hold the same summed gradients at the step (data parallel, not
    sharded), so Muon's products are shared among them."""
    if t.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"drafter_optimizer: train.optimizer {t.optimizer!r} is not resolved (resolve_optimizer)"
        )
    params = list(drafter.parameters())
    if t.optimizer == "muon":
        return make_muon_optimizer(
            params,
            muon_matrices(drafter),
            lr=t.lr,
            muon_lr=muon_peak_lr(t),
            momentum=t.muon_momentum,
            weight_decay=t.weight_decay,
            compile=compile,
            split_ranks=split_ranks,
            group=group,
        )
    return make_optimizer(params, lr=t.lr, weight_decay=t.weight_decay, compile=compile)
