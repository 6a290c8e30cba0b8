"""`flashdraft bench quality` and what it stands on: stdlib prompts, the training-time budget, simulated τ
beside real τ in `flashdraft eval`."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from flashdraft.data.stdlib_prompts import split_prompts, stdlib_prompts, write_prompt_files
from flashdraft.errors import FlashdraftError
from flashdraft.model.tiny import save_tiny_target

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>"]
# The chain target's greedy answer to any prompt ending in "\n" (the Qwen template's generation prompt):
# each character is followed by the next one (all distinct), so every answer is CHAIN[1:].
CHAIN = ["\n", *"Sure:ok,thx! BYE", "<|im_end|>"]


def char_tokenizer():
    """One token per character (printable ASCII, newline, [UNK]) plus Qwen's turn markers, decoding by plain
    concatenation, so a regenerated answer re-encodes to the very ids the target produced. (A word tokenizer
    that decodes with spaces would not: its training answers would differ from the target's tokens.)"""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.data.helpers import QWEN_TEMPLATE

    chars = ["\n", *(chr(c) for c in range(32, 127)), "[UNK]"]
    vocab = {t: i for i, t in enumerate(chars + QWEN_SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        eos_token="<|im_end|>",
        additional_special_tokens=QWEN_SPECIALS,
    )
    fast.chat_template = QWEN_TEMPLATE
    return fast


def save_chain_target(out: Path) -> Path:
    """A tiny Qwen3 target that answers every chat prompt with the same short line and ends its turn: its
    residual branches are zeroed (the last hidden state is the last token's normalised embedding) and its
    head maps each chain token to the next one. A random tiny target never ends a turn, and prepare drops
    answers cut at the token limit."""
    tokenizer = char_tokenizer()
    save_tiny_target(out, "qwen3", vocab_size=128, hidden_size=64, num_layers=4, tokenizer=tokenizer)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tokenizer.convert_tokens_to_ids
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        unit = embed / embed.norm(dim=1, keepdim=True)
        head = torch.zeros_like(model.lm_head.weight)
        for here, after in itertools.pairwise(CHAIN):
            head[ids(after)] += 50 * unit[ids(here)]
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def chain_target(tmp_path_factory) -> Path:
    return save_chain_target(tmp_path_factory.mktemp("chain") / "target")


# --------------------------------------------------------------------------- prompts


def write_fake_stdlib(root: Path) -> Path:
    """A small library tree: a package, modules, a duplicate docstring, a test dir, an unparsable file."""
    long = "Return the {} of the two numbers given, rounding towards zero when they are not integers."
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text(f'"""{long.format("package summary")}"""\n')
    (root / "pkg" / "inner.py").write_text(
        f'def add(a, b):\n    """{long.format("sum")}"""\n\n\ndef _hidden():\n    """{long.format("hidden")}"""\n'
    )
    (root / "alpha.py").write_text(
        f'class Box:\n    """{long.format("box")}"""\n\n    def size(self):\n        """{long.format("size")}"""\n'
        f'\n\ndef short():\n    """Too short."""\n\n\ndef again():\n    """{long.format("sum")}"""\n'
    )
    (root / "beta.py").write_text(f'def mul(a, b):\n    """{long.format("product")}"""\n')
    (root / "gamma.py").write_text(f'"""{long.format("gamma module")}"""\n')
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text(f'def t():\n    """{long.format("test")}"""\n')
    (root / "broken.py").write_text("def (:\n")
    return root


def test_prompts_come_from_every_documented_definition_once_and_skip_tests_short_and_broken(tmp_path):
    prompts = stdlib_prompts(write_fake_stdlib(tmp_path / "lib"))
    sources = [(p.group, p.source) for p in prompts]
    # public functions give an "explain" and a "write" prompt, _hidden only "explain"; pkg.inner.add repeats
    # alpha.again's docstring (files are read in path order), and short, test and unparsable ones give none
    assert sources == [
        ("alpha", "alpha.Box"),
        ("alpha", "alpha.Box.size"),
        ("alpha", "alpha.Box.size"),
        ("alpha", "alpha.again"),
        ("alpha", "alpha.again"),
        ("beta", "beta.mul"),
        ("beta", "beta.mul"),
        ("gamma", "gamma"),
        ("pkg", "pkg"),
        ("pkg", "pkg.inner._hidden"),
    ]
    assert sum("Write a Python function named `again`" in p.text for p in prompts) == 1


def test_code_questions_ask_about_each_def_and_class_of_the_same_files_and_modules(tmp_path):
    root = write_fake_stdlib(tmp_path / "lib")
    docs = stdlib_prompts(root)
    both = stdlib_prompts(root, ("docs", "code"))
    code = stdlib_prompts(root, ("code",))
    assert stdlib_prompts(root, ("docs",)) == docs  # the default kind
    # a file's docstring prompts, then its snippets' questions; a broken file and tests give neither
    assert [p for p in both if not p.source.count(":")] == list(docs)
    assert [p for p in both if p.source.count(":")] == list(code)
    assert [(p.group, p.source) for p in code] == [
        ("alpha", "alpha:1"),
        ("alpha", "alpha:4"),
        ("alpha", "alpha:8"),
        ("alpha", "alpha:12"),
        ("beta", "beta:1"),
        ("pkg", "pkg.inner:1"),
        ("pkg", "pkg.inner:5"),
    ]
    first = code[0].text
    assert first.startswith(
        "In one or two sentences, what does this Python code do?\n\n```python\nclass Box:"
    )
    assert first.count("\n") == 3 + 12 and first.endswith("```")  # the question, 12 source lines, fenced
    # the held-out split stays by module, across both kinds
    train, held, _ = split_prompts(both, 6, 4)
    assert not {p.group for p in train} & {p.group for p in held}
    with pytest.raises(FlashdraftError, match="choose from docs, code"):
        stdlib_prompts(root, ("docstrings",))


def test_too_many_prompts_point_at_the_code_questions(tmp_path):
    from flashdraft.bench.quality import build_parser

    root = write_fake_stdlib(tmp_path / "lib")
    with pytest.raises(FlashdraftError, match="or add the code questions: --prompt-kinds docs,code"):
        write_prompt_files(tmp_path / "t.jsonl", tmp_path / "e.jsonl", 9, 2, root=root)
    written = write_prompt_files(
        tmp_path / "t.jsonl", tmp_path / "e.jsonl", 9, 2, root=root, kinds=("docs", "code")
    )
    assert written["train_prompts"] == 9 and written["kinds"] == ["docs", "code"]
    assert not (tmp_path / "t.jsonl.tmp").exists()
    assert build_parser().parse_args(["--target", "t", "--prompt-kinds", "code,docs"]).prompt_kinds == (
        "code",
        "docs",
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--target", "t", "--prompt-kinds", "docs,pictures"])


def test_held_out_prompts_share_no_module_with_training_and_counts_are_exact(tmp_path):
    prompts = stdlib_prompts(write_fake_stdlib(tmp_path / "lib"))
    train, held, spare = split_prompts(prompts, 4, 2)
    assert (len(train), len(held), spare) == (4, 2, [])
    assert not {p.group for p in train} & {p.group for p in held}
    assert split_prompts(list(prompts), 4, 2) == (train, held, [])  # deterministic
    with pytest.raises(FlashdraftError, match="--prompts 9 --eval-prompts 2: the standard library gives 10"):
        split_prompts(prompts, 9, 2)
    # spare (selection) prompts: held out from training too, none of them among the held-out ones
    train2, held2, spare2 = split_prompts(prompts, 2, 2, spare=2)
    assert held2 == held and len(train2) == len(spare2) == 2  # the held-out prompts do not move
    groups = [{p.group for p in side} for side in (train2, held2, spare2)]
    assert not groups[0] & groups[1] and not groups[0] & groups[2] and not groups[1] & groups[2]
    with pytest.raises(FlashdraftError, match="--eval-prompts 2 --select-prompts 9: the standard library"):
        split_prompts(prompts, 2, 2, spare=9)


@pytest.mark.slow
def test_the_real_standard_library_gives_the_default_counts_deterministically(tmp_path):
    first = write_prompt_files(tmp_path / "a.jsonl", tmp_path / "b.jsonl", 2000, 64)
    stdlib_prompts.cache_clear()  # a second scan from scratch must write the same files
    second = write_prompt_files(tmp_path / "c.jsonl", tmp_path / "d.jsonl", 2000, 64)
    assert first == second and first["train_prompts"] == 2000 and first["eval_prompts"] == 64
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "c.jsonl").read_bytes()
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "d.jsonl").read_bytes()
    train = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    top = {r["source"].split(".")[0] for r in train}
    assert not top & {r["source"].split(".")[0] for r in held}
    assert len({r["messages"][0]["content"] for r in train + held}) == 2064  # no prompt twice


# --------------------------------------------------------------------------- the training-time budget


def chain_samples(tokenizer, count: int, seed: int) -> str:
    """Token samples of the chain target's answers: a random prompt of letters, then the chain."""
    g = torch.Generator().manual_seed(seed)
    ids = tokenizer.convert_tokens_to_ids
    words = [ids(c) for c in "abcdefgh"]
    answer = [ids(t) for t in CHAIN]
    lines = []
    for _ in range(count):
        prompt = [
            words[int(i)]
            for i in torch.randint(
                0, len(words), (int(torch.randint(4, 12, (1,), generator=g)),), generator=g
            )
        ]
        lines.append(
            json.dumps({"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
        )
    return "\n".join(lines) + "\n"


def budget_config(target: Path, data: Path, out_dir: Path, resume: str = "never"):
    """A 0.03-minute budget with a checkpoint every 0.01 minute, on the chain target's answers."""
    from flashdraft.config import load_config

    return load_config(
        None,
        [
            f"model.target={target}",
            "model.num_layers=1",
            "model.block_size=4",
            f"data.train=[{data / 'train.jsonl'}]",
            f"data.eval=[{data / 'eval.jsonl'}]",
            "data.max_length=64",
            f"train.out_dir={out_dir}",
            "train.max_steps=1000",
            "train.max_minutes=0.03",
            "train.save_every_minutes=0.01",
            "train.save_every=100000",
            "train.eval_every=100000",
            "train.log_every=5",
            "train.keep_last=10",
            "train.batch_size=4",
            "train.num_anchors=4",
            "train.lr=3e-3",
            "train.device=cpu",
            f"train.resume={resume}",
        ],
    )


@pytest.fixture(scope="module")
def budget_run(chain_target, tmp_path_factory) -> tuple[Path, dict]:
    """A run stopped by train.max_minutes, with timed checkpoints each evaluated on held-out data."""
    from transformers import AutoTokenizer

    from flashdraft.train.trainer import train

    root = tmp_path_factory.mktemp("budget")
    tokenizer = AutoTokenizer.from_pretrained(chain_target)
    (root / "train.jsonl").write_text(chain_samples(tokenizer, 64, 0))
    (root / "eval.jsonl").write_text(chain_samples(tokenizer, 8, 1))
    return root / "run", train(budget_config(chain_target, root, root / "run"))


def test_a_resumed_run_keeps_the_training_time_it_already_spent(budget_run, chain_target, tmp_path):
    import shutil

    from flashdraft.train.trainer import train

    run, first = budget_run
    shutil.copytree(run, tmp_path / "run")
    resumed = train(budget_config(chain_target, run.parent, tmp_path / "run", resume="auto"))
    # the budget was already spent: one step, then the stop (a fresh clock would train 0.03 min more)
    assert resumed["budget_spent"] and resumed["steps"] == first["steps"] + 1
    assert resumed["train_minutes"] >= first["train_minutes"]


def test_max_minutes_stops_training_with_a_final_checkpoint_and_ends_the_lr_schedule(budget_run):
    from flashdraft.train.checkpoint import list_checkpoints

    run, result = budget_run
    assert result["budget_spent"] and result["outcome"] == "finished"
    assert result["steps"] < 1000 and 0.03 <= result["train_minutes"] < 0.2
    checkpoints = list_checkpoints(run)
    assert checkpoints[-1].name == f"step-{result['steps']:08d}"  # the final one, at the stopping step
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_train = [r for r in rows if r["kind"] == "train"][-1]
    assert last_train["step"] == result["steps"]
    # the cosine ran over the budget, not over the 1000 steps: the last lr is near its floor (0)
    assert last_train["lr"] < 0.05 * 3e-3


def test_timed_checkpoints_are_evenly_spaced_in_training_minutes_and_each_has_a_simulated_tau(budget_run):
    from flashdraft.train.checkpoint import list_checkpoints

    run, _ = budget_run
    steps = [int(p.name.removeprefix("step-")) for p in list_checkpoints(run)]
    assert len(steps) >= 3  # every 0.01 of a 0.03-minute budget, and the final one
    evals = {
        r["step"]: r
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "eval"
    }
    assert set(steps) <= set(evals)  # train.eval_every is far away: these evaluations are the timed ones
    minutes = [evals[s]["train_minutes"] for s in steps]
    assert minutes == sorted(minutes)
    for k, m in enumerate(minutes[:-1], start=1):
        assert 0.01 * k <= m < 0.01 * k + 0.01  # the first step past each multiple of the interval


def test_config_refuses_a_negative_budget():
    from flashdraft.config import load_config

    with pytest.raises(FlashdraftError, match=r"train.max_minutes must be >= 0"):
        load_config(None, ["train.max_minutes=-1"])
    with pytest.raises(FlashdraftError, match=r"train.save_every_minutes must be >= 0"):
        load_config(None, ["train.save_every_minutes=-0.5"])


# --------------------------------------------------------------------------- simulated τ beside real τ


def test_eval_prints_the_simulated_tau_of_the_checkpoint_beside_the_real_one(
    budget_run, chain_target, tmp_path
):
    from rich.console import Console

    from flashdraft.config import Sampling
    from flashdraft.infer.evaluate import EvalSettings, run_eval
    from flashdraft.train.checkpoint import list_checkpoints

    run, _ = budget_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["tau"] for r in rows if r["kind"] == "eval"}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "why be brief"}]}) + "\n")
    first = list_checkpoints(run)[0]
    step = int(first.name.removeprefix("step-"))
    console = Console(record=True, width=200)
    settings = EvalSettings(sampling=Sampling(max_new_tokens=16))
    report = run_eval(
        str(chain_target), str(first / "drafter"), str(prompts), settings, device="cpu", console=console
    )
    assert report["simulated"]["step"] == step and report["simulated"]["tau"] == evals[step]
    assert f"simulated τ, held-out (training step {step})" in console.export_text()
    # best/ is the first evaluation at the run's highest τ
    best = run_eval(
        str(chain_target), str(run / "best"), str(prompts), settings, device="cpu", console=console
    )
    top = max(evals.values())
    assert best["simulated"]["tau"] == top and best["simulated"]["step"] == min(
        s for s, t in evals.items() if t == top
    )
    # a drafter directory that is not a run's has none
    plain = tmp_path / "copy"
    import shutil

    shutil.copytree(first / "drafter", plain)
    assert "simulated" not in run_eval(
        str(chain_target), str(plain), str(prompts), settings, device="cpu", console=console
    )


def test_plain_decoding_is_run_once_across_checkpoints_when_greedy(
    budget_run, chain_target, tmp_path, monkeypatch
):
    from rich.console import Console

    from flashdraft.config import Sampling
    from flashdraft.infer import evaluate
    from flashdraft.train.checkpoint import list_checkpoints

    run, _ = budget_run
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in ("one", "two"))
    )
    plain_calls = []
    real_generate = evaluate.generate

    def counting(target, drafter, *args, **kwargs):
        if drafter is None:
            plain_calls.append(1)
        return real_generate(target, drafter, *args, **kwargs)

    monkeypatch.setattr(evaluate, "generate", counting)
    first, last = list_checkpoints(run)[0], list_checkpoints(run)[-1]
    console = Console(record=True, width=200)

    def evaluate_at(checkpoint, plain_runs, temperature=0.0):
        settings = evaluate.EvalSettings(
            sampling=Sampling(max_new_tokens=12, temperature=temperature), check_lossless=temperature == 0
        )
        return evaluate.run_eval(
            str(chain_target), str(checkpoint / "drafter"), str(prompts), settings, device="cpu",
            console=console, plain_runs=plain_runs,
        )  # fmt: skip

    shared: dict = {}
    a = evaluate_at(first, shared)
    # warm-up + 2, kept under the loop that decoded them (a speedup compares one loop with itself)
    assert len(plain_calls) == 3 and list(shared) == ["eager"] and len(shared["eager"]) == 2
    assert a["plain_decoding"] == "run"
    b = evaluate_at(last, shared)
    assert len(plain_calls) == 3 and b["plain_decoding"].startswith("reused")
    assert b["baseline_tokens_per_s"] == a["baseline_tokens_per_s"]
    fresh = evaluate_at(last, None)
    assert len(plain_calls) == 6
    # the reused plain outputs are the ones a fresh run decodes: the lossless check agrees
    assert b["lossless"] == fresh["lossless"] and b["lossless"]["identical"] == 2
    assert b["tau"] == fresh["tau"]
    # sampled decoding shares its generator between plain and speculative runs: never reused
    evaluate_at(last, shared, temperature=0.7)
    assert len(plain_calls) == 9


# --------------------------------------------------------------------------- the whole benchmark


def tiny_quality_argv(
    target,
    work: Path,
    out: Path,
    prompts: int = 16,
    eval_prompts: int = 2,
    minutes: str = "0.03",
    max_new: int = 12,
    select: int = 0,
) -> list[str]:
    """`bench quality` flags for the chain target on the CPU: seconds per variant. `select`: selection
    prompts (none by default: each adds a decode per curve point)."""
    return [
        "--target", str(target), "--work", str(work), "--out", str(out),
        "--device", "cpu", "--prompts", str(prompts), "--eval-prompts", str(eval_prompts),
        "--select-prompts", str(select), "--answer-tokens", "24",
        "--gpu-minutes", minutes, "--curve-points", "2", "--max-new-tokens", str(max_new),
        "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "4", "--max-length", "2048",
        "--batch-size", "4", "--eval-every", "1000", "--lr", "3e-3",
    ]  # fmt: skip


@pytest.mark.slow
def test_bench_quality_on_a_tiny_target_writes_a_curve_of_real_and_simulated_tau(
    chain_target, tmp_path, monkeypatch
):
    from flashdraft.bench import quality
    from flashdraft.cli import main

    asked = []  # (engine asked for, the plain runs' loops before the call) per curve point

    def recording(*args, plain_runs=None, **kwargs):
        asked.append((args[3].engine, sorted(plain_runs)))
        return real_run_eval(*args, plain_runs=plain_runs, **kwargs)

    real_run_eval = quality.run_eval
    monkeypatch.setattr(quality, "run_eval", recording)
    out = tmp_path / "quality.json"
    argv = tiny_quality_argv(chain_target, tmp_path / "work", out, 24, 3, "0.04", 16)
    assert main(["bench", "quality", *argv]) == 0
    # the points before the last on eval's default loop (fast on a GPU), the last beside z-lab's loop when
    # installed; plain decoding once per loop (here, on the CPU, both are the eager loop)
    zlab = importlib.util.find_spec("dflash") is not None
    assert [engine for engine, _ in asked] == ["auto"] * (len(asked) - 1) + ["zlab" if zlab else "auto"]
    assert [loops for _, loops in asked][1:] == [["eager"]] * (len(asked) - 1)
    result = json.loads(out.read_text())
    assert result["producer"] == "flashdraft bench quality" and result["command"].startswith(
        "flashdraft bench quality"
    )
    assert result["git_commit"] and result["device"]
    assert result["prompts"]["train_prompts"] == 24 and result["data"]["train"]["samples"] == 24
    curve = result["curve"]
    assert len(curve) >= 2
    minutes = [p["gpu_minutes"] for p in curve]
    assert minutes == sorted(minutes) and minutes[-1] >= 0.04
    for point in curve:
        assert 1 <= point["tau"] <= 4 and 1 <= point["simulated_tau"] <= 4
        assert len(point["acceptance_by_position"]) == 3 and point["speedup"] > 0
    assert result["final"] == curve[-1]
    assert ("zlab_tau" in curve[-1]) == result["zlab_available"]
    assert all("zlab_tau" not in p for p in curve[:-1])


def test_bench_quality_refuses_bad_flags_before_any_work(chain_target, tmp_path):
    from flashdraft.bench.quality import build_parser, run_quality

    def run(*flags: str) -> None:
        # small sizes: were a check missing, the benchmark would run, and fail the test, quickly
        small = ["--prompts", "2", "--eval-prompts", "1", "--gpu-minutes", "0.01", "--max-new-tokens", "2"]
        args = build_parser().parse_args(
            ["--target", str(chain_target), "--work", str(tmp_path / "w"), *small, *flags]
        )
        run_quality(args, [])

    with pytest.raises(FlashdraftError, match="--curve-points must be at least 2"):
        run("--curve-points", "1")
    with pytest.raises(FlashdraftError, match=r"--max-length must be at least 2 \* --block-size \(32\)"):
        run("--max-length", "20")
    with pytest.raises(FlashdraftError, match="--mask-token-id 128 is outside the target vocabulary"):
        run("--mask-token-id", "128")
    with pytest.raises(FlashdraftError, match=r"no config\.json"):  # the target is checked too
        run_quality(build_parser().parse_args(["--target", str(tmp_path), "--work", str(tmp_path / "w")]), [])
    assert not (tmp_path / "w").exists()  # nothing was built, not even the work directory


def test_a_compile_stall_does_not_decay_the_budget_schedule():
    from flashdraft.train.budget import budget_schedule_position

    # 100 s budget; step 10 done after a 50 s compile stall and nine 0.1 s steps: about 500 steps still fit,
    # so the schedule stands at ~2% of its length, not at the 51% of the budget the clock has spent.
    steps = [50.0] + [0.1] * 9
    position = budget_schedule_position(10, 10_000, 100.0, sum(steps), steps)
    assert 150 <= position <= 250
    # Without a step yet, and past the budget, the ends are the step itself and the whole schedule.
    assert budget_schedule_position(0, 10_000, 100.0, 0.0, []) == 0
    assert budget_schedule_position(400, 10_000, 100.0, 120.0, [0.1] * 10) == 10_000


def test_steps_that_compile_are_booked_as_compile_time_not_against_the_budget(monkeypatch):
    import torch

    from flashdraft.train import budget

    graphs = [0]
    now = [100.0]
    monkeypatch.setattr(budget.time, "perf_counter", lambda: now[0])
    clock = budget.TrainingClock(train_seconds=1.0, graphs=lambda: graphs[0])

    def step(seconds: float, compiles: bool, budget_seconds: float = 0.0) -> bool:
        clock.start()
        now[0] += seconds
        graphs[0] += compiles
        exceeded = clock.would_exceed(budget_seconds)
        clock.stop()
        return exceeded

    assert not step(40.0, compiles=True, budget_seconds=10.0)  # a 40 s compile never spends the budget
    assert not step(0.5, compiles=False, budget_seconds=10.0)
    assert not step(30.0, compiles=True, budget_seconds=10.0)  # a recompile for a new length
    assert clock.train_seconds == 1.5 and clock.compile_seconds == 70.0
    assert list(clock.recent) == [0.5]  # the schedule's typical step knows nothing of compiling
    assert step(8.5, compiles=False, budget_seconds=10.0)  # 1.5 + 8.5 reaches the 10 s budget

    # the real counter moves when torch.compile builds a graph, and not when it reuses one
    double = torch.compile(lambda x: x * 2, backend="eager")
    before = budget.compiled_graph_count()
    double(torch.ones(2))
    after_first = budget.compiled_graph_count()
    double(torch.ones(2))
    assert after_first == before + 1 and budget.compiled_graph_count() == after_first


# --------------------------------------------------------------------------- variants on shared data


@pytest.mark.slow
def test_variants_share_the_data_and_budget_and_are_compared(chain_target, tmp_path, monkeypatch):
    from flashdraft.bench import quality
    from flashdraft.cli import main

    work, out = tmp_path / "work", tmp_path / "compare.json"
    argv = tiny_quality_argv(chain_target, work, out)
    # one device: the variants run one after the other in this process
    assert main(["bench", "quality", *argv, "--variant", "dflash-dpace", "--variant", "dflash2"]) == 0
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["dflash-dpace", "dflash2"]
    assert result["variants"]["dflash2"]["overrides"] == quality.PRESETS["dflash2"]
    for name, variant in result["variants"].items():
        assert variant["training"]["budget_spent"] and 1 <= variant["final"]["tau"] <= 4
        run = work / "variants" / name / "run"
        drafter = json.loads((quality.list_checkpoints(run)[-1] / "drafter" / "config.json").read_text())
        assert drafter["architectures"] == ["DFlash2DraftModel" if name == "dflash2" else "DFlashDraftModel"]
    assert result["curve"] == result["variants"]["dflash-dpace"]["curve"]
    journal = sorted((work / "data" / "train").glob("regenerated.jsonl*"))
    stamp = [p.stat().st_mtime_ns for p in journal]

    # several devices: one process per variant, side by side, on the data prepared above
    monkeypatch.setattr(quality, "variant_devices", lambda device, per_gpu: ["cpu"] * 2)
    args = quality.build_parser().parse_args(
        [*argv, "--reuse-data", "--variant", "dflash-decay", "--variant", "wide:train.num_anchors=6"]
    )
    result = quality.run_quality(args, [])
    assert list(result["variants"]) == ["dflash-decay", "wide"]
    assert result["variants"]["wide"]["overrides"] == ["train.num_anchors=6"]
    assert (work / "variants" / "wide" / "log.txt").read_text()
    assert result["prompts"] is None and result["data"]["train"]["samples"] > 0
    assert [p.stat().st_mtime_ns for p in journal] == stamp  # nothing regenerated


@pytest.mark.slow
def test_a_benchmark_stopped_midway_leaves_what_it_measured(chain_target, tmp_path, monkeypatch):
    from flashdraft.bench import quality

    out = tmp_path / "quality.json"
    argv = tiny_quality_argv(chain_target, tmp_path / "work", out)
    real_eval, calls = quality.run_eval, []

    def killed_at_the_second_checkpoint(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a time limit's signal does to the decoding loop
        return real_eval(*args, **kwargs)

    monkeypatch.setattr(quality, "run_eval", killed_at_the_second_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        quality.run_quality(quality.build_parser().parse_args(argv), argv)
    result = json.loads(out.read_text())
    assert result["complete"] is False and result["data"]["train"]["samples"] == 16
    variant = result["variants"]["default"]
    assert variant["complete"] is False and variant["training"]["budget_spent"]
    assert len(variant["curve"]) == 1 and variant["final"] == variant["curve"][0] == result["final"]
    assert 1 <= variant["curve"][0]["tau"] <= 4

    # run to the end, the result is whole and says so
    monkeypatch.setattr(quality, "run_eval", real_eval)
    result = quality.run_quality(quality.build_parser().parse_args([*argv, "--reuse-data"]), argv)
    assert result["complete"] is True and json.loads(out.read_text())["complete"] is True
    assert result["variants"]["default"]["complete"] is True and len(result["curve"]) >= 2


def test_side_by_side_variants_pass_on_each_curve_point_as_their_processes_write_it(tmp_path, monkeypatch):
    from flashdraft.bench import quality

    work = tmp_path / "work"
    args = quality.build_parser().parse_args(
        ["--target", "t", "--work", str(work), "--variant", "a:train.lr=1e-3", "--variant", "b:train.lr=2e-3"]
    )

    def write(name: str, points: int, complete: bool) -> None:
        record = {"curve": [{"tau": 1.0 + p} for p in range(points)], "complete": complete}
        record["final"] = record["curve"][-1] if points else None
        path = quality.variant_dir(work, name) / "quality.json"
        path.write_text(json.dumps({"variants": {name: record}}))

    class Child:
        """A variant's process: writes one curve point, then (some polls later) its whole result."""

        def __init__(self, command, **kwargs):
            self.name = command[command.index("--variant") + 1].split(":")[0]
            self.polls = 0
            write(self.name, 1, False)

        def poll(self):
            self.polls += 1
            if self.polls < 3:
                return None
            write(self.name, 2, True)
            self.returncode = 0
            return 0

    monkeypatch.setattr(quality.subprocess, "Popen", Child)
    seen = []
    variants = quality.run_variants_side_by_side(
        args, work, ["cpu", "cpu"], Console(file=io.StringIO()),
        on_progress=lambda name, record: seen.append((name, len(record["curve"]), record["complete"])),
        poll_seconds=0,
    )  # fmt: skip
    assert sorted(variants) == ["a", "b"] and all(v["complete"] for v in variants.values())
    for name in ("a", "b"):
        mine = [(points, complete) for n, points, complete in seen if n == name]
        assert mine[0] == (1, False) and mine[-1] == (2, True), seen


def test_variant_flags_are_checked_before_any_work(chain_target, tmp_path):
    from flashdraft.bench.quality import build_parser, run_quality

    def run(*flags: str) -> None:
        args = build_parser().parse_args(
            ["--target", str(chain_target), "--work", str(tmp_path / "w"), *flags]
        )
        run_quality(args, [])

    with pytest.raises(SystemExit):  # argparse: neither a preset nor NAME:key=value
        build_parser().parse_args(["--target", "t", "--variant", "fastest"])
    with pytest.raises(SystemExit):  # an override without its value
        build_parser().parse_args(["--target", "t", "--variant", "half:train.lr"])
    # NAME: alone names the defaults (a baseline, and a side-by-side child's 'fresh')
    assert build_parser().parse_args(["--target", "t", "--variant", "base:"]).variant == [("base", [])]
    with pytest.raises(FlashdraftError, match="--variant: each name once"):
        run("--variant", "dflash2", "--variant", "dflash2")
    with pytest.raises(FlashdraftError, match=r"--variant odd: .*train\.no_such_knob"):
        run("--variant", "odd:train.no_such_knob=1")
    with pytest.raises(FlashdraftError, match=r"--variant bad: .*model\.arch"):
        run("--variant", "bad:model.arch=dflash3")
    with pytest.raises(FlashdraftError, match=r"--reuse-data: .* holds no prepared shards"):
        run("--reuse-data")
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_warm_start_fine_tunes_the_prior_beside_a_fresh_drafter_on_the_same_new_data(
    chain_target, tmp_path, monkeypatch
):
    """`--warm-start` (issue 33 item 3): a prior drafter trained on other prompts, then 'warm' (from its
    last checkpoint) and 'fresh' trained for the same budget on the training data, both scored alike."""
    from flashdraft.bench import quality
    from flashdraft.cli import main
    from flashdraft.model.drafter_dir import weights_sha256
    from flashdraft.train.checkpoint import load_trainer_state

    work, out = tmp_path / "work", tmp_path / "warm.json"
    argv = tiny_quality_argv(chain_target, work, out, 12, 2, "0.03", 12)
    assert main(["bench", "quality", *argv, "--warm-start", "0.03"]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and list(result["variants"]) == ["prior", "fresh", "warm"]

    # the training and held-out prompts are those of a run without --warm-start; the prior's are others
    def texts(path: Path) -> list[str]:
        return [json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines()]

    def trained_on(run: Path) -> list[str]:  # the data.train a run's last checkpoint recorded
        state = load_trainer_state(quality.list_checkpoints(run)[-1])
        return state["config"]["data"]["train"]

    plain = write_prompt_files(tmp_path / "t.jsonl", tmp_path / "e.jsonl", 12, 2)
    assert texts(work / "prompts" / "train.jsonl") == texts(tmp_path / "t.jsonl")
    assert texts(work / "prompts" / "eval.jsonl") == texts(tmp_path / "e.jsonl")
    prior_prompts = texts(work / "prompts" / "prior.jsonl")
    assert len(prior_prompts) == 12 == result["prompts"]["prior_prompts"]
    assert not set(prior_prompts) & (set(texts(tmp_path / "t.jsonl")) | set(texts(tmp_path / "e.jsonl")))
    assert plain["train_prompts"] == result["prompts"]["train_prompts"]
    assert result["data"]["prior"]["samples"] == 12

    # the prior trained on its own shards; warm started from its last checkpoint, fresh from nothing
    prior_run = work / "variants" / "prior" / "run"
    assert trained_on(prior_run) == [str(work / "data" / "prior")]
    last = quality.list_checkpoints(prior_run)[-1] / "drafter"
    warm = json.loads((work / "variants" / "warm" / "run" / "warm_start.json").read_text())
    assert warm["weights_sha256"] == weights_sha256(last)
    assert not (work / "variants" / "fresh" / "run" / "warm_start.json").exists()
    for name in ("fresh", "warm"):
        variant = result["variants"][name]
        assert variant["complete"] and variant["training"]["budget_spent"] and len(variant["curve"]) >= 2
        assert trained_on(work / "variants" / name / "run") == [str(work / "data" / "train")]
    summary = result["warm_start"]
    fresh, warm_final = result["variants"]["fresh"]["final"], result["variants"]["warm"]["final"]
    assert summary["tau"] == {
        "prior": result["variants"]["prior"]["final"]["tau"],
        "fresh": fresh["tau"],
        "warm": warm_final["tau"],
    }
    assert summary["tau_ratio"] == pytest.approx(warm_final["tau"] / fresh["tau"])
    assert summary["prior_minutes"] == 0.03
    assert ("zlab_tau_ratio" in summary) == result["zlab_available"]

    # a rerun on the prepared data reuses the prior's shards too, with fresh and warm side by side (one
    # process each, as on a GPU with --variants-per-gpu 2); --variant does not mix with it
    journal = sorted((work / "data" / "prior").glob("regenerated.jsonl*"))
    stamp = [p.stat().st_mtime_ns for p in journal]
    monkeypatch.setattr(quality, "variant_devices", lambda device, per_gpu: ["cpu"] * 2)
    args = quality.build_parser().parse_args([*argv, "--warm-start", "0.03", "--reuse-data"])
    again = quality.run_quality(args, [])
    assert again["warm_start"] is not None and list(again["variants"]) == ["prior", "fresh", "warm"]
    assert "--warm-start" not in (work / "variants" / "warm" / "log.txt").read_text()
    last = quality.list_checkpoints(prior_run)[-1] / "drafter"
    warm = json.loads((work / "variants" / "warm" / "run" / "warm_start.json").read_text())
    assert warm["weights_sha256"] == weights_sha256(last)
    assert [p.stat().st_mtime_ns for p in journal] == stamp
    with pytest.raises(FlashdraftError, match="--warm-start compares its own variants"):
        quality.run_quality(
            quality.build_parser().parse_args([*argv, "--warm-start", "1", "--variant", "dflash2"]), []
        )
    with pytest.raises(FlashdraftError, match=r"--reuse-data: .*prior holds no prepared shards"):
        fresh_work = [*tiny_quality_argv(chain_target, tmp_path / "w2", tmp_path / "w2.json"), "--reuse-data"]
        (tmp_path / "w2" / "data").mkdir(parents=True)
        for split in ("train", "eval"):
            (tmp_path / "w2" / "data" / split).symlink_to(work / "data" / split)
        quality.run_quality(quality.build_parser().parse_args([*fresh_work, "--warm-start", "1"]), [])
