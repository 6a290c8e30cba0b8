"""The drafter's optimizers against torch's AdamW + clip_grad_norm_."""

import io

import pytest
import torch

from flashdraft.train.optim import ClippedAdamW, MasterWeightAdamW, make_optimizer

SHAPES = [(64, 32), (17,), (8, 3, 5)]


def _grads(seed: int, scale: float = 3.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale).bfloat16() for s in SHAPES]


def _bf16_params(seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16().to(device)) for s in SHAPES]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_master_weights_follow_torch_adamw_with_clipping(device):
    """The master-weight update (compiled on CUDA, as training runs it) against torch's plain for-loop
    AdamW on fp32 copies, through a changing lr, clipped and unclipped steps, and the written-back bf16
    weights."""
    params = _bf16_params(device=device)
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours = make_optimizer(params, lr=1e-2, weight_decay=0.1, compile=device == "cuda")
    theirs = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=False)
    assert isinstance(ours, MasterWeightAdamW)
    for step in range(6):
        for group in (*ours.param_groups, *theirs.param_groups):
            group["lr"] = 1e-2 * (step + 1) / 6  # a schedule changes lr between steps
        grads = _grads(step, scale=3.0 if step % 2 else 0.01)  # clipped on odd steps, not on even ones
        for p, r, g in zip(params, reference, grads, strict=True):
            p.grad, r.grad = g.to(device), g.float().to(device)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0)
        theirs.step()
        norm = ours.clip_and_step(1.0)
        ours.zero_grad(set_to_none=True)
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    for p, r in zip(params, reference, strict=True):
        master = ours.state[p]["master"]
        assert torch.allclose(master, r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), master.bfloat16())  # the model's weights are the rounded masters
        assert not torch.equal(master, master.bfloat16().float())  # and the masters keep bits bf16 cannot


def test_micro_batch_gradients_are_summed_in_fp32():
    params = _bf16_params()
    opt = MasterWeightAdamW(params, lr=1e-3)
    first, second = _grads(1), _grads(2)
    for p, g in zip(params, first, strict=True):
        p.grad = g.clone()
    opt.accumulate_gradients()
    assert all(p.grad is None for p in params)
    for p, g in zip(params, second, strict=True):
        p.grad = g.clone()
    summed = opt.gradients()
    for s, a, b in zip(summed, first, second, strict=True):
        assert s.dtype == torch.float32 and torch.equal(s, a.float() + b.float())
    assert all(x is y for x, y in zip(opt.gradients(), summed, strict=True))


def test_fp32_gradients_for_an_all_reduce_are_the_ones_stepped():
    params = _bf16_params()
    opt = MasterWeightAdamW(params, lr=1e-3)
    for p, g in zip(params, _grads(3), strict=True):
        p.grad = g.clone()
    params[1].grad = None  # a parameter without a gradient still takes part (ranks must agree)
    reduced = opt.gradients(fp32=True)
    assert all(g.dtype == torch.float32 for g in reduced) and torch.equal(reduced[1], torch.zeros(SHAPES[1]))
    for g in reduced:
        g.mul_(0)  # what an all-reduce writes is what the step uses: zero gradients leave the masters alone
    before = [opt.state[p]["master"].clone() for p in params]
    opt.clip_and_step(1.0)
    assert all(torch.equal(b, opt.state[p]["master"]) for b, p in zip(before, params, strict=True))


def test_state_dict_round_trip_keeps_fp32_masters_and_continues_exactly():
    def run(opt, params, steps):
        for step in steps:
            for p, g in zip(params, _grads(step), strict=True):
                p.grad = g.clone()
            opt.clip_and_step(1.0)
            opt.zero_grad(set_to_none=True)

    params = _bf16_params()
    straight = MasterWeightAdamW(params, lr=1e-2, weight_decay=0.01)
    run(straight, params, range(5))

    resumed_params = _bf16_params()
    first = MasterWeightAdamW(resumed_params, lr=1e-2, weight_decay=0.01)
    run(first, resumed_params, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    fresh_params = _bf16_params(seed=9)  # other values: everything must come from the state
    second = MasterWeightAdamW(fresh_params, lr=5.0)
    second.load_state_dict(torch.load(buffer))
    assert second.param_groups[0]["lr"] == 1e-2 and second.steps == 3
    run(second, fresh_params, range(3, 5))
    for a, b in zip(params, fresh_params, strict=True):
        assert torch.equal(a, b) and torch.equal(straight.state[a]["master"], second.state[b]["master"])


def test_state_of_another_model_is_refused():
    opt = MasterWeightAdamW(_bf16_params(), lr=1e-3)
    other = MasterWeightAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], lr=1e-3)
    with pytest.raises(ValueError, match="does not match"):
        opt.load_state_dict(other.state_dict())


def test_fp32_parameters_get_torch_adamw_and_clip():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 10.0)
    opt = make_optimizer([p], lr=0.1, weight_decay=0.0)
    assert isinstance(opt, ClippedAdamW)
    norm = opt.clip_and_step(1.0)
    assert float(norm) == pytest.approx(20.0) and torch.allclose(p.grad.norm(), torch.tensor(1.0))


@pytest.mark.gpu
def test_fused_clip_equals_clip_grad_norm_then_step():
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    base = [torch.randn(64, 32, device=cuda), torch.randn(17, device=cuda)]
    grads = [torch.randn_like(p) * 10 for p in base]
    results = []
    for fused in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in base]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        ClippedAdamW(params, lr=1e-2, fused=fused).clip_and_step(1.0)
        results.append(params)
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_step_gathers_its_gradients_once():
    """grad_norm(), the all-reduce and step() share one gathering of the step's gradients (micro-batch sums
    included); a parameter without a gradient is zero-filled once, in fp32."""
    passes = []

    class Counting(MasterWeightAdamW):
        def accumulate_gradients(self) -> None:
            passes.append(1)
            super().accumulate_gradients()

    params = _bf16_params()
    opt = Counting(params, lr=1e-2)
    for micro in range(2):
        for p, g in zip(params[:2], _grads(micro), strict=False):  # params[2] gets no gradient
            p.grad = g.clone()
        if micro == 0:
            opt.accumulate_gradients()
    reduced = opt.gradients(fp32=True)
    norm = opt.grad_norm()
    assert opt.gradients() is reduced and opt.gradients(fp32=True) is reduced
    assert torch.equal(reduced[2], torch.zeros(SHAPES[2])) and reduced[2].dtype == torch.float32
    opt.clip_and_step(1.0, norm)
    assert len(passes) == 2  # one between the micro-batches, one to gather the step
    opt.discard_gradients()
    for p, g in zip(params, _grads(5), strict=True):  # the next step gathers its own gradients
        p.grad = g.clone()
    assert all(torch.equal(a, b) for a, b in zip(opt.gradients(), _grads(5), strict=True))


def test_parameters_become_aligned_views_of_one_flat_weight_buffer():
    """The update writes one flat buffer per group; the model computes with views of it, each slot 128
    bytes aligned within it, and the gaps between slots stay zero through steps."""
    params = _bf16_params()
    values = [p.detach().clone() for p in params]
    opt = MasterWeightAdamW(params, lr=1e-2)
    (group,) = opt.groups
    base = group.weights.data_ptr()
    for p, value in zip(params, values, strict=True):
        assert torch.equal(p, value)  # laid out without changing a value
        # 128 bytes from the buffer's start (CUDA allocations start 512-byte aligned; the CPU's 64)
        assert base <= p.data_ptr() < base + group.weights.numel() * 2 and (p.data_ptr() - base) % 128 == 0
    for step in range(2):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g.clone()
        opt.clip_and_step(1.0)
        opt.discard_gradients()
    used = torch.zeros(group.weights.numel(), dtype=torch.bool)
    for o, n in zip(group.offsets, group.numels, strict=True):
        used[o : o + n] = True
    for flat in (group.weights, group.master, *group.moments.values()):
        assert not flat[~used].any()
    assert all(torch.equal(p, opt.state[p]["master"].bfloat16()) for p in params)  # the views moved too


def test_a_parameter_replaced_after_the_optimizer_was_built_is_refused():
    """A parameter moved off its slot would no longer be trained: the step says so instead."""
    params = _bf16_params()
    opt = MasterWeightAdamW(params, lr=1e-2)
    params[1].data = params[1].detach().clone()  # e.g. load_state_dict(assign=True)
    for p, g in zip(params, _grads(0), strict=True):
        p.grad = g.clone()
    with pytest.raises(RuntimeError, match=r"shape \(17,\) no longer lives in the .* flat weight buffer"):
        opt.clip_and_step(1.0)


def test_a_group_of_mixed_dtypes_is_refused_at_construction():
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="one dtype on one device"):
        MasterWeightAdamW(params, lr=1e-2)


def test_a_gradient_missing_in_one_step_is_zero_not_the_last_steps():
    """The flat gradient buffer is reused: a parameter without a gradient in this step counts as zero,
    not as the value its slot held in the step before."""
    params = _bf16_params()
    opt = MasterWeightAdamW(params, lr=1e-2)
    for p, g in zip(params, _grads(0), strict=True):
        p.grad = g.clone()
    opt.clip_and_step(1.0)
    opt.discard_gradients()
    params[0].grad = _grads(1)[0]
    gathered = opt.gradients()
    assert torch.equal(gathered[0], params[0].grad)
    assert not gathered[1].any() and not gathered[2].any()
