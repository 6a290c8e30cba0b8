"""DFlash2 drafters (docs/drafters.md §3): flashdraft writes what z-lab's DFlash2DraftModel loads and reads
what it writes, with equal logits and equal selector paths; the training objective (with the selector term)
equals a per-block reference; decoding is lossless and equals z-lab's loop, greedy and sampled."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F

from flashdraft.cli import main
from flashdraft.errors import FlashdraftError
from flashdraft.generate.speculative import generate
from flashdraft.model.dflash2 import DFlash2DraftModel
from flashdraft.model.drafter_dir import load_drafter, save_drafter
from flashdraft.model.export import export_drafter
from flashdraft.model.target import TargetModel
from flashdraft.train.loss import WeightedHeadLoss
from flashdraft.train.objective import Objective
from tests.train.helpers import token_batch

zlab = pytest.importorskip("dflash.model", reason="install with: pip install --no-deps dflash==0.1.0")

MASK = 300
CTX = 9


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (a fresh DFlash2 layer is an exact DFlash layer: nothing would be tested)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "base_kernel" in name:  # z-lab leaves them uninitialised: start from the identity
                p.zero_()
                p[:, 0] = 1.0
            scale = 0.5 if "codebook" in name or "base_kernel" in name else 0.05
            p.add_(scale * torch.randn(p.shape, generator=g))


def _dflash2_dir(tmp_path, target: str, *flags: str, seed: int = 0):
    fresh = tmp_path / "fresh"
    base = ["init", "--target", target, "--out", str(fresh), "--arch", "dflash2", "--num-layers", "2"]
    assert main([*base, "--block-size", "4", "--mask-token-id", str(MASK), *flags]) == 0
    model = load_drafter(fresh)
    _perturb(model, seed)
    return save_drafter(model, tmp_path / "drafter", dtype=torch.float32, overwrite="any")


def test_init_writes_dflash2_config(tmp_path, qwen3_target):
    out = _dflash2_dir(tmp_path, qwen3_target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}
    d = config["dflash_config"]
    assert (d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"], d["selector_top_k"]) == (
        2,
        16,
        256,
        16,
    )
    assert isinstance(load_drafter(out), DFlash2DraftModel)


def test_fresh_dflash2_layers_compute_what_dflash_layers_do(tmp_path, qwen3_target):
    """Identity-initialised convolutions: warm-starting from DFlash weights changes nothing at first."""
    flags = ["--arch", "dflash2", "--num-layers", "2", "--block-size", "4", "--mask-token-id", "300"]
    assert main(["init", "--target", qwen3_target, "--out", str(tmp_path / "v2"), *flags]) == 0
    v2 = load_drafter(tmp_path / "v2")
    v1 = load_drafter(tmp_path / "v2")
    for layer in v1.layers:
        layer.attention_conv = layer.mlp_conv = None
    target = TargetModel.load(qwen3_target, v2.spec.target_layer_ids)
    features, noise, pos = _inputs(target)
    with torch.no_grad():
        assert torch.equal(
            v1(noise, features, pos[:, :CTX], pos[:, CTX:], None),
            v2(noise, features, pos[:, :CTX], pos[:, CTX:], None),
        )


def _inputs(target: TargetModel, seed: int = 0):
    ids = torch.randint(0, 299, (1, CTX + 1), generator=torch.Generator().manual_seed(seed))
    block = torch.tensor([[int(ids[0, CTX])] + [MASK] * 3])
    return target.features(ids[:, :CTX]), target.embed(block), torch.arange(CTX + 4)[None]


def _compare(ours, theirs, target):
    features, noise, pos = _inputs(target)
    with torch.no_grad():
        hidden = ours(noise, features, pos[:, :CTX], pos[:, CTX:], None)[:, 1:]
        a = ours.compute_logits(hidden, target.lm_head_weight)
        z_hidden = theirs(position_ids=pos, noise_embedding=noise, target_hidden=features)[:, 1:]
        head = target.model.get_output_embeddings()
        b = theirs.compute_logits(z_hidden, head)
        assert (a - b).abs().max().item() < 1e-4
        anchor = torch.tensor([7])  # the selector's first predecessor
        path, _, _ = ours.propose(hidden, anchor, target.lm_head_weight, 0.0)
        z_path, _, _ = theirs.propose(z_hidden, anchor, head, 0.0)
        assert torch.equal(path, z_path)


def test_zlab_loads_flashdraft_dflash2_with_equal_logits_and_paths(tmp_path, qwen3_target):
    out = _dflash2_dir(tmp_path, qwen3_target, "--layer-types", "S,F", "--sliding-window", "4")
    ours = load_drafter(out)
    theirs = zlab.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval()
    target = TargetModel.load(qwen3_target, ours.spec.target_layer_ids)
    for kind in {*ours.layer_kinds()}:
        assert kind.window is None or kind.causal
    features, noise, pos = _inputs(target)
    from flashdraft.model.attention import dense_mask

    masks = {
        k.key: dense_mask(torch.tensor([[CTX]]), torch.tensor([[True]]), pos[:, :CTX], 4, k)
        for k in ours.layer_kinds()
    }
    with torch.no_grad():
        a = ours.compute_logits(
            ours(noise, features, pos[:, :CTX], pos[:, CTX:], masks), target.lm_head_weight
        )
        z = theirs(position_ids=pos, noise_embedding=noise, target_hidden=features)
        b = theirs.compute_logits(z, target.model.get_output_embeddings())
    assert (a - b).abs().max().item() < 1e-4


def test_both_directions_equal(tmp_path, qwen3_target):
    out = _dflash2_dir(tmp_path, qwen3_target)
    ours = load_drafter(out)
    theirs = zlab.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval()
    target = TargetModel.load(qwen3_target, ours.spec.target_layer_ids)
    _compare(ours, theirs, target)

    # z-lab writes (its base kernels start uninitialised: give them values), flashdraft reads
    config = theirs.config
    written = zlab.DFlash2DraftModel(config).float().eval()
    _perturb(written, 7)
    written.save_pretrained(tmp_path / "z")
    _compare(load_drafter(tmp_path / "z"), written, target)

    # released checkpoints name the codebooks without ".weight"
    from safetensors.torch import load_file, save_file

    state = load_file(str(out / "model.safetensors"))
    state = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"))
    _compare(load_drafter(out), theirs, target)


def test_selector_changes_the_draft(tmp_path, qwen3_target):
    """Guards the tests above: with these weights the selector's path differs from the head's argmax."""
    out = _dflash2_dir(tmp_path, qwen3_target)
    ours = load_drafter(out)
    target = TargetModel.load(qwen3_target, ours.spec.target_layer_ids)
    differs = False
    for seed in range(5):
        features, noise, pos = _inputs(target, seed)
        with torch.no_grad():
            hidden = ours(noise, features, pos[:, :CTX], pos[:, CTX:], None)[:, 1:]
            path, _, _ = ours.propose(hidden, torch.tensor([0]), target.lm_head_weight, 0.0)
            differs |= not torch.equal(path, ours.compute_logits(hidden, target.lm_head_weight).argmax(-1))
    assert differs


def _reference(drafter, target, batch, anchors_per_row, block, gamma, alpha):
    """One block at a time (the convolutions see only their block), explicit selector scores."""
    head = target.lm_head_weight
    sel = drafter.candidate_selector
    num, den = 0.0, 0.0
    for row, anchors in enumerate(anchors_per_row):
        n = int(batch.lengths[row])
        ids = batch.input_ids[row, :n]
        feats = target.features(ids[None])
        for a in anchors:
            x = target.embed(torch.tensor([[int(ids[a])] + [MASK] * (block - 1)]))
            hidden = drafter(x, feats[:, :a], torch.arange(a)[None], torch.arange(a, a + block)[None], None)[
                0
            ]
            logits = hidden @ head.T
            for k in range(1, block):
                p = a + k
                if not (p < n and batch.loss_mask[row, p]):
                    continue
                w = math.exp(-(k - 1) / gamma)
                loss = F.cross_entropy(logits[k][None], ids[p][None])
                unary, cand = logits[k].detach().topk(sel.top_k)
                if ids[p] in cand:
                    left = sel.predecessor_codebook.weight[ids[p - 1]] * (
                        sel.hidden_projection.weight @ hidden[k]
                    )
                    scores = unary + sel.successor_codebook.weight[cand] @ left
                    target_index = (cand == ids[p]).nonzero()[0]
                    loss = loss + alpha * F.cross_entropy(scores[None], target_index)
                num = num + w * loss
                den += w
    return num / den


def test_objective_with_selector_equals_per_block_reference(tmp_path, qwen3_target):
    out = _dflash2_dir(tmp_path, qwen3_target)
    drafter = load_drafter(out)
    drafter.candidate_selector.top_k = 40  # a tiny untrained head: a wider net so labels are candidates
    target = TargetModel.load(qwen3_target, drafter.spec.target_layer_ids)
    batch = token_batch([23, 15], prompt_lengths=[5, 9], seq_len=26)
    objective = Objective(drafter, target, num_anchors=6, gamma=3.0, loss=WeightedHeadLoss(chunk=7))
    objective.selector_weight = 0.5
    blocks = objective.blocks(batch)
    out_ = objective(batch, blocks)
    loss = out_.loss_sum / out_.weight_sum
    loss.backward()
    g_batched = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    anchors = [blocks.anchors[r][blocks.keep[r]].tolist() for r in range(2)]
    ref = _reference(drafter, target, batch, anchors, 4, 3.0, 0.5)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    for name, p in drafter.named_parameters():
        assert torch.allclose(g_batched[name], p.grad, atol=1e-5, rtol=1e-4), name
    assert drafter.candidate_selector.successor_codebook.weight.grad.abs().sum() > 0


@pytest.fixture
def decoding_pair(tmp_path, qwen3_target, monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # z-lab times with CUDA syncs
    out = _dflash2_dir(tmp_path, qwen3_target, seed=3)
    drafter = load_drafter(out)
    target = TargetModel.load(qwen3_target, drafter.spec.target_layer_ids)
    theirs = zlab.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval()
    return target, drafter, theirs


class VerifiedBlocks:
    """Records every block the target verifies (anchor + drafts): equal lists mean equal drafts."""

    def __init__(self, model: torch.nn.Module):
        self.blocks: list[list[int]] = []
        self.handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.blocks.append(ids[0].tolist())

    def take(self) -> list[list[int]]:
        blocks, self.blocks = self.blocks, []
        return blocks


def test_greedy_decoding_is_lossless_and_equals_zlab_loop(decoding_pair):
    target, drafter, theirs = decoding_pair
    verified = VerifiedBlocks(target.model)
    for seed in range(2):
        prompt = torch.randint(0, 299, (1, 7 + seed), generator=torch.Generator().manual_seed(seed))
        ours = generate(target, drafter, prompt, 20)
        our_blocks = verified.take()
        assert ours.tokens == generate(target, None, prompt, 20).tokens
        verified.take()
        zl = zlab.dflash_generate(theirs, target.model, prompt, 20, None, temperature=0.0, return_stats=True)
        assert zl.output_ids[0, prompt.shape[1] :].tolist() == ours.tokens
        assert zl.acceptance_lengths == ours.accepted
        assert verified.take() == our_blocks


def test_sampled_decoding_equals_zlab_loop(decoding_pair):
    """Same global seed, same draws in the same order: the selector's sampled path, its q rows in the
    rejection rule and the residual draws match z-lab's loop token for token."""
    target, drafter, theirs = decoding_pair
    verified = VerifiedBlocks(target.model)
    for seed in range(3):
        prompt = torch.randint(0, 299, (1, 8), generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(100 + seed)
        ours = generate(target, drafter, prompt, 16, temperature=0.8)
        our_blocks = verified.take()
        torch.manual_seed(100 + seed)
        zl = zlab.dflash_generate(theirs, target.model, prompt, 16, None, temperature=0.8, return_stats=True)
        assert zl.output_ids[0, prompt.shape[1] :].tolist() == ours.tokens
        assert zl.acceptance_lengths == ours.accepted
        assert verified.take() == our_blocks


def test_export(tmp_path, qwen3_target):
    out = _dflash2_dir(tmp_path, qwen3_target)
    command = export_drafter(out, "zlab", tmp_path / "z")
    assert "DFlash2DraftModel" in command
    with pytest.raises(FlashdraftError, match="DFlash2 drafters"):
        export_drafter(out, "vllm", tmp_path / "v", target=qwen3_target)


@pytest.mark.slow
def test_trainer_trains_a_dflash2_drafter_by_config_override_only(tmp_path, qwen3_target):
    from flashdraft.config import load_config
    from flashdraft.train.trainer import train

    data = tmp_path / "d.jsonl"
    with data.open("w") as f:
        for i in range(4):
            ids = [(i * 5 + j) % 290 for j in range(40)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 4 + [1] * 36}) + "\n")
    out = tmp_path / "run"
    overrides = [
        f"model.target={qwen3_target}",
        "model.mask_token_id=300",
        "model.block_size=4",
        "model.arch=dflash2",
        "model.layer_types=[S, F]",
        "model.sliding_window=16",
        "train.loss=lk",
        "train.position_weight=dpace",
        "train.selector_ramp_steps=2",
        f"data.train=[{data}]",
        f"train.out_dir={out}",
        "train.max_steps=3",
        "train.log_every=1",
        "train.num_anchors=8",
        "train.batch_size=2",
        "train.device=cpu",
        "train.resume=never",
    ]
    train(load_config(None, overrides))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "loss" in r]) == 3 and all(
        math.isfinite(r["loss"]) for r in rows if "loss" in r
    )
    saved = load_drafter(out / "checkpoints" / "step-00000003" / "drafter")
    assert isinstance(saved, DFlash2DraftModel)
    assert [k.window for k in saved.layer_kinds()] == [16, None]


@pytest.mark.slow
def test_sampled_selector_decoding_follows_the_target_distribution(tmp_path):
    """1,500 seeded runs at T=1 over a 24-token vocabulary: the 2nd and 3rd generated tokens, which pass
    through the selector's sampled path, rejection against its q rows and residual sampling, follow the
    target's exact marginals (TV < 0.07; sampling noise alone is about 0.035)."""
    from flashdraft.model.drafter_dir import make_drafter_config, new_drafter
    from flashdraft.model.tiny import save_tiny_target

    target_dir = save_tiny_target(
        tmp_path / "t", "qwen3", vocab_size=24, hidden_size=32, num_layers=4, seed=3
    )
    target = TargetModel.load(target_dir, [1, 2])
    with torch.no_grad():
        target.lm_head_weight.mul_(6.0)  # a sharper target: its distribution has structure
    config = make_drafter_config(
        target.config, num_layers=1, block_size=4, mask_token_id=23, target_layer_ids=[1, 2], arch="dflash2"
    )
    config.dflash_config["selector_top_k"] = 5
    drafter = new_drafter(config)
    drafter.init_weights(torch.Generator().manual_seed(0))
    _perturb(drafter, 5)
    drafter.fc.weight.data.mul_(20)  # confident drafts: both accepted and rejected blocks occur
    prompt = torch.tensor([[3, 7, 11]])
    with torch.no_grad():
        p1 = torch.softmax(target.model(prompt).logits[0, -1], -1)
        seqs = torch.cat([prompt.expand(24, -1), torch.arange(24)[:, None]], 1)
        p2_given = torch.softmax(target.model(seqs).logits[:, -1], -1)
        seqs3 = torch.cat([seqs.repeat_interleave(24, 0), torch.arange(24).repeat(24)[:, None]], 1)
        p3_given = torch.softmax(target.model(seqs3).logits[:, -1], -1).view(24, 24, 24)
    joint12 = p1[:, None] * p2_given
    exact2, exact3 = joint12.sum(0), (joint12[:, :, None] * p3_given).sum((0, 1))
    g = torch.Generator().manual_seed(1)
    seconds, thirds, steps = [], [], []
    for _ in range(1500):
        out = generate(target, drafter, prompt, 3, temperature=1.0, generator=g)
        seconds.append(out.tokens[1])
        thirds.append(out.tokens[2])
        steps.append(len(out.accepted))
    emp2 = torch.bincount(torch.tensor(seconds), minlength=24) / 1500
    emp3 = torch.bincount(torch.tensor(thirds), minlength=24) / 1500
    assert 0.5 * (emp2 - exact2).abs().sum() < 0.07
    assert 0.5 * (emp3 - exact3).abs().sum() < 0.07
    assert 1 in steps and max(steps) > 1


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"conv_group_size": 7}, "'dflash_config.conv_group_size'=7 does not divide hidden_size"),
        ({"selector_top_k": None}, "needs 'dflash_config.selector_top_k' as a positive integer"),
        ({"selector_top_k": 100000}, "'dflash_config.selector_top_k'=100000 exceeds vocab_size"),
    ],
)
def test_bad_dflash2_fields_are_named(tmp_path, qwen3_target, edit, message):
    out = _dflash2_dir(tmp_path, qwen3_target)
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["dflash_config"] |= edit
    path.write_text(json.dumps(config))
    with pytest.raises(FlashdraftError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_drafter(out)
