"""DFlash2 drafters in plain single-device PyTorch (docs/drafters.md §3).

DFlash2 keeps the DFlash drafter and adds two parts:
  * a grouped dynamic causal convolution around every attention and MLP sub-layer: each block position
    mixes with its `conv_kernel_size - 1` predecessors inside its own block, channel groups of
    `conv_group_size` sharing one token-dependent coefficient per tap; one kernel for the sub-layer's input
    ("prepare") and one for its output ("finish"), both predicted from the sub-layer's normed input;
  * a candidate selector: the head's top-`selector_top_k` tokens per position are rescored with a low-rank
    bilinear term between the chosen predecessor and each candidate, and the draft is the path walked left
    to right from the anchor (argmax, or sampled from softmax(score / T) at temperature T).
Tensor names and the math follow z-lab's DFlash2DraftModel, so either loads the other's weights.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Qwen3Config

from flashdraft.model.drafter import DFlashDraftModel


def grouped_dynamic_conv(x: Tensor, dynamic: Tensor, base: Tensor, group_size: int, block_len: int) -> Tensor:
    """x [b, Q, H] (Q = whole blocks of `block_len`); dynamic [b, Q, K, H/group_size]; base [K, H].

    out[t] = Σ_o (base[o] + dynamic[t, o]) · x[t - o], where x[t - o] is zero before the block's start:
    positions never mix across blocks (training packs many blocks in one row)."""
    b, q, h = x.shape
    groups = h // group_size
    kernel_size = base.shape[0]
    blocks = x.view(b, q // block_len, block_len, groups, group_size)
    dynamic = dynamic.reshape(b, q // block_len, block_len, kernel_size, groups, 1)
    out = torch.zeros_like(blocks)
    for offset in range(min(kernel_size, block_len)):
        values = blocks if offset == 0 else F.pad(blocks[:, :, :-offset], (0, 0, 0, 0, offset, 0))
        out = out + base[offset].view(groups, group_size).to(x.dtype) * values
        out = torch.addcmul(out, dynamic[:, :, :, offset], values)
    return out.view_as(x)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        # [prepare | finish, tap, channel]; identity at init (tap 0 = 1) with a zero dynamic part, so a
        # fresh DFlash2 layer computes exactly what a DFlash layer does (warm start from DFlash weights).
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    def reset_to_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor, block_len: int) -> tuple[Tensor, Tensor]:
        """The convolved sub-layer input and the kernel its output will get (both from `x`)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        mixed = grouped_dynamic_conv(
            x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block_len
        )
        return mixed, dynamic[..., 1, :, :]

    def finish(self, x: Tensor, dynamic: Tensor, block_len: int) -> Tensor:
        return grouped_dynamic_conv(x, dynamic, self.base_kernel[1], self.group_size, block_len)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, hidden: Tensor, unary: Tensor, candidates: Tensor, predecessors: Tensor) -> Tensor:
        """S(a, b) = unary(b) + <A(a) ⊙ H(h), B(b)> for rows: hidden [n, H], unary/candidates [n, k],
        predecessors [n] -> [n, k]."""
        weight = self.hidden_projection.weight
        projected = F.linear(hidden.to(weight.dtype), weight)
        left = self.predecessor_codebook(predecessors) * projected
        return unary + torch.einsum("nr,nkr->nk", left, self.successor_codebook(candidates))

    @torch.no_grad()
    def select(
        self, hidden: Tensor, logits: Tensor, anchor_ids: Tensor, temperature: float, generator=None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Walk the block left to right. hidden [b, n, H], logits [b, n, V], anchor_ids [b].
        Returns the path [b, n], the candidates [b, n, k] and, when sampling, each step's distribution
        over the candidates [b, n, k] (the draft's q for rejection sampling)."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        predecessor = anchor_ids
        path, rows = [], []
        for position in range(hidden.shape[1]):
            scores = self.scores(
                hidden[:, position], unary[:, position], candidates[:, position], predecessor
            )
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[:, 0]
                rows.append(q)
            else:
                index = scores.argmax(dim=-1)
            predecessor = candidates[:, position].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1), candidates, torch.stack(rows, dim=1) if rows else None

    def training_loss(
        self,
        hidden: Tensor,
        unary: Tensor,
        candidates: Tensor,
        predecessors: Tensor,
        labels: Tensor,
        row_weights: Tensor,
    ) -> Tensor:
        """Σ w · CE of the label among the candidates, with the true predecessor (teacher forcing). A row whose
        label is not a candidate teaches nothing (a recall miss is the head's to fix, not the selector's).
        The unary term is a constant here: the head is trained by the main loss (docs/drafters.md §3)."""
        scores = self.scores(hidden, unary.detach(), candidates, predecessors).float()
        matches = candidates == labels[:, None]
        covered = matches.any(dim=-1)
        ce = torch.logsumexp(scores, dim=-1) - (scores * matches).sum(-1)
        return (ce * covered * row_weights.detach().float()).sum()


class DFlash2DraftModel(DFlashDraftModel):
    """DFlashDraftModel + convolutions in every layer + `candidate_selector` (z-lab's tensor names)."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        fields = self.spec.dflash2
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(
                config.hidden_size, fields["conv_kernel_size"], fields["conv_group_size"]
            )
            layer.mlp_conv = GroupedDynamicCausalConv(
                config.hidden_size, fields["conv_kernel_size"], fields["conv_group_size"]
            )
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, fields["selector_rank"], fields["selector_top_k"]
        )

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        super().init_weights(generator)
        std = float(getattr(self.config, "initializer_range", 0.02))
        with torch.no_grad():
            for module in (
                self.candidate_selector.predecessor_codebook,
                self.candidate_selector.successor_codebook,
            ):
                module.weight.normal_(0.0, std, generator=generator)
        for layer in self.layers:
            layer.attention_conv.reset_to_identity()
            layer.mlp_conv.reset_to_identity()

    def propose(
        self, hidden: Tensor, anchor_ids: Tensor, lm_head_weight: Tensor, temperature: float, generator=None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Draft tokens for block positions 1.. from their hidden states [b, n, H] (see CandidateSelector.select)."""
        logits = self.compute_logits(hidden, lm_head_weight)
        return self.candidate_selector.select(hidden, logits, anchor_ids, temperature, generator)


def graft_dflash2(
    drafter: DFlashDraftModel, fields: dict[str, int] | None = None, generator: torch.Generator | None = None
) -> DFlash2DraftModel:
    """A DFlash2 drafter that starts as `drafter` (a DFlash one): the same weights, every convolution the
    identity (tap 0 = 1, zero dynamic part) and the selector's bilinear term zero (`hidden_projection`
    zero; the codebooks random, so its gradient is not zero), so step 0's logits and greedy drafts are the
    old drafter's exactly (docs/drafters.md §3, "Warm start"). `fields` overrides DFLASH2_DEFAULTS."""
    from flashdraft.model.spec import ARCHITECTURES, DFLASH2_DEFAULTS

    if drafter.spec.arch != "dflash":
        raise ValueError(f"graft_dflash2 takes a DFlash drafter, got arch {drafter.spec.arch!r}")
    config = copy.deepcopy(drafter.config)
    config.architectures = [ARCHITECTURES["dflash2"]]
    config.auto_map = {"AutoModel": f"dflash.{ARCHITECTURES['dflash2']}"}
    added = DFLASH2_DEFAULTS | (fields or {})
    added["selector_top_k"] = min(added["selector_top_k"], int(config.vocab_size))  # a tiny test vocabulary
    config.dflash_config = dict(config.dflash_config or {}) | added
    reference = next(drafter.parameters())
    with torch.device("meta"):
        grafted = DFlash2DraftModel(config)
    grafted = grafted.to_empty(device=reference.device).to(reference.dtype)
    grafted.init_weights(generator)  # codebooks random, convolutions the identity
    with torch.no_grad():
        grafted.candidate_selector.hidden_projection.weight.zero_()
    missing, unexpected = grafted.load_state_dict(drafter.state_dict(), strict=False)
    new_parts = ("attention_conv.", "mlp_conv.", "candidate_selector.")
    if unexpected or any(not any(part in name for part in new_parts) for name in missing):
        raise ValueError(f"graft_dflash2: unexpected {unexpected}, missing {missing}")
    grafted.rotary_emb = type(drafter.rotary_emb)(config).to(reference.device)  # fp32 inv_freq, as loaded
    return grafted
