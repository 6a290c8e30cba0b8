"""train.optimizer=muon: Muon for the drafter's hidden-layer matrices with AdamW for the rest, against
torch.optim.Muon + torch.optim.AdamW + clip_grad_norm_ on fp32 copies, in both precisions."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import Qwen3Config

from flashdraft.config import Config, DistributedConfig, TrainConfig, to_dict, validate
from flashdraft.errors import FlashdraftError
from flashdraft.model.dflash2 import DFlash2DraftModel
from flashdraft.model.drafter import DFlashDraftModel
from flashdraft.model.drafter_dir import make_drafter_config
from flashdraft.train.muon import (
    _ADDMM,
    ClippedMuon,
    MasterWeightMuon,
    MuonWithAdamW,
    make_muon_optimizer,
    muon_matrices,
    newton_schulz_owners,
    resolve_optimizer,
)
from flashdraft.train.optim import ClippedAdamW, MasterWeightAdamW
from flashdraft.train.resume import check_resume_config

# two tall, one wide, one square matrix (Newton-Schulz transposes tall ones), and AdamW's 1-D and 3-D ones
MATRICES = [(48, 16), (24, 40), (32, 32), (40, 8)]
OTHERS = [(16,), (2, 3, 8)]
LR, MUON_LR, WEIGHT_DECAY = 1e-2, 2e-2, 0.1


def _values(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in (*MATRICES, *OTHERS)]


def _reference(params: list[torch.nn.Parameter]) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    split = len(MATRICES)
    muon = torch.optim.Muon(
        params[:split],
        lr=MUON_LR,
        weight_decay=WEIGHT_DECAY,
        adjust_lr_fn="match_rms_adamw",
        **_ADDMM,
    )
    adamw = torch.optim.AdamW(params[split:], lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    return muon, adamw


def _ours(params: list[torch.Tensor]) -> MuonWithAdamW:
    return make_muon_optimizer(
        params, params[: len(MATRICES)], lr=LR, muon_lr=MUON_LR, momentum=0.95, weight_decay=WEIGHT_DECAY
    )


def _set_schedule(optimizers, step: int) -> None:
    """What LambdaLR does between steps: every group's lr scaled from its own peak."""
    for opt in optimizers:
        for group in opt.param_groups:
            group.setdefault("peak", group["lr"])
            group["lr"] = group["peak"] * (step + 1) / 6


def _step_both(ours, params, reference, theirs, step: int, micro_batches: int = 1) -> None:
    """One step of both from the same bf16 gradients (summed in fp32 over micro-batches), clipped at 1.0 on
    odd steps and not on even ones, by the global norm of all gradients."""
    device = params[0].device
    total = [torch.zeros(s, device=device) for s in (*MATRICES, *OTHERS)]
    for micro in range(micro_batches):
        drawn = _values(100 * step + micro, scale=3.0 if step % 2 else 0.003)
        grads = [g.bfloat16().to(device) for g in drawn]
        if micro:
            ours.accumulate_gradients()
        for p, g, t in zip(params, grads, total, strict=True):
            p.grad = g.to(p.dtype)
            t.add_(g.float())
    for r, t in zip(reference, total, strict=True):
        r.grad = t
    norm = ours.grad_norm()
    assert float(norm) == pytest.approx(float(torch.nn.utils.get_total_norm(total)), rel=1e-6)
    # clip_grad_norm_ with our norm: its last bits (ours sums per part) would flip roundings in
    # Newton-Schulz's bf16 products, hiding the update's own agreement
    torch.nn.utils.clip_grads_with_norm_(reference, 1.0, norm)
    for opt in theirs:
        opt.step()
    ours.clip_and_step(1.0, norm)
    ours.discard_gradients()


def test_fp32_muon_with_adamw_is_torch_muon_and_adamw_under_one_clip():
    """fp32 parameters: torch's Muon for the matrices and torch's AdamW for the rest, both clipped by the norm
    of all gradients together; a schedule changes both parts' lr through the joint optimizer's groups."""
    params = [torch.nn.Parameter(v) for v in _values(0)]
    reference = [torch.nn.Parameter(v) for v in _values(0)]
    ours, theirs = _ours(params), _reference(reference)
    assert isinstance(ours.parts["muon"], ClippedMuon) and isinstance(ours.parts["adamw"], ClippedAdamW)
    for step in range(6):
        _set_schedule([ours, *theirs], step)
        _step_both(ours, params, reference, theirs, step)
    for p, r, start in zip(params, reference, _values(0), strict=True):
        assert torch.allclose(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
        assert not torch.equal(p.detach(), start)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_master_weight_muon_matches_torch_muon_on_fp32_copies(device):
    """bf16 parameters: the fp32 masters follow torch's Muon and AdamW run on fp32 copies fed the same
    gradients (summed in fp32 over two micro-batches), within float rounding, through clipped and
    unclipped steps and a changing lr; the model's weights are the rounded masters."""
    params = [torch.nn.Parameter(v.bfloat16().to(device)) for v in _values(0)]
    reference = [torch.nn.Parameter(v.bfloat16().float().to(device)) for v in _values(0)]
    ours, theirs = _ours(params), _reference(reference)
    assert isinstance(ours.parts["muon"], MasterWeightMuon)
    assert isinstance(ours.parts["adamw"], MasterWeightAdamW)
    for step in range(6):
        _set_schedule([ours, *theirs], step)
        _step_both(ours, params, reference, theirs, step, micro_batches=2)
    for p, r in zip(params, reference, strict=True):
        master = ours.parts["muon" if p.ndim == 2 else "adamw"].state[p]["master"]
        assert torch.allclose(master, r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), master.bfloat16())
    starts = [v.bfloat16().float().to(device) for v in _values(0)[: len(MATRICES)]]
    for p, start in zip(params, starts, strict=False):  # Muon did move every matrix
        assert float((ours.parts["muon"].state[p]["master"] - start).abs().max()) > 1e-3


def test_newton_schulz_orthogonalises():
    """The orthogonalised update's singular values lie near 1 (torch's coefficients: within about 0.3-1.2),
    for tall and wide matrices alike, whatever the gradient's scale."""
    from flashdraft.train.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, newton_schulz

    for shape in ((64, 16), (16, 64)):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 1e-3
        singular = torch.linalg.svdvals(newton_schulz(g, NS_COEFFICIENTS, NS_STEPS, NS_EPS).float())
        assert singular.min() > 0.3 and singular.max() < 1.3, singular


@pytest.mark.parametrize("master_weights", [False, True])
def test_state_dict_round_trip_continues_exactly(master_weights):
    """Steps 0-2, a state dict through torch.save into a fresh optimizer over other weights, steps 3-4: the
    same weights bit for bit as five steps straight."""

    def fresh(seed):
        values = _values(seed)
        return [torch.nn.Parameter(v.bfloat16() if master_weights else v) for v in values]

    def run(opt, params, steps):
        for step in steps:
            for p, g in zip(params, _values(50 + step, scale=3.0), strict=True):
                p.grad = g.to(p.dtype)
            opt.clip_and_step(1.0)
            opt.discard_gradients()

    straight_params = fresh(0)
    straight = _ours(straight_params)
    run(straight, straight_params, range(5))
    first_params = fresh(0)
    first = _ours(first_params)
    run(first, first_params, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = fresh(7)  # other values: the masters must come from the state
    if not master_weights:  # fp32 weights come from the checkpoint's drafter, not the optimizer state
        with torch.no_grad():
            for p, saved in zip(resumed_params, first_params, strict=True):
                p.copy_(saved)
    resumed = _ours(resumed_params)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    # the joint optimizer's groups are the parts' own again (torch's load replaces a part's group dicts)
    assert all(
        any(group is mine for mine in resumed.param_groups)
        for part in resumed.parts.values()
        for group in part.param_groups
    )
    run(resumed, resumed_params, range(3, 5))
    for a, b in zip(straight_params, resumed_params, strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_the_state_of_plain_adamw_is_refused():
    params = [torch.nn.Parameter(v) for v in _values(0)]
    adamw = ClippedAdamW(params, lr=LR)
    with pytest.raises(ValueError, match=r"another train\.optimizer"):
        _ours([torch.nn.Parameter(v) for v in _values(0)]).load_state_dict(adamw.state_dict())


def test_a_matrix_muon_cannot_update_is_refused():
    with pytest.raises(ValueError, match="2-D"):
        MasterWeightMuon([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], lr=LR)


def _tiny_config(arch: str) -> Qwen3Config:
    target = Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
    )
    return make_drafter_config(target, num_layers=2, block_size=4, mask_token_id=300, arch=arch)


@pytest.mark.parametrize("model_class", [DFlashDraftModel, DFlash2DraftModel])
def test_muon_takes_the_linear_weights_of_the_layers_and_fc(model_class):
    """Which parameters Muon gets, told by module type rather than by name: the weight of every nn.Linear
    inside `layers` and of `fc`; everything else (norms, DFlash2's base kernels and its selector's codebooks
    and projection) stays with AdamW."""
    arch = "dflash2" if model_class is DFlash2DraftModel else "dflash"
    drafter = model_class(_tiny_config(arch))
    expected = {id(drafter.fc.weight)}
    for module in drafter.layers.modules():
        if isinstance(module, torch.nn.Linear):
            expected.add(id(module.weight))
    chosen = muon_matrices(drafter)
    assert {id(p) for p in chosen} == expected and len(chosen) == len(expected)
    names = {id(p): name for name, p in drafter.named_parameters()}
    others = {names[id(p)] for p in drafter.parameters() if id(p) not in expected}
    assert "layers.0.input_layernorm.weight" in others and "norm.weight" in others
    per_layer = 7 + (2 if arch == "dflash2" else 0)  # q k v o gate up down (+ two kernel projections)
    assert len(chosen) == 2 * per_layer + 1
    if arch == "dflash2":
        assert {
            "candidate_selector.hidden_projection.weight",
            "candidate_selector.predecessor_codebook.weight",
            "layers.1.mlp_conv.base_kernel",
        } <= others
        assert "layers.1.attention_conv.kernel_projection.weight" not in others


def test_config_refuses_an_unknown_optimizer_naming_the_choices():
    with pytest.raises(FlashdraftError, match=r"train.optimizer must be auto, adamw, muon, got 'sgd'"):
        validate(Config(train=TrainConfig(optimizer="sgd")))
    with pytest.raises(FlashdraftError, match=r"train.muon_momentum must be in \[0, 1\)"):
        validate(Config(train=TrainConfig(optimizer="muon", muon_momentum=1.0)))
    validate(Config(train=TrainConfig(optimizer="muon")))


def test_muon_with_fsdp_is_refused_and_with_ddp_allowed():
    muon = TrainConfig(optimizer="muon")
    with pytest.raises(FlashdraftError, match=r"train.optimizer=muon with distributed.data_parallel=fsdp"):
        validate(Config(train=muon, distributed=DistributedConfig(data_parallel="fsdp")))
    validate(Config(train=muon, distributed=DistributedConfig(data_parallel="ddp")))
    validate(Config(train=TrainConfig(), distributed=DistributedConfig(data_parallel="fsdp")))


def test_resuming_with_another_optimizer_is_refused():
    saved = to_dict(Config(train=TrainConfig(optimizer="adamw")))  # config.yaml records the resolved choice
    changed = to_dict(Config(train=TrainConfig(optimizer="muon", muon_lr=2.4e-3)))
    with pytest.raises(FlashdraftError, match=r"train.optimizer 'adamw' -> 'muon'"):
        check_resume_config(saved, 1, changed, 1, allow_changes=False, source="ckpt")
    older = to_dict(Config())
    del older["train"]["optimizer"]  # a checkpoint from before the setting: it trained with AdamW
    check_resume_config(older, 1, saved, 1, allow_changes=False, source="ckpt")
    with pytest.raises(FlashdraftError, match=r"train.optimizer 'adamw' -> 'muon'"):
        check_resume_config(older, 1, changed, 1, allow_changes=False, source="ckpt")
    # a Muon run recorded when train.muon_lr None meant train.lr trained at train.lr
    old_muon = to_dict(Config(train=TrainConfig(optimizer="muon", lr=6e-4)))
    same = to_dict(Config(train=TrainConfig(optimizer="muon", lr=6e-4, muon_lr=6e-4)))
    check_resume_config(old_muon, 1, same, 1, allow_changes=False, source="ckpt")
    with pytest.raises(FlashdraftError, match=r"train.muon_lr 0.0006 -> 0.0024"):
        check_resume_config(old_muon, 1, changed, 1, allow_changes=False, source="ckpt")


def test_auto_picks_muon_for_a_narrow_drafter_and_adamw_for_a_wide_one_or_fsdp():
    auto = TrainConfig(lr=6e-4)
    assert auto.optimizer == "auto"
    narrow = resolve_optimizer(auto, width=576, data_parallel="auto")
    assert (narrow.optimizer, narrow.muon_lr) == ("muon", pytest.approx(2.4e-3))  # 4 x lr
    assert resolve_optimizer(auto, width=1024, data_parallel="ddp").optimizer == "muon"
    wide = resolve_optimizer(auto, width=4096, data_parallel="auto")
    assert (wide.optimizer, wide.muon_lr) == ("adamw", None)
    assert resolve_optimizer(auto, width=576, data_parallel="fsdp").optimizer == "adamw"
    # a choice made is kept, and an explicit Muon lr too
    assert (
        resolve_optimizer(TrainConfig(optimizer="adamw"), width=576, data_parallel="auto").optimizer
        == "adamw"
    )
    explicit = resolve_optimizer(
        TrainConfig(optimizer="muon", muon_lr=6e-3), width=4096, data_parallel="auto"
    )
    assert (explicit.optimizer, explicit.muon_lr) == ("muon", 6e-3)


def test_auto_on_a_resume_continues_the_runs_optimizer_and_its_muon_lr():
    auto = TrainConfig(lr=6e-4)
    recorded_adamw = to_dict(TrainConfig(optimizer="adamw", lr=6e-4))
    assert (
        resolve_optimizer(auto, width=576, data_parallel="auto", resumed=recorded_adamw).optimizer == "adamw"
    )
    before_the_key = {k: v for k, v in recorded_adamw.items() if k != "optimizer"}
    assert (
        resolve_optimizer(auto, width=576, data_parallel="auto", resumed=before_the_key).optimizer == "adamw"
    )
    recorded_muon = to_dict(TrainConfig(optimizer="muon", lr=6e-4, muon_lr=1.2e-3))
    resumed = resolve_optimizer(auto, width=4096, data_parallel="auto", resumed=recorded_muon)
    assert (resumed.optimizer, resumed.muon_lr) == ("muon", 1.2e-3)
    old_muon = to_dict(TrainConfig(optimizer="muon", lr=6e-4))  # muon_lr None then meant train.lr
    assert resolve_optimizer(auto, width=576, data_parallel="auto", resumed=old_muon).muon_lr == 6e-4
    # an explicit setting still wins over the record (and the resume check then names the change)
    assert (
        resolve_optimizer(TrainConfig(optimizer="adamw"), 576, "auto", resumed=recorded_muon).optimizer
        == "adamw"
    )


def test_newton_schulz_owners_balance_the_products_over_the_ranks():
    """Costliest first, each to the least-loaded rank: every rank computes the same split without talking."""
    shapes = [torch.Size(s) for s in [(4096, 4096)] * 4 + [(12288, 4096)] * 3 + [(4096, 12288)] * 2]
    owners = newton_schulz_owners(shapes, 4)
    cost = [s[0] * s[1] * min(s) for s in shapes]
    load = [sum(c for c, o in zip(cost, owners, strict=True) if o == r) for r in range(4)]
    assert sorted(set(owners)) == [0, 1, 2, 3]
    assert max(load) - min(load) <= max(cost)  # greedy's bound: no rank a whole matrix ahead
    assert owners == newton_schulz_owners(shapes, 4)  # deterministic
    assert newton_schulz_owners(shapes, 1) == [0] * len(shapes)
    assert newton_schulz_owners([torch.Size((8, 8))], 3) == [0]  # fewer matrices than ranks
