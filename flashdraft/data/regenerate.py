"""Regeneration: every assistant turn replaced by the target's own continuation of the conversation so far
(DFlash drafters are trained on target-generated responses, docs/dflash.md §3).

Two engines: `LocalEngine` generates in-process with the target (length-sorted batches; static KV cache
and compiled decoding on a GPU), `ServerEngine` asks any OpenAI-compatible server the user already runs
(SGLang, vLLM) with concurrent requests. Progress is a JSONL journal: each finished conversation is
appended and flushed as one line, so a crash or Ctrl-C keeps every finished sample, and a restart skips
them (a torn last line is ignored). Each answer is keyed by a hash of its conversation, the sampling
settings and the target (`journal_key`), never by position: a rerun with other input, settings or
target never reuses a stale answer (docs/inputs-and-outputs.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flashdraft.config import Sampling
from flashdraft.data.render import apply_chat_template
from flashdraft.errors import FlashdraftError

Messages = list[dict[str, str]]


# An answer and why it ended, in the OpenAI API's words: "stop" (an end-of-turn token), "length" (cut at
# --max-new-tokens: not a finished answer, docs/inputs-and-outputs.md), or None when an engine does not say.
Answer = tuple[str, str | None]


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

    def _one(self, messages: Messages) -> Answer:
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
            choice = reply["choices"][0]
            return choice["message"]["content"], choice.get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise FlashdraftError(f"server {self.url}: unexpected reply {str(reply)[:300]}") from None

    def complete(self, conversations: list[Messages]) -> list[Answer]:
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
        ids = apply_chat_template(
            self.tokenizer,
            messages,
            self.thinking,
            "regeneration prompt",
            add_generation_prompt=True,
            tokenize=True,
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def complete(self, conversations: list[Messages]) -> list[Answer]:
        outputs = self.generate_ids([self._prompt(m) for m in conversations])
        eos = self.tokenizer.eos_token_id
        return [
            (
                self.tokenizer.decode(ids, skip_special_tokens=True),
                "stop" if ids and ids[-1] == eos else "length",
            )
            for ids in outputs
        ]

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


def journal_key(messages: Messages, occurrence: int, settings: dict[str, Any]) -> str:
    """What an answer depends on: the conversation, which repeat of it this is (identical conversations
    are sampled separately), and `settings` (engine, sampling, thinking switch, target identity)."""
    blob = json.dumps([messages, occurrence, settings], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Regenerated:
    messages: Messages
    finish_reasons: list[str | None]  # one per regenerated assistant turn, in order


def read_journal(path: Path) -> dict[str, Regenerated]:
    """Finished conversations by `journal_key`; a torn last line (a crash mid-write) and lines of an older
    journal format (keyed by position, which cannot be trusted) are dropped."""
    done: dict[str, Regenerated] = {}
    if not path.exists():
        return done
    with path.open("rb") as handle:
        for raw in handle:
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict) and isinstance(record.get("key"), str) and "messages" in record:
                done[record["key"]] = Regenerated(record["messages"], record.get("finish_reasons") or [])
    return done


def regenerate(
    items: list[tuple[str, Messages]],
    complete: Callable[[list[Messages]], list[Answer]],
    journal: Path,
    chunk: int = 256,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Messages]:
    """Regenerate every assistant turn of every (key, conversation), turn by turn (turn k sees the
    regenerated turns before it), `chunk` conversations at a time; finished ones are journaled as they
    complete. Returns the regenerated conversation of every key in `items`, with why each answer ended."""
    done = read_journal(journal)
    wanted = {key for key, _ in items}
    todo = [(key, m) for key, m in items if key not in done]
    journal.parent.mkdir(parents=True, exist_ok=True)
    with journal.open("a") as handle:
        for start in range(0, len(todo), chunk):
            group = todo[start : start + chunk]
            convs: dict[str, Messages] = {key: [] for key, _ in group}
            reasons: dict[str, list[str | None]] = {key: [] for key, _ in group}
            remaining = {key: list(m) for key, m in group}
            while remaining:
                asking = []
                for key, rest in list(remaining.items()):
                    while rest and rest[0]["role"] != "assistant":
                        convs[key].append(rest.pop(0))
                    if rest:
                        asking.append(key)
                    else:
                        del remaining[key]
                if not asking:
                    break
                answers = complete([convs[key] for key in asking])
                for key, (answer, reason) in zip(asking, answers, strict=True):
                    remaining[key].pop(0)  # the original assistant turn is replaced
                    convs[key].append({"role": "assistant", "content": answer})
                    reasons[key].append(reason)
            for key, _ in group:
                record = {"key": key, "messages": convs[key], "finish_reasons": reasons[key]}
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                done[key] = Regenerated(convs[key], reasons[key])
            handle.flush()
            os.fsync(handle.fileno())
            if on_progress:
                on_progress(sum(key in done for key in wanted), len(wanted))
    return {key: done[key] for key in wanted}
