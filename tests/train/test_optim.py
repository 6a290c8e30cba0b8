import pytest
import torch

from flashdraft.train.optim import clip_and_step, make_adamw


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
        opt = torch.optim.AdamW(params, lr=1e-2, fused=fused)
        clip_and_step(opt, params, 1.0)
        results.append(params)
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_cpu_path_clips():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 10.0)
    opt = make_adamw([p], lr=0.1, weight_decay=0.0, device=torch.device("cpu"))
    norm = clip_and_step(opt, [p], 1.0)
    assert float(norm) == pytest.approx(20.0) and torch.allclose(p.grad.norm(), torch.tensor(1.0))
