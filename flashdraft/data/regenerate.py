"""Regeneration: every assistant turn replaced by the target's own continuation of the conversation so far
(DFlash drafters are trained on target-generated responses, ../shared/reference/dflash.md §3.1).

Two engines: `LocalEngine` generates in-process with the target (length-sorted batches; static KV cache
and compiled decoding on a GPU), `ServerEngine` asks any OpenAI-compatible server the user already runs
(SGLang, vLLM) with concurrent requests. Progress is a JSONL journal: each finished conversation is
appended and flushed as one line, so a crash or Ctrl-C keeps every finished sample, and a restart skips
them (a torn last line is ignored).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashdraft.errors import FlashdraftError


@dataclass
class Sampling:
    max_new_tokens: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


Messages = list[dict[str, str]]


class ServerEngine:
    """POST /v1/chat/completions to an OpenAI-compatible server, `concurrency` requests in flight."""

    def __init__(
        self,
        url: str,
        model: str | None,
        sampling: Sampling,
        thinking: str | None,
        concurrency: int = 16,
        timeout: float = 600.0,
    ):
        self.url = url.rstrip("/") + (
            "" if url.rstrip("/").endswith("/chat/completions") else "/v1/chat/completions"
        )
        self.model, self.sampling, self.thinking = model, sampling, thinking
        self.concurrency, self.timeout = concurrency, timeout

    def _one(self, messages: Messages) -> str:
        body = {
            "model": self.model or "default",
            "messages": messages,
            "max_tokens": self.sampling.max_new_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "seed": self.sampling.seed,
        }
        if self.sampling.top_k:
            body["top_k"] = self.sampling.top_k
        if self.thinking is not None:  # SGLang and vLLM pass this to the chat template
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking == "on"}
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise FlashdraftError(f"server {self.url}: HTTP {exc.code}: {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, TimeoutError) as exc:
            raise FlashdraftError(f"server {self.url}: {getattr(exc, 'reason', exc)}") from None
        try:
            return reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise FlashdraftError(f"server {self.url}: unexpected reply {str(reply)[:300]}") from None

    def complete(self, conversations: list[Messages]) -> list[str]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, conversations))

    def describe(self) -> dict:
        return {"engine": "server", "url": self.url, "model": self.model, **asdict(self.sampling)}


class LocalEngine:
    """Batched generation with the target in this process, longest prompts first; static cache on GPU."""

    def __init__(self, model, tokenizer, sampling: Sampling, thinking: str | None, batch_size: int = 64):
        self.model, self.tokenizer, self.sampling, self.thinking = model.eval(), tokenizer, sampling, thinking
        self.batch_size = batch_size
        self.on_gpu = next(model.parameters()).device.type == "cuda"

    def _prompt(self, messages: Messages) -> list[int]:
        kwargs = {} if self.thinking is None else {"enable_thinking": self.thinking == "on"}
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def complete(self, conversations: list[Messages]) -> list[str]:
        outputs = self.generate_ids([self._prompt(m) for m in conversations])
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]

    @torch.inference_mode()
    def generate_ids(self, prompts: list[list[int]]) -> list[list[int]]:
        """New token ids per prompt: length-sorted batches, left padding, stop at the end-of-turn token."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        pad = (
            0
            if self.tokenizer is None
            else (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos)
        )
        s = self.sampling
        gen_kwargs = {
            "max_new_tokens": s.max_new_tokens,
            "do_sample": s.temperature > 0,
            "pad_token_id": pad,
            "eos_token_id": eos,
        }
        if s.temperature > 0:
            gen_kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
        if self.on_gpu:
            gen_kwargs["cache_implementation"] = "static"
        device = next(self.model.parameters()).device
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), pad or 0, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):  # left padding: every prompt ends where generation starts
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            torch.manual_seed(s.seed + start)
            generated = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), **gen_kwargs
            )
            for row, i in enumerate(batch):
                new = generated[row, width:].tolist()
                out[i] = new[: new.index(eos) + 1] if eos is not None and eos in new else new
        return out

    def describe(self) -> dict:
        return {
            "engine": "local",
            "batch_size": self.batch_size,
            "static_cache": self.on_gpu,
            **asdict(self.sampling),
        }


def read_journal(path: Path) -> dict[int, Messages]:
    """Finished conversations by input index; a torn last line (a crash mid-write) is dropped."""
    done: dict[int, Messages] = {}
    if not path.exists():
        return done
    with path.open() as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[int(record["index"])] = record["messages"]
    return done


def regenerate(
    items: list[tuple[int, Messages]],
    complete: Callable[[list[Messages]], list[str]],
    journal: Path,
    chunk: int = 256,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[int, Messages]:
    """Regenerate every assistant turn of every conversation, turn by turn (turn k sees the regenerated
    turns before it), `chunk` conversations at a time; finished ones are journaled as they complete."""
    done = read_journal(journal)
    todo = [(i, m) for i, m in items if i not in done]
    journal.parent.mkdir(parents=True, exist_ok=True)
    with journal.open("a") as handle:
        for start in range(0, len(todo), chunk):
            group = todo[start : start + chunk]
            convs = {i: [] for i, _ in group}
            remaining = {i: list(m) for i, m in group}
            while remaining:
                asking = []
                for i, rest in list(remaining.items()):
                    while rest and rest[0]["role"] != "assistant":
                        convs[i].append(rest.pop(0))
                    if rest:
                        asking.append(i)
                    else:
                        del remaining[i]
                if not asking:
                    break
                answers = complete([convs[i] for i in asking])
                for i, answer in zip(asking, answers, strict=True):
                    remaining[i].pop(0)  # the original assistant turn is replaced
                    convs[i].append({"role": "assistant", "content": answer})
            for i, _ in group:
                handle.write(json.dumps({"index": i, "messages": convs[i]}) + "\n")
                done[i] = convs[i]
            handle.flush()
            os.fsync(handle.fileno())
            if on_progress:
                on_progress(len(done), len(items))
    return done
