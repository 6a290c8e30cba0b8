"""`flashdraft eval`: real speculative decoding over a prompt file, against plain decoding of the same
target through the same code (block size 1), with an optional losslessness check that tells numerical
ties apart from real divergences, and optionally z-lab's own loop run beside ours (docs/export-and-eval.md)."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from flashdraft.config import EVAL_ENGINES, EvalSettings  # EvalSettings: importable from here too
from flashdraft.config import check_eval_settings as _check_settings
from flashdraft.cpu_threads import configure_threads
from flashdraft.data.chat import conversation_prompt_ids, normalise
from flashdraft.data.sources import read_records
from flashdraft.data.stops import target_stop_ids
from flashdraft.devices import resolve_device
from flashdraft.durable import disk_full_reason
from flashdraft.errors import FlashdraftError
from flashdraft.generate.fast import FastEngine, unsupported_reason
from flashdraft.generate.speculative import Generation, generate
from flashdraft.infer.report import (
    PRODUCER,
    acceptance_report,
    check_plot_path,
    plot,
    plot_is_ours,
    simulated_tau,
    tokens_per_second,
    write_json,
)
from flashdraft.model.attention import decoding_attention_kernels
from flashdraft.model.drafter_dir import load_drafter
from flashdraft.model.spec import ARCHITECTURES
from flashdraft.model.target import TargetModel, default_dtype, load_target_config, load_target_tokenizer
from flashdraft.outputs import check_output_file
from flashdraft.progress import phase, track

ENGINES = EVAL_ENGINES
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# A divergence is a numerical tie when the two tokens' target logits differ by at most this many units in
# the last place of the dtype the target ran in, at their magnitude (docs/export-and-eval.md).
TIE_ULPS = 4


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing of `dtype`'s representable numbers at |value| (bf16: 2^-7 of the value's power of two)."""
    info = torch.finfo(dtype)
    magnitude = abs(value)
    if magnitude < info.tiny:
        return info.tiny * info.eps
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def tie_tolerance(plain_logit: float, speculative_logit: float, dtype: torch.dtype) -> float:
    return TIE_ULPS * ulp(max(abs(plain_logit), abs(speculative_logit)), dtype)


def first_divergence(
    target: TargetModel, prompt: torch.Tensor, reference: list[int], other: list[int]
) -> dict[str, Any] | None:
    """Where two greedy outputs part, re-scored by one plain target forward over the common prefix: the
    two tokens' logits, their gap, the top-1 minus top-2 margin, and whether the gap is a numerical tie
    at the target's dtype (`tie_tolerance`). None when the outputs are identical."""
    n = min(len(reference), len(other))
    i = next((k for k in range(n) if reference[k] != other[k]), None)
    if i is None:
        if len(reference) == len(other):
            return None
        # One output stops early with equal tokens so far: not a logit flip, so never a tie.
        return {
            "position": n,
            "plain_token": reference[n] if n < len(reference) else None,
            "speculative_token": other[n] if n < len(other) else None,
            "logit_margin": None,
            "logit_gap": None,
            "tie": False,
            "dtype": str(target.dtype).removeprefix("torch."),
        }
    with torch.no_grad():
        ids = torch.cat(
            [prompt.to(target.device), torch.tensor([reference[:i]], dtype=torch.long, device=target.device)],
            1,
        )
        logits = target.model(ids).logits[0, -1].float()
    top2 = torch.topk(logits, 2).values
    plain_logit, spec_logit = float(logits[reference[i]]), float(logits[other[i]])
    gap = abs(plain_logit - spec_logit)
    tolerance = tie_tolerance(plain_logit, spec_logit, target.dtype)
    return {
        "position": i,
        "plain_token": reference[i],
        "speculative_token": other[i],
        "logit_margin": float(top2[0] - top2[1]),
        "plain_logit": plain_logit,
        "speculative_logit": spec_logit,
        "logit_gap": gap,
        "tie_tolerance": tolerance,
        "tie": gap <= tolerance,
        "dtype": str(target.dtype).removeprefix("torch."),
    }


def encode_prompts(
    prompts: str, tokenizer, thinking: str | None, vocab_size: int, max_prompts: int = 0
) -> list[torch.Tensor]:
    """Every prompt as a [1, n] id tensor; an empty prompt or an id outside the target's vocabulary is an
    error naming the prompt file and line (it would otherwise fail deep inside the embedding)."""
    records = read_records(prompts)
    if max_prompts:
        records = records[:max_prompts]
    if not records:
        raise FlashdraftError(f"--prompts {prompts}: no prompts")
    encoded = []
    for record, where in records:
        ids = conversation_prompt_ids(normalise(record, where), tokenizer, thinking)
        if not ids:
            raise FlashdraftError(f"{where}: the prompt has no tokens")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise FlashdraftError(
                f"{where}: token id {bad[0]} is outside the target vocabulary (0..{vocab_size - 1})"
            )
        encoded.append(torch.tensor([ids]))
    return encoded


def _report_is_ours(path: Path) -> bool:
    try:
        return json.loads(path.read_bytes()).get("producer") == PRODUCER
    except (OSError, ValueError, AttributeError):
        return False


@dataclass
class _EvalState:
    """One eval's inputs and decisions, filled in by its steps. The models stay outside it: the fp32
    recheck frees them before it loads its own copies."""

    target_dir: str
    drafter_dir: str
    prompts: str
    settings: EvalSettings
    device: torch.device
    dtype: torch.dtype
    target_config: Any = None
    encoded: list[torch.Tensor] = field(default_factory=list)
    block: int = 0
    stop_ids: list[int] = field(default_factory=list)
    decoder: dict[str, Any] = field(default_factory=dict)  # `_decoder_record`
    reused: bool = False  # plain decoding taken from the caller's `plain_runs`
    fast_spec: list[Generation] = field(default_factory=list)  # the fast engine decodes every prompt up front
    fast_plain: list[Generation] = field(default_factory=list)


def _check_outputs(inputs: dict[str, str], out: str | None, plot_path: str | None, force: bool) -> None:
    """--out and --plot are checked before a model loads: each overwritten only when flashdraft eval
    wrote it (or with `force`), never an input, and never the same file."""
    if out:
        check_output_file(out, "--out", force=force, inputs=inputs, ours=_report_is_ours)
    if plot_path:
        check_plot_path(plot_path)
        check_output_file(plot_path, "--plot", force=force, inputs=inputs, ours=plot_is_ours)
    if out and plot_path and Path(out).resolve() == Path(plot_path).resolve():
        raise FlashdraftError(f"--out and --plot are the same file {out}")


def _load(state: _EvalState) -> tuple[Any, TargetModel]:
    """The target's config and tokenizer, the encoded prompts, then the drafter and the target; fills in
    the state's prompts, block size and stop rule. Returns (drafter, target)."""
    settings, target_path = state.settings, Path(state.target_dir)
    with phase(f"loading the target {state.target_dir} and the drafter {state.drafter_dir}"):
        state.target_config = load_target_config(target_path)
        tokenizer = load_target_tokenizer(target_path)
        state.encoded = encode_prompts(
            state.prompts,
            tokenizer,
            settings.thinking,
            int(state.target_config.vocab_size),
            settings.max_prompts,
        )
        drafter = load_drafter(
            state.drafter_dir, target=state.target_config, device=state.device, dtype=state.dtype
        )
        target = TargetModel.load(
            target_path, drafter.spec.target_layer_ids, device=state.device, dtype=state.dtype
        )
    state.block = settings.block_size or drafter.block_size
    # the stop rule regeneration uses: a target whose generation config lists several eos ids ends its turn
    # at any of them, not only at the tokenizer's eos
    state.stop_ids = target_stop_ids(target_path, tokenizer, settings.thinking, required=False)
    return drafter, target


def _decode(
    state: _EvalState, target: TargetModel, drafter, prompt: torch.Tensor, index: int = 0
) -> Generation:
    """Prompt `index` decoded by the eager loop: speculative with `drafter`, plain with None; seeded
    `sampling.seed + index`, so its tokens do not depend on the other prompts."""
    sampling = state.settings.sampling
    return generate(
        target,
        drafter,
        prompt,
        sampling.max_new_tokens,
        block_size=state.block,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop_token_ids=state.stop_ids,
        generator=torch.Generator(device=state.device).manual_seed(sampling.seed + index),
    )


def _decode_up_front(state: _EvalState, target: TargetModel, drafter) -> None:
    """The fast engine decodes every prompt now, `batch_size` rows at a time; the eager loop warms up
    (kernels, allocator) on the first prompt instead, excluded from the numbers."""
    if state.decoder["engine"] == "fast":
        state.fast_spec, state.fast_plain = _fast_runs(
            state.encoded,
            state.settings,
            target,
            drafter,
            state.block,
            state.stop_ids,
            state.decoder,
            plain=not state.reused,
        )
        return
    with phase("warming up on the first prompt (not counted)"):
        _decode(state, target, drafter, state.encoded[0])
        if not state.reused:
            _decode(state, target, None, state.encoded[0])


def _described(report: dict[str, Any], state: _EvalState) -> dict[str, Any]:
    """`report` with what produced it: the decoder, the inputs, the device, dtype and settings."""
    report.update(
        {
            "plain_decoding": "reused from an earlier greedy eval of the same prompts"
            if state.reused
            else "run",
            "decoder": state.decoder,
            "target": str(state.target_dir),
            "drafter": str(state.drafter_dir),
            "prompts_file": str(state.prompts),
            "device": torch.cuda.get_device_name(state.device) if state.device.type == "cuda" else "cpu",
            "dtype": str(state.dtype).removeprefix("torch."),
            "settings": asdict(state.settings),
            "producer": PRODUCER,
        }
    )
    return report


def _decode_prompts(
    state: _EvalState,
    target: TargetModel,
    drafter,
    plain_runs: list[Generation] | None,
    out: str | None,
    console: Console,
) -> tuple[list[Generation], list[Generation], list[dict[str, Any]]]:
    """Every prompt's speculative and plain run (decoded here by the eager loop, or taken from the fast
    engine's up-front runs or the reused plain runs), a line each, the first divergence of each when the
    lossless check is on, and the --out report rewritten with `"complete": false` after each prompt.
    Returns (speculative runs, plain runs, divergences)."""
    encoded, block = state.encoded, state.block
    spec, plain, divergences = [], [], []
    with track("evaluating", len(encoded), unit="prompt") as bar:
        for i, prompt in enumerate(encoded):
            fast = state.decoder["engine"] == "fast"  # the fast engine decoded every prompt up front
            spec_run = state.fast_spec[i] if fast else _decode(state, target, drafter, prompt, i)
            plain_run = (
                plain_runs[i]
                if state.reused
                else state.fast_plain[i]
                if fast
                else _decode(state, target, None, prompt, i)
            )
            spec.append(spec_run)
            plain.append(plain_run)
            console.print(
                f"prompt {i + 1}/{len(encoded)}: {len(spec_run.tokens)} tokens, τ {spec_run.tau:.2f}, "
                f"{tokens_per_second([spec_run]):.1f} tok/s speculative vs {tokens_per_second([plain_run]):.1f} plain",
                highlight=False,
            )
            if state.settings.check_lossless:
                diff = first_divergence(target, prompt, plain_run.tokens, spec_run.tokens)
                if diff is not None:
                    divergences.append({"prompt": i, **diff})
            partial = _described(acceptance_report(spec, plain, block), state)
            bar.advance(tokens=len(spec_run.tokens), tau=partial["tau"])
            if out:
                partial.update({"complete": False, "prompts_total": len(encoded), "divergences": divergences})
                _write_report(partial, out)
    return spec, plain, divergences


def _recheck_divergences_in_fp32(state: _EvalState, divergences: list[dict[str, Any]]) -> None:
    """Each divergence's prompt decoded again, plain and speculative, by fp32 copies of target and drafter
    (the caller has dropped its own); the result goes into the divergence as `fp32`."""
    if state.device.type == "cuda":
        torch.cuda.empty_cache()
    drafter = load_drafter(
        state.drafter_dir, target=state.target_config, device=state.device, dtype=torch.float32
    )
    target = TargetModel.load(
        Path(state.target_dir), drafter.spec.target_layer_ids, device=state.device, dtype=torch.float32
    )
    for d in divergences:
        d["fp32"] = recheck_fp32(
            target, drafter, state.encoded[d["prompt"]], d, state.settings, state.block, state.stop_ids
        )


def _summary_table(report: dict[str, Any], state: _EvalState, simulated: dict[str, Any] | None) -> Table:
    """The console's summary of the report."""
    settings, prompts = state.settings, len(state.encoded)
    table = Table(
        title=f"flashdraft eval: {prompts} prompts, block {state.block}, T={settings.sampling.temperature}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("τ (per-prompt mean of accepted + 1, z-lab)", f"{report['tau']:.3f}")
    table.add_row("τ pooled over all steps", f"{report['tau_pooled']:.3f}")
    if simulated is not None:
        table.add_row(f"simulated τ, held-out (training step {simulated['step']})", f"{simulated['tau']:.3f}")
    if "zlab" in report:
        z = report["zlab"]
        table.add_row("τ of z-lab's dflash_generate (same prompts)", f"{z['tau']:.3f}")
        table.add_row("prompts with step-identical acceptance (z-lab)", f"{z['identical_steps']} / {prompts}")
        shared = z["shared_text"]
        table.add_row(
            f"τ on the {shared['tokens']} tokens both wrote alike (ours / z-lab)",
            f"{shared['tau_flashdraft']:.3f} / {shared['tau_zlab']:.3f}",
        )
    decoder = state.decoder
    table.add_row("decoder", f"{decoder['engine']}, batch {decoder['batch_size']}")
    table.add_row("speculative tokens/s", f"{report['tokens_per_s']:.1f}")
    table.add_row("plain tokens/s (same code, B=1)", f"{report['baseline_tokens_per_s']:.1f}")
    table.add_row("speedup", f"{report['speedup']:.2f}x")
    rates = " ".join(f"{r:.2f}" for r in report["acceptance_by_position"])
    table.add_row("acceptance by position 1..B-1", rates)
    if settings.check_lossless:
        lossless = report["lossless"]
        table.add_row(
            "lossless (identical / numerical ties / real divergences)",
            f"{lossless['identical']} / {len(lossless['numerical_ties'])} / {len(lossless['diverged'])}",
        )
    return table


def _write_plot(report: dict[str, Any], plot_path: str) -> None:
    """The --plot image; a write that fails is one line naming the file and why."""
    try:
        plot(report, plot_path)
    except OSError as exc:
        reason = disk_full_reason(exc, Path(plot_path).parent) or exc.strerror or str(exc)
        raise FlashdraftError(f"cannot write the report {plot_path}: {reason}") from None


def run_eval(
    target_dir: str,
    drafter_dir: str,
    prompts: str,
    settings: EvalSettings,
    *,
    device: str = "auto",
    out: str | None = None,
    plot_path: str | None = None,
    console: Console | None = None,
    force: bool = False,
    plain_runs: dict[str, list[Generation]] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Outputs, device and prompts are all checked before a model loads (docs/inputs-and-outputs.md): an
    existing --out / --plot is overwritten only when flashdraft eval wrote it, or with `force`.

    `plain_runs`: plain decoding of these prompts by earlier greedy calls with the same target, prompts
    and settings (`bench quality` evaluates several checkpoints of one drafter), by decoding loop (eager,
    fast): a loop's list, empty, is filled; filled, its outputs and timings stand in for plain decoding,
    which greedy makes identical and which no drafter changes. Keyed by loop because the speedup must
    compare one loop with itself. Sampled decoding ignores it: there every run draws its own seeded stream.

    Sampled, prompt i's speculative and plain runs each draw from a generator seeded with
    `sampling.seed + i`, on either engine, so a prompt's tokens do not depend on the other prompts or the
    batch, and `--engine fast` writes what `--engine eager` writes.

    `threads`: CPU threads (`--threads`); None: from the free cores (flashdraft/cpu_threads.py). The --out
    report is rewritten after every prompt with `"complete": false` (a killed eval keeps what it measured)
    and a last time, whole, with `"complete": true`."""
    console = console or Console()
    _check_settings(settings)
    _check_outputs(
        {"--target": target_dir, "--drafter": drafter_dir, "--prompts": prompts}, out, plot_path, force
    )
    dev = resolve_device(device)
    configure_threads(threads, str(dev))
    dtype = DTYPES.get(settings.dtype) or default_dtype(dev)
    state = _EvalState(target_dir, drafter_dir, prompts, settings, dev, dtype)
    drafter, target = _load(state)
    state.decoder = _decoder_record(settings, target, drafter)
    reuse = plain_runs is not None and settings.sampling.temperature == 0
    same_loop = plain_runs.setdefault(state.decoder["engine"], []) if reuse else None
    state.reused = reuse and len(same_loop) == len(state.encoded)
    if "note" in state.decoder:
        console.print(f"note: {state.decoder['note']}", highlight=False)
    _decode_up_front(state, target, drafter)
    spec, plain, divergences = _decode_prompts(state, target, drafter, same_loop, out, console)
    if reuse and not state.reused:
        same_loop[:] = plain
    report = _described(acceptance_report(spec, plain, state.block), state)
    simulated = simulated_tau(drafter_dir)
    if simulated is not None:  # training's teacher-forced estimate of the same checkpoint, to compare
        report["simulated"] = simulated
    if settings.engine == "zlab":
        report["zlab"] = zlab_comparison(
            drafter_dir,
            target,
            state.encoded,
            spec,
            settings,
            state.block,
            state.stop_ids,
            dtype,
            console,
            arch=drafter.spec.arch,
        )
    if settings.check_lossless == "fp32" and divergences and dtype != torch.float32:
        del drafter, target  # the timed runs are done: make room for the fp32 copies
        _recheck_divergences_in_fp32(state, divergences)
    if settings.check_lossless:
        report["lossless"] = lossless_summary(len(state.encoded), divergences)
    console.print(_summary_table(report, state, simulated))
    for d in divergences:
        console.print(_divergence_line(d), highlight=False, soft_wrap=True)
    report["complete"] = True
    if out:
        _write_report(report, out)
    if plot_path:
        _write_plot(report, plot_path)
    return report


def _decoder_record(settings: EvalSettings, target: TargetModel, drafter) -> dict[str, Any]:
    """Which loop decodes (`--engine fast` falls back to the eager loop, saying why, for what the fast
    engine cannot decode) and with how many rows. `auto` (the default) takes the fast engine where it
    pays: on a GPU, where the eager loop is host-bound (docs/decoding.md), or for batched rows; on the CPU
    at batch 1 the eager loop, the reference, is as fast."""
    engine = settings.engine
    if engine == "auto":
        on_gpu = next(target.model.parameters()).device.type == "cuda"
        wanted = on_gpu or settings.batch_size > 1
        reason = unsupported_reason(target, drafter, settings.sampling.temperature) if wanted else None
        engine = "fast" if wanted and (reason is None or settings.batch_size > 1) else "eager"
        if wanted and reason is not None and engine == "eager":
            return {
                "engine": "eager",
                "batch_size": 1,
                "note": f"the fast engine cannot decode this ({reason}): ran eager",
            }
    if engine != "fast":
        return {"engine": "eager", "batch_size": 1}
    reason = unsupported_reason(target, drafter, settings.sampling.temperature)
    if reason is None:
        return {"engine": "fast", "batch_size": settings.batch_size}
    if settings.batch_size > 1:
        raise FlashdraftError(
            f"--batch-size {settings.batch_size}: the fast engine cannot decode this ({reason})"
        )
    return {
        "engine": "eager",
        "batch_size": 1,
        "note": f"--engine fast cannot decode this ({reason}): ran eager",
    }


def _fast_runs(
    encoded: list[torch.Tensor],
    settings: EvalSettings,
    target: TargetModel,
    drafter,
    block: int,
    stop_ids: list[int],
    decoder: dict[str, Any],
    plain: bool,
) -> tuple[list[Generation], list[Generation]]:
    """Speculative and (when `plain`) plain decoding of every prompt on the fast engine, the plain one
    block size 1 through the same engine; each warmed up (and its CUDA graphs captured) on the first
    prompt before the timed runs. The engines' records go into `decoder`."""
    s = settings.sampling
    new, rows = s.max_new_tokens, settings.batch_size
    common = {"stop_token_ids": stop_ids, "rows": rows, "temperature": s.temperature}
    common["compile"] = False if settings.no_compile else None  # None: compiled where graphs are
    common.update(top_p=s.top_p, top_k=s.top_k)
    spec_engine = FastEngine(target, drafter, new, block_size=block, **common)
    plain_engine = FastEngine(target, None, new, **common)
    seeds = [s.seed + i for i in range(len(encoded))]  # as the eager runs are seeded
    spec_engine.generate(encoded[:1], seeds[:1])
    spec = spec_engine.generate(encoded, seeds)
    decoder["speculative"] = spec_engine.describe()
    if not plain:
        return spec, []
    plain_engine.generate(encoded[:1], seeds[:1])
    plain_runs = plain_engine.generate(encoded, seeds)
    decoder["plain"] = plain_engine.describe()
    return spec, plain_runs


def _write_report(report: dict[str, Any], out: str | Path) -> None:
    """The --out JSON, replaced atomically (a reader sees the last whole report, never half of one)."""
    try:
        write_json(report, out)
    except OSError as exc:
        reason = disk_full_reason(exc, Path(out).parent) or exc.strerror or str(exc)
        raise FlashdraftError(f"cannot write the report {out}: {reason}") from None


def _is_tie(divergence: dict[str, Any]) -> bool:
    """The fp32 rerun decides when there is one: identical fp32 outputs, or an fp32 divergence that is
    itself a tie at fp32 resolution; otherwise the tie test at the eval's dtype."""
    fp32 = divergence.get("fp32")
    if fp32 is not None:
        return fp32["identical"] or bool(fp32["divergence"]["tie"])
    return bool(divergence["tie"])


def lossless_summary(prompts: int, divergences: list[dict[str, Any]]) -> dict[str, Any]:
    ties = [d for d in divergences if _is_tie(d)]
    return {
        "identical": prompts - len(divergences),
        "numerical_ties": ties,
        "diverged": [d for d in divergences if not _is_tie(d)],
        "tie_rule": f"|logit(plain token) - logit(speculative token)| <= {TIE_ULPS} ulp of the target's "
        "dtype at their magnitude, at the first differing token; an fp32 rerun, when made, decides",
    }


def _divergence_line(d: dict[str, Any]) -> str:
    kind = "numerical tie" if _is_tie(d) else "DIVERGED"
    line = (
        f"{kind}: prompt {d['prompt']} at token {d['position']}: plain {d['plain_token']} vs "
        f"speculative {d['speculative_token']}"
    )
    if d.get("logit_gap") is not None:
        line += (
            f" (target logits {d['plain_logit']:.4g} vs {d['speculative_logit']:.4g} in {d['dtype']}: gap "
            f"{d['logit_gap']:.3g}, tie tolerance {d['tie_tolerance']:.3g})"
        )
    if "fp32" in d:
        line += "; fp32 rerun: " + (
            "identical outputs"
            if d["fp32"]["identical"]
            else f"differs at token {d['fp32']['divergence']['position']}"
        )
    return line


def recheck_fp32(
    target: TargetModel,
    drafter,
    prompt: torch.Tensor,
    divergence: dict[str, Any],
    settings: EvalSettings,
    block: int,
    stop_ids: list[int],
) -> dict[str, Any]:
    """Rerun plain and speculative greedy decoding of one prompt with target and drafter in fp32."""
    plain = generate(target, None, prompt, settings.sampling.max_new_tokens, stop_token_ids=stop_ids)
    spec = generate(
        target, drafter, prompt, settings.sampling.max_new_tokens, block_size=block, stop_token_ids=stop_ids
    )
    return {
        "identical": plain.tokens == spec.tokens,
        "divergence": first_divergence(target, prompt, plain.tokens, spec.tokens),
    }


@contextlib.contextmanager
def _zlab_timer_off_cuda(zlab_model, device: torch.device) -> Iterator[None]:
    """z-lab's loop times itself with torch.cuda.synchronize, which fails without a GPU: use the plain clock."""
    if device.type == "cuda":
        yield
        return
    saved = zlab_model._cuda_time
    zlab_model._cuda_time = time.perf_counter
    try:
        yield
    finally:
        zlab_model._cuda_time = saved


def shared_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def steps_within(accepted: list[int], length: int) -> list[int]:
    """The acceptance lengths of the decode steps that committed only tokens among the first `length` of
    the output (token 0 comes from the prefill; step k commits the next `accepted[k]` tokens)."""
    kept, committed = [], 1
    for produced in accepted:
        committed += produced
        if committed > length:
            break
        kept.append(produced)
    return kept


def tau_on_shared_text(runs: list[tuple[list[int], list[int], list[int], list[int]]]) -> dict[str, Any]:
    """τ of two decoding loops measured only where both wrote the same text: per prompt (tokens_a,
    accepted_a, tokens_b, accepted_b), the steps that lie inside the outputs' common prefix. Equal τ here
    and different τ overall means the loops agree and their texts parted at a numerical tie (bf16); a
    difference here is a systematic difference in drafting or verifying (docs/export-and-eval.md)."""
    steps_a, steps_b, shared = [], [], 0
    for tokens_a, accepted_a, tokens_b, accepted_b in runs:
        length = shared_prefix_length(tokens_a, tokens_b)
        shared += length
        steps_a += steps_within(accepted_a, length)
        steps_b += steps_within(accepted_b, length)
    return {
        "shared_tokens": shared,
        "tau_a": sum(steps_a) / len(steps_a) if steps_a else float("nan"),
        "tau_b": sum(steps_b) / len(steps_b) if steps_b else float("nan"),
        "steps_a": len(steps_a),
        "steps_b": len(steps_b),
    }


def _first_step_differences(ours: list[Generation], runs: list) -> tuple[list[dict[str, Any]], int]:
    """Per prompt whose per-step acceptance lengths differ between our loop and z-lab's: the first step
    where they do and each side's length there; and how many prompts got identical tokens."""
    differences = []
    same_tokens = 0
    for i, (mine, theirs) in enumerate(zip(ours, runs, strict=True)):
        lengths = list(theirs.acceptance_lengths)
        same_tokens += theirs.output_ids[0, theirs.num_input_tokens :].tolist() == mine.tokens
        if lengths != mine.accepted:
            step = next(
                (k for k, (a, b) in enumerate(zip(mine.accepted, lengths, strict=False)) if a != b),
                min(len(lengths), len(mine.accepted)),
            )
            differences.append(
                {
                    "prompt": i,
                    "step": step,
                    "flashdraft": mine.accepted[step] if step < len(mine.accepted) else None,
                    "zlab": lengths[step] if step < len(lengths) else None,
                }
            )
    return differences, same_tokens


def zlab_comparison(
    drafter_dir: str,
    target: TargetModel,
    encoded: list[torch.Tensor],
    ours: list[Generation],
    settings: EvalSettings,
    block: int,
    stop_ids: list[int],
    dtype: torch.dtype,
    console: Console,
    arch: str = "dflash",
) -> dict[str, Any]:
    """Run z-lab's `dflash_generate` (package dflash) with its own loading of the drafter (its class for
    `arch`: DFlashDraftModel or DFlash2DraftModel) on the same target and prompts; its τ beside ours, and
    where the per-step acceptance lengths first differ."""
    import dflash.model as zlab_model

    zlab_class = getattr(zlab_model, ARCHITECTURES[arch])
    zdrafter = zlab_class.from_pretrained(drafter_dir, dtype=dtype).to(target.device).eval()
    torch.manual_seed(settings.sampling.seed)  # z-lab samples from the global generator at T > 0

    def run(prompt: torch.Tensor):
        return zlab_model.dflash_generate(
            zdrafter,
            target.model,
            prompt.to(target.device),
            settings.sampling.max_new_tokens,
            stop_ids or None,
            temperature=settings.sampling.temperature,
            top_p=settings.sampling.top_p,
            top_k=settings.sampling.top_k,
            block_size=block,
            return_stats=True,
        )

    runs = []
    # the same SDPA kernels as our loop (no cuDNN): otherwise the H200 runs z-lab's target and drafter
    # through cuDNN attention and ours through flash/efficient kernels, and the two texts part at the
    # first bf16 tie for a reason that is neither loop's (docs/export-and-eval.md)
    with _zlab_timer_off_cuda(zlab_model, target.device), decoding_attention_kernels():
        run(encoded[0])  # warm-up, as for ours
        for prompt in encoded:
            runs.append(run(prompt))
    differences, same_tokens = _first_step_differences(ours, runs)
    shared = tau_on_shared_text(
        [
            (
                mine.tokens,
                mine.accepted,
                r.output_ids[0, r.num_input_tokens :].tolist(),
                list(r.acceptance_lengths),
            )
            for mine, r in zip(ours, runs, strict=True)
        ]
    )
    taus = [sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in runs if r.acceptance_lengths]
    steps = [a for r in runs for a in r.acceptance_lengths]
    seconds = sum(r.time_per_output_token * r.num_output_tokens for r in runs)
    result = {
        "drafter_class": zlab_class.__name__,
        "tau": statistics.mean(taus) if taus else float("nan"),
        "tau_pooled": sum(steps) / len(steps) if steps else float("nan"),
        "tokens_per_s": sum(r.num_output_tokens for r in runs) / seconds if seconds > 0 else float("nan"),
        "identical_steps": len(encoded) - len(differences),
        "identical_tokens": int(same_tokens),
        "first_step_differences": differences,
        "acceptance_lengths": [list(r.acceptance_lengths) for r in runs],
        "shared_text": {
            "tokens": shared["shared_tokens"],
            "tau_flashdraft": shared["tau_a"],
            "tau_zlab": shared["tau_b"],
            "steps_flashdraft": shared["steps_a"],
            "steps_zlab": shared["steps_b"],
        },
    }
    console.print(
        f"z-lab dflash_generate: τ {result['tau']:.3f} (ours {statistics.mean(r.tau for r in ours):.3f}); "
        f"per-step acceptance identical on {result['identical_steps']}/{len(encoded)} prompts; "
        f"on the {shared['shared_tokens']} tokens both wrote alike: τ {shared['tau_b']:.3f} z-lab, "
        f"{shared['tau_a']:.3f} ours",
        highlight=False,
    )
    return result
