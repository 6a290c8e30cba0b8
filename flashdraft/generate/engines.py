"""Local generation engines of `prepare --regenerate`: token ids in, new token ids out (docs/regeneration.md).

Four engines share one contract, `generate_ids(prompts, seeds) -> new ids per prompt`, each answer cut
after its first stop token:
- `static`: flashdraft's own decode loop around the model's forward (flashdraft/generate/static.py),
  CUDA graphs on a GPU; the default on GPUs without vllm;
- `hf`: `model.generate` on length-sorted, left-padded batches; on a GPU a static KV cache (which
  transformers compiles into CUDA graphs) and a batch size chosen from free memory;
- `hf-cb`: transformers' continuous batching (`generate_batch`): finished rows are refilled at once;
- `vllm`: vLLM's offline `LLM` engine, when the optional `vllm` package is installed.
Greedy output equals plain `model.generate` token for token. Sampling draws each token from a counter-based
hash of (conversation seed, step, token id), so an answer never depends on which other answers share its
batch, how many workers run, or on which device.

`generate_ids(..., on_answer=f)` calls `f(index, ids)` once per prompt as soon as its answer is known
(`static` and `hf`: when the row stops, mid-batch; `hf-cb` and `vllm`: when the call ends), so progress
moves per answer, not per batch (docs/progress.md).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from flashdraft.config import Sampling
from flashdraft.errors import FlashdraftError
from flashdraft.generate.sampling import seeded_choice
from flashdraft.model.target import text_config

ENGINES = ("auto", "static", "hf", "hf-cb", "vllm")
_PAD_MULTIPLE = 64  # prompt widths are rounded up to this, so compiled static-cache shapes repeat

# on_answer(index of the prompt in the call, its answer's ids): called once per prompt, when it is known
OnAnswer = Callable[[int, list[int]], None]


def report_rest(
    on_answer: OnAnswer | None, out: list[list[int]], reported: set[int], indices: Iterable[int] | None = None
) -> None:
    """Hand `on_answer` the answers of `indices` (default: all) not reported yet: those cut at
    --max-new-tokens, or every answer of an engine that learns them only at the end."""
    if on_answer is not None:
        for index in range(len(out)) if indices is None else indices:
            if index not in reported:
                reported.add(index)
                on_answer(index, out[index])


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def continuous_batching_available(model) -> bool:
    """transformers >= 5 ships `generate_batch`; older versions (or models without it) do not. `model`
    None asks about the installed transformers (before any model is loaded)."""
    if model is None:
        from transformers import GenerationMixin

        model = GenerationMixin
    return callable(getattr(model, "generate_batch", None))


def choose_engine(requested: str, device: torch.device, sampling: Sampling, model=None) -> tuple[str, str]:
    """(engine, why) for `--engine requested` on `device`; asking for one that cannot run is an error."""
    greedy = sampling.temperature == 0
    if requested not in ENGINES:
        raise FlashdraftError(f"--engine {requested!r}: expected one of {', '.join(ENGINES)}")
    if requested == "vllm":
        if not vllm_available():
            raise FlashdraftError("--engine vllm: the vllm package is not installed (pip install vllm)")
        if device.type != "cuda":
            raise FlashdraftError(
                "--engine vllm: needs a CUDA device (--device cuda or auto on a GPU machine)"
            )
        return "vllm", "asked for"
    if requested == "hf-cb":
        if not continuous_batching_available(model):
            raise FlashdraftError(
                "--engine hf-cb: this transformers version has no continuous batching (model.generate_batch)"
            )
        if not greedy:
            raise FlashdraftError(
                "--engine hf-cb: continuous batching samples from one shared random stream, so answers would "
                "depend on batch composition; use it with --temperature 0, or --engine hf to sample"
            )
        return "hf-cb", "asked for"
    if requested in ("hf", "static"):
        return requested, "asked for"
    if device.type == "cuda" and vllm_available():
        return "vllm", "auto: vllm is installed and the device is a GPU"
    if device.type == "cuda":
        # generate's per-step overhead (or, with a static cache, its per-shape compile) and transformers'
        # continuous batching both measured far slower on an H200 (docs/regeneration.md)
        return "static", "auto: GPU without vllm: flashdraft's decode loop with CUDA graphs"
    return "hf", "auto: CPU: batched generate"


def cut_at_stop(ids: Iterable[int], stops: Iterable[int]) -> list[int]:
    """The answer up to and including its first stop token (all of it when none)."""
    stops, out = set(stops), []
    for token in ids:
        out.append(int(token))
        if token in stops:
            break
    return out


class SeededSampler(LogitsProcessor):
    """Sampling inside greedy `generate`: per row, the token the Gumbel-max trick picks from the filtered
    distribution with that row's own counter-based noise; every other logit becomes -inf, so greedy
    selection returns it. The draw never uses a shared random stream."""

    def __init__(self, seeds: list[int], sampling: Sampling, prompt_width: int):
        self.seeds = torch.tensor(seeds, dtype=torch.int64)
        self.sampling, self.prompt_width = sampling, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return seeded_choice(scores, self.seeds, input_ids.shape[1] - self.prompt_width, self.sampling)


def kv_bytes_per_token(config) -> int:
    """Key and value bytes one token occupies in the KV cache across all layers, from the model config."""
    text = text_config(config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = getattr(text, "dtype", None) or torch.bfloat16
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 2
    return 2 * text.num_hidden_layers * heads * head_dim * itemsize


def batch_size_for_memory(
    model, longest: int, device: torch.device, cap: int = 2048, extra_per_row: int = 0
) -> int:
    """Rows whose KV cache (and ~30% headroom for activations and logits) fit in the free GPU memory;
    `extra_per_row`: further bytes a row needs (e.g. sampling's per-step temporaries)."""
    free, _ = torch.cuda.mem_get_info(device)
    text = text_config(model.config)
    per_row = kv_bytes_per_token(model.config) * longest + 8 * text.vocab_size + extra_per_row
    return max(1, min(cap, int(free * 0.7) // max(per_row, 1)))


class AnswerWatch(StoppingCriteria):
    """Stops nothing: after every generated token it hands each row that has just emitted a stop token to
    `on_answer`, so `generate` reports answers as they end, not when the whole batch has. Rows past
    the batch (padding it to a compiled shape) are never reported."""

    def __init__(self, batch: list[int], width: int, stops: list[int], on_answer: OnAnswer, reported: set):
        self.batch, self.width, self.on_answer, self.reported = batch, width, on_answer, reported
        self.stops = torch.tensor(stops or [-1], dtype=torch.long)
        self.open = list(range(len(batch)))  # rows whose answer is not reported yet

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.open and input_ids.shape[1] > self.width:
            last = input_ids[: len(self.batch), -1].cpu()
            ended = torch.isin(last, self.stops).tolist()
            for row in [row for row in self.open if ended[row]]:
                self.open.remove(row)
                self.reported.add(self.batch[row])
                ids = cut_at_stop(input_ids[row, self.width :].tolist(), self.stops.tolist())
                self.on_answer(self.batch[row], ids)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFGenerateEngine:
    """`model.generate` on length-sorted, left-padded batches; static KV cache and CUDA graphs on a GPU."""

    name = "hf"

    def __init__(
        self,
        model,
        sampling: Sampling,
        stops: list[int],
        pad_id: int,
        batch_size: int = 0,
        fixed_shapes: bool | None = None,
    ):
        self.model, self.sampling, self.stops, self.pad_id = model.eval(), sampling, stops, pad_id
        self.device = next(model.parameters()).device
        self.on_gpu = self.device.type == "cuda"
        self.batch_size = batch_size  # 0: from free memory on a GPU, 64 on the CPU
        self.fixed_shapes = self.on_gpu if fixed_shapes is None else fixed_shapes
        self.shapes: list[tuple[int, int]] = []  # (rows, prompt width) already run (compiled on a GPU)

    def _config(self, width: int, seeds: list[int]) -> tuple[GenerationConfig, LogitsProcessorList]:
        config = GenerationConfig(
            max_new_tokens=self.sampling.max_new_tokens,
            do_sample=False,  # sampling, when asked for, is SeededSampler's (batch-independent)
            eos_token_id=self.stops or None,
            pad_token_id=self.pad_id,
        )
        if self.on_gpu:
            config.cache_implementation = "static"
        processors = LogitsProcessorList()
        if self.sampling.temperature > 0:
            processors.append(SeededSampler(seeds, self.sampling, width))
        return config, processors

    def _rows(self, longest: int) -> int:
        if self.batch_size:
            return self.batch_size
        if self.on_gpu:
            return batch_size_for_memory(self.model, longest + self.sampling.max_new_tokens, self.device)
        return 64

    def _shape(self, rows: int, width: int) -> tuple[int, int]:
        """The (rows, prompt width) a batch runs at. With fixed shapes (on a GPU) every new shape compiles
        the static-cache decoder again (about 30 s for a 135M target on an H200, docs/regeneration.md), so a
        shape already compiled that holds the batch, without doubling its rows, is reused."""
        if not self.fixed_shapes:
            return rows, width
        fits = [(r, w) for r, w in self.shapes if rows <= r <= 2 * rows and w >= width]
        if fits:
            return min(fits, key=lambda shape: shape[0] * shape[1])
        shape = (rows, -(-width // _PAD_MULTIPLE) * _PAD_MULTIPLE)
        self.shapes.append(shape)
        return shape

    @torch.inference_mode()
    def generate_ids(
        self, prompts: list[list[int]], seeds: list[int], on_answer: OnAnswer | None = None
    ) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        if not order:
            return out
        reported: set[int] = set()
        cap = self._rows(len(prompts[order[0]]))
        per = -(-len(order) // -(-len(order) // cap))  # even batches: 1000 + 1000, not 1024 + 976
        for start in range(0, len(order), per):
            batch = order[start : start + per]
            rows, width = self._shape(len(batch), len(prompts[batch[0]]))
            # rows beyond the batch repeat its last prompt (their answers are dropped): the shape stays
            filled = batch + [batch[-1]] * (rows - len(batch))
            ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
            mask = torch.zeros(rows, width, dtype=torch.long)
            for row, i in enumerate(filled):  # left padding: every prompt ends where generation starts
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            config, processors = self._config(width, [seeds[i] for i in filled])
            watch = StoppingCriteriaList()
            if on_answer is not None:
                watch.append(AnswerWatch(batch, width, self.stops, on_answer, reported))
            generated = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=watch,
            )
            for row, i in enumerate(generated[: len(batch), width:].tolist()):
                out[batch[row]] = cut_at_stop(i, self.stops)
            report_rest(on_answer, out, reported, batch)
        return out

    def describe(self) -> dict:
        return {"engine": self.name, "batch_size": self.batch_size or "auto", "static_cache": self.on_gpu}


class ContinuousBatchingEngine:
    """transformers' continuous batching: a scheduler refills a row as soon as its answer ends (greedy)."""

    name = "hf-cb"

    def __init__(self, model, sampling: Sampling, stops: list[int], pad_id: int):
        self.model, self.sampling, self.stops, self.pad_id = model.eval(), sampling, stops, pad_id
        self.on_gpu = next(model.parameters()).device.type == "cuda"

    def generate_ids(
        self, prompts: list[list[int]], seeds: list[int], on_answer: OnAnswer | None = None
    ) -> list[list[int]]:
        # no inference_mode here: the scheduler's thread updates tensors made in this one, which an
        # inference-mode tensor forbids outside inference mode (generate_batch manages grad itself)
        config = GenerationConfig(
            max_new_tokens=self.sampling.max_new_tokens,
            do_sample=False,
            eos_token_id=self.stops,
            pad_token_id=self.pad_id,
        )
        kwargs: dict[str, Any] = {"generation_config": config, "warmup": self.on_gpu}
        cb_config = self._cache_config(prompts)
        if cb_config is not None:
            kwargs["continuous_batching_config"] = cb_config
        accepted = inspect.signature(self.model.generate_batch).parameters
        results = self.model.generate_batch(prompts, **{k: v for k, v in kwargs.items() if k in accepted})
        # Requests are named req_<index> in submission order; match by prompt to be independent of it.
        by_index: dict[int, list[int]] = {}
        for name, result in results.items():
            error = getattr(result, "error", None)
            if error:
                raise FlashdraftError(f"--engine hf-cb: request {name} failed: {error}")
            by_index[int(str(name).rsplit("_", 1)[-1])] = list(result.generated_tokens)
        if sorted(by_index) != list(range(len(prompts))):
            raise FlashdraftError(f"--engine hf-cb: {len(by_index)} results for {len(prompts)} prompts")
        out = [cut_at_stop(by_index[i], self.stops) for i in range(len(prompts))]
        report_rest(on_answer, out, set())
        return out

    def _cache_config(self, prompts: list[list[int]]):
        """On a GPU transformers sizes the paged KV cache from free memory; on the CPU it would reserve a
        share of host memory (tens of seconds to set up), so the cache is sized for these prompts."""
        if self.on_gpu:
            return None
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            return None
        page = 16
        tokens = sum(len(p) + self.sampling.max_new_tokens for p in prompts)
        wanted = {"page_size": page, "num_blocks": -(-tokens // page) + len(prompts), "max_batch_tokens": 256}
        accepted = inspect.signature(ContinuousBatchingConfig).parameters
        return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in accepted})

    def describe(self) -> dict:
        return {"engine": self.name}


class VllmEngine:
    """vLLM's offline engine on one GPU, prompts as token ids, each request seeded with its own seed."""

    name = "vllm"

    def __init__(self, target: str, sampling: Sampling, stops: list[int], device: torch.device):
        from vllm import LLM  # optional extra; choose_engine checked it is importable

        self.sampling, self.stops = sampling, stops
        if device.index is not None:  # vLLM takes the first visible GPU: make it this worker's own
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else [str(i) for i in range(device.index + 1)]
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[device.index]
        self.llm = LLM(model=str(target), dtype="bfloat16", seed=sampling.seed)

    def generate_ids(
        self, prompts: list[list[int]], seeds: list[int], on_answer: OnAnswer | None = None
    ) -> list[list[int]]:
        from vllm import SamplingParams

        s = self.sampling
        params = [
            SamplingParams(
                max_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k or -1,
                seed=seed,
                stop_token_ids=self.stops,
                skip_special_tokens=False,
            )
            for seed in seeds
        ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        out = [cut_at_stop(o.outputs[0].token_ids, self.stops) for o in outputs]
        report_rest(on_answer, out, set())
        return out

    def describe(self) -> dict:
        return {"engine": self.name}
