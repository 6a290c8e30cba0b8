"""A tiny language model that has learned something real, built in seconds on a CPU with no model hub:
Python source code from the standard library of the running interpreter, a byte-level BPE tokenizer
trained on it, and a small Llama-style model trained briefly to continue that code (docs/real-target.md).

The quickstart uses it as the target: its greedy continuations are structured (indentation, keywords,
names it has seen), which a drafter can learn to predict, unlike the outputs of a random model.
"""

from __future__ import annotations

import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, PreTrainedTokenizerFast

from flashdraft.durable import atomic_directory, atomic_write_json
from flashdraft.model.tiny import build_model, tiny_config

MASK_TOKEN = "<|mask|>"  # reserved for the drafter: never in the text the model is trained on
RECORD_NAME = "tiny-lm.json"  # what was trained and how well, beside the weights


@dataclass
class TinyLMSettings:
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 8
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 400
    lr: float = 1e-2
    train_bytes: int = 800_000  # characters of standard-library source, for the tokenizer and the model
    heldout_windows: int = 32
    seed: int = 0


# standard-library folders that are not library code (tests, demos, vendored installers, third parties)
_NOT_LIBRARY = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "turtledemo",
    "ensurepip",
    "lib2to3",
}


def stdlib_files(packages: bool = False) -> tuple[list[Path], list[Path]]:
    """The standard library's top-level modules (and with `packages`, its packages' modules too), split
    by path: every tenth file is held out (never trained on); the rest are training text. Sorted, so the
    split is the same on every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = root.rglob("*.py") if packages else root.glob("*.py")
    files = sorted(
        p
        for p in found
        if p.is_file()
        and p.stat().st_size > 2000
        and not _NOT_LIBRARY.intersection(p.relative_to(root).parts[:-1])
    )
    heldout = [p for i, p in enumerate(files) if i % 10 == 0]
    train = [p for i, p in enumerate(files) if i % 10 != 0]
    return train, heldout


def read_text(files: list[Path], limit: int) -> list[str]:
    """File contents in order, up to `limit` characters in all (undecodable files skipped)."""
    texts, total = [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    return texts


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`; every byte is in its alphabet, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, mask_token=MASK_TOKEN)


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one stream of ids, each file followed by a blank line."""
    encoded = tokenizer.backend_tokenizer.encode_batch([text + "\n\n" for text in texts])
    return torch.tensor([i for e in encoded for i in e.ids], dtype=torch.long)


def windows(stream: torch.Tensor, length: int, count: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (count,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batch: torch.Tensor) -> float:
    model.eval()
    logits = model(batch[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    model.train()
    return float(loss)


def train_tiny_lm(out: str | Path, settings: TinyLMSettings | None = None, log=print) -> dict:
    """Train the tiny code model and write it (weights, config, tokenizer, generation config, and
    `tiny-lm.json` with its held-out loss) to `out`, swapped in whole. Returns the record."""
    s = settings or TinyLMSettings()
    started = time.time()
    train_files, heldout_files = stdlib_files()
    train_texts = read_text(train_files, s.train_bytes)
    heldout_texts = read_text(heldout_files, s.train_bytes // 8)
    tokenizer = build_tokenizer(train_texts, s.vocab_size)
    train_ids = token_stream(tokenizer, train_texts)
    heldout_ids = token_stream(tokenizer, heldout_texts)

    config = tiny_config(
        "llama", vocab_size=len(tokenizer), hidden_size=s.hidden_size, num_layers=s.num_layers
    )
    model = build_model(config, seed=s.seed).train()
    g = torch.Generator().manual_seed(s.seed)
    heldout = windows(heldout_ids, s.seq_len + 1, s.heldout_windows, g)
    initial_loss = mean_loss(model, heldout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, s.steps // 10)
    for step in range(s.steps):
        # linear warm-up, then cosine decay to a tenth of the peak
        progress = max(0.0, (step - warmup) / max(1, s.steps - warmup))
        scale = (step + 1) / warmup if step < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = s.lr * scale
        batch = windows(train_ids, s.seq_len + 1, s.batch_size, g)
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % max(1, s.steps // 4) == 0:
            log(f"  tiny code model: step {step + 1}/{s.steps}, train loss {loss.item():.2f}")
    final_loss = mean_loss(model, heldout)
    record = {
        "settings": asdict(s),
        "train_tokens": len(train_ids),
        "heldout_tokens": len(heldout_ids),
        "heldout_files": [p.name for p in heldout_files],
        "initial_heldout_loss": initial_loss,
        "heldout_loss": final_loss,
        "uniform_loss": math.log(len(tokenizer)),
        "seconds": time.time() - started,
    }
    model.eval()
    model.generation_config = GenerationConfig(
        do_sample=False, suppress_tokens=[tokenizer.mask_token_id], pad_token_id=tokenizer.mask_token_id
    )
    with atomic_directory(out, replace=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / RECORD_NAME, record)
    return record


def code_prompts(
    tokenizer: PreTrainedTokenizerFast, files: list[Path], count: int, length: int, seed: int
) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, each starting at a line start of a random file."""
    rng = random.Random(seed)
    texts = read_text(files, 10**9)
    prompts = []
    while len(prompts) < count:
        text = rng.choice(texts)
        lines = text.splitlines(keepends=True)
        start = rng.randrange(len(lines))
        ids = tokenizer.encode("".join(lines[start : start + 40]))
        if len(ids) >= length:
            prompts.append(ids[:length])
    return prompts


@torch.no_grad()
def greedy_answers(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, suppress: int, batch_size: int = 64
) -> list[list[int]]:
    """The model's greedy continuation of each prompt, in batches (the prompts share one length, so no
    padding is needed)."""
    answers = []
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i : i + batch_size])
        full = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            suppress_tokens=[suppress],
            pad_token_id=suppress,
        )
        answers += full[:, batch.shape[1] :].tolist()
    return answers
