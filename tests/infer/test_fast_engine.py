"""The fast engine (flashdraft/generate/fast.py) against the eager loop and z-lab's `dflash_generate`, in
fp32 on the CPU (eager steps; the CUDA-graph steps are tests/generate/test_fast_engine_gpu.py): the same
tokens, the same acceptance length at every step, whatever the batch and however rows are refilled."""

from __future__ import annotations

import json
import time

import pytest
import torch

from flashdraft.cli import main
from flashdraft.generate.fast import FastEngine, unsupported_reason
from flashdraft.generate.speculative import generate
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.model.target import TargetModel
from tests.infer.dflash2_drafter import dflash2_from

NEW = 40


@pytest.fixture(scope="module")
def pair(trained):
    drafter = load_drafter(trained["drafter"])
    return TargetModel.load(trained["target"], drafter.spec.target_layer_ids), drafter


@pytest.fixture(scope="module")
def prompts(trained) -> list[torch.Tensor]:
    """Prompts from the drafter's training data (prompt + a few answer tokens, of varied lengths), where it
    has learnt to draft: multi-token acceptances happen, so equal steps mean equal rollbacks."""
    records = [json.loads(line) for line in (trained["target"].parent / "train.jsonl").open()][:7]
    return [
        torch.tensor([r["input_ids"][: r["loss_mask"].index(1) + 2 + 3 * i]])
        for i, r in enumerate(records)
        if 1 in r["loss_mask"]
    ]


@pytest.fixture(scope="module")
def eager(pair, prompts):
    target, drafter = pair
    return [generate(target, drafter, p, NEW) for p in prompts]


def test_fast_engine_equals_the_eager_loop_step_by_step(pair, prompts, eager):
    target, drafter = pair
    assert max(max(run.accepted) for run in eager) >= 3  # real multi-token acceptances are exercised
    fast = FastEngine(target, drafter, NEW).generate(prompts)
    assert [run.tokens for run in fast] == [run.tokens for run in eager]
    assert [run.accepted for run in fast] == [run.accepted for run in eager]


def test_plain_decoding_is_block_size_one_through_the_same_engine(pair, prompts):
    target, _ = pair
    plain = FastEngine(target, None, NEW).generate(prompts[:3])
    for prompt, run in zip(prompts[:3], plain, strict=True):
        reference = generate(target, None, prompt, NEW)
        assert run.tokens == reference.tokens and run.accepted == [1] * len(run.accepted)


def test_one_engine_decoding_prompt_after_prompt_reuses_its_buffers_and_stays_exact(
    pair, prompts, eager, monkeypatch
):
    """Calls with one `min_width` (the real τ of training decodes a prompt per call) allocate once and
    decode what the eager loop decodes, stale columns of the prompt before notwithstanding."""
    target, drafter = pair
    engine = FastEngine(target, drafter, NEW)
    allocations = []
    original = engine._allocate
    monkeypatch.setattr(engine, "_allocate", lambda width: (allocations.append(width), original(width)))
    width = max(p.shape[1] for p in prompts) + NEW + drafter.block_size
    runs = [engine.generate([p], min_width=width)[0] for p in reversed(prompts)][::-1]
    # once, at the bucket multiple above it (every attended width aligned: split attention's rule)
    assert allocations == [-(-width // engine.bucket) * engine.bucket] and width % engine.bucket
    assert [run.tokens for run in runs] == [run.tokens for run in eager]
    assert [run.accepted for run in runs] == [run.accepted for run in eager]


@pytest.mark.parametrize("rows", [2, 3])
def test_batched_rows_accept_what_batch_one_accepts(pair, prompts, eager, rows):
    """Ragged rows (prompts of different lengths, different acceptance per step), finished rows refilled
    with the next prompt: every prompt's tokens and per-step acceptance equal batch 1's, so τ is equal."""
    target, drafter = pair
    batched = FastEngine(target, drafter, NEW, rows=rows).generate(prompts)
    assert [run.tokens for run in batched] == [run.tokens for run in eager]
    assert [run.accepted for run in batched] == [run.accepted for run in eager]
    assert [run.tau for run in batched] == [run.tau for run in eager]


def test_rows_stop_on_their_own_stop_token(pair, prompts, eager):
    target, drafter = pair
    stops = [eager[0].tokens[9], eager[1].tokens[4]]
    reference = [generate(target, drafter, p, NEW, stop_token_ids=stops) for p in prompts]
    assert {len(run.tokens) for run in reference} != {NEW}  # some rows do stop early
    fast = FastEngine(target, drafter, NEW, stop_token_ids=stops, rows=3).generate(prompts)
    assert [run.tokens for run in fast] == [run.tokens for run in reference]
    assert [run.accepted for run in fast] == [run.accepted for run in reference]


@pytest.mark.parametrize("drafted", [True, False])
def test_runs_of_steps_between_looks_decode_what_a_look_every_step_decodes(pair, prompts, drafted):
    """`sync_every`: the host reads the rows' counts after a run of steps (a GPU's default), each step's
    width the widest the rows could need. Rows that meet a stop token in a run sit idle till its end and
    are refilled then: every prompt's tokens and per-step acceptance stay those of a look every step,
    and each row's decode seconds still add up to the decode time."""
    target, drafter = pair
    drafter = drafter if drafted else None
    reference = [generate(target, drafter, p, NEW) for p in prompts]
    stops = [reference[0].tokens[9], reference[1].tokens[4]]
    reference = [generate(target, drafter, p, NEW, stop_token_ids=stops) for p in prompts]
    assert {len(run.tokens) for run in reference} != {NEW}  # some rows do stop early, inside a run
    engine = FastEngine(target, drafter, NEW, stop_token_ids=stops, rows=3, sync_every=5)
    runs = engine.generate(prompts)
    assert [run.tokens for run in runs] == [run.tokens for run in reference]
    assert [run.accepted for run in runs] == [run.accepted for run in reference]
    record = engine.describe()
    assert record["sync_every"] == 5 and record["decode_ms_per_step"] == pytest.approx(
        1e3 * engine.timing["decode_s"] / engine.timing["steps"], abs=1e-4
    )
    assert sum(run.decode_seconds for run in runs) == pytest.approx(engine.timing["decode_s"])
    with pytest.raises(ValueError, match="sync_every 0"):
        FastEngine(target, drafter, NEW, sync_every=0)


def test_fast_engine_equals_zlab_dflash_generate(pair, prompts, trained, monkeypatch):
    zlab = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # z-lab times itself with CUDA syncs
    target, drafter = pair
    fast = FastEngine(target, drafter, NEW, rows=2).generate(prompts[:3])
    theirs_drafter = zlab.DFlashDraftModel.from_pretrained(trained["drafter"], dtype=torch.float32).eval()
    for prompt, run in zip(prompts[:3], fast, strict=True):
        theirs = zlab.dflash_generate(
            theirs_drafter,
            target.model,
            prompt,
            NEW,
            None,
            temperature=0.0,
            block_size=drafter.block_size,
            return_stats=True,
        )
        assert list(theirs.acceptance_lengths) == run.accepted
        assert theirs.output_ids[0, theirs.num_input_tokens :].tolist() == run.tokens


def test_dflash2_drafter_on_the_fast_engine_equals_the_eager_loop(pair, prompts):
    target, drafter = pair
    dflash2 = dflash2_from(drafter, target)
    eager = [generate(target, dflash2, p, NEW) for p in prompts]
    assert max(max(run.accepted) for run in eager) >= 3
    for rows in (1, 3):
        fast = FastEngine(target, dflash2, NEW, rows=rows).generate(prompts)
        assert [run.tokens for run in fast] == [run.tokens for run in eager]
        assert [run.accepted for run in fast] == [run.accepted for run in eager]
    assert "DFlash2" in unsupported_reason(target, dflash2, 0.7)  # its sampled walk stays eager


def _eval_report(trained, prompts_file, out, *extra: str) -> dict:
    argv = ["eval", "--target", str(trained["target"]), "--drafter", str(trained["drafter"])]
    argv += ["--prompts", str(prompts_file), "--max-new-tokens", str(NEW), "--device", "cpu"]
    assert main([*argv, "--check-lossless", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_eval_on_the_fast_engine_in_batches_reports_the_eager_tau(trained, prompts, tmp_path):
    """`eval --engine fast --batch-size 3`: the same τ, histogram and outputs as the eager loop (fp32), its
    plain baseline through the same engine, and the decoder named in the report."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"input_ids": p[0].tolist()}) + "\n" for p in prompts))
    eager = _eval_report(trained, prompts_file, tmp_path / "eager.json", "--engine", "eager")
    fast = _eval_report(
        trained, prompts_file, tmp_path / "fast.json", "--engine", "fast", "--batch-size", "3"
    )
    for key in ("tau", "tau_pooled", "accepted_length_histogram", "acceptance_by_position", "output_tokens"):
        assert fast[key] == eager[key], key
    assert fast["lossless"]["identical"] == len(prompts)
    assert eager["decoder"] == {"engine": "eager", "batch_size": 1}
    assert fast["decoder"]["engine"] == "fast" and fast["decoder"]["batch_size"] == 3
    assert fast["decoder"]["speculative"]["rows"] == 3 and fast["decoder"]["plain"]["block_size"] == 1


def test_sampled_eval_on_the_fast_engine_writes_what_the_eager_loop_writes(trained, prompts, tmp_path):
    """At T > 0 every prompt draws from its own seeded stream (seed + i) on either engine, so
    `--engine fast --batch-size 3` reports the eager loop's outputs and τ, and decodes on the fast engine."""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"input_ids": p[0].tolist()}) + "\n" for p in prompts[:4]))
    argv = ["eval", "--target", str(trained["target"]), "--drafter", str(trained["drafter"])]
    argv += ["--prompts", str(prompts_file), "--max-new-tokens", "24", "--device", "cpu"]
    argv += ["--temperature", "0.8", "--top-k", "40", "--seed", "5"]
    reports = {}
    for engine, extra in (("eager", []), ("fast", ["--batch-size", "3"])):
        out = tmp_path / f"{engine}.json"
        assert main([*argv, "--engine", engine, *extra, "--out", str(out)]) == 0
        reports[engine] = json.loads(out.read_text())
    assert reports["fast"]["decoder"]["engine"] == "fast"
    for key in ("tau", "accepted_length_histogram", "output_tokens"):
        assert reports["fast"][key] == reports["eager"][key], key


def test_batch_size_on_the_eager_loop_is_one_line(trained, tmp_path, capsys):
    argv = ["eval", "--target", str(trained["target"]), "--drafter", str(trained["drafter"])]
    assert (
        main([*argv, "--prompts", str(tmp_path / "p.jsonl"), "--engine", "eager", "--batch-size", "4"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashdraft: error: --batch-size 4") and "--engine fast" in err and "\n" not in err


def test_the_default_engine_is_eager_at_batch_one_on_the_cpu_and_fast_for_batches(trained, prompts, tmp_path):
    """`--engine auto` (the default): on the CPU at batch 1 the eager loop, the reference; with
    `--batch-size N` the fast engine, with the same τ. (On a GPU auto takes the fast engine: the gpu test.)"""
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"input_ids": p[0].tolist()}) + "\n" for p in prompts))
    single = _eval_report(trained, prompts_file, tmp_path / "single.json")
    batched = _eval_report(trained, prompts_file, tmp_path / "batched.json", "--batch-size", "2")
    assert single["decoder"] == {"engine": "eager", "batch_size": 1}
    assert batched["decoder"]["engine"] == "fast" and batched["decoder"]["batch_size"] == 2
    assert batched["tau"] == single["tau"] and batched["output_tokens"] == single["output_tokens"]
