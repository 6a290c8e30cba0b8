"""The plain-`generate` baseline of `flashdraft bench regen`, run as its own script the way a user would
write one: import transformers, load the tokenizer and the target, render the chat-template prompts,
call `model.generate` on `--batch` prompts at a time. It prints one JSON object: the seconds of the
`generate` calls alone (`seconds`), the new tokens, and its phases from the process's start (start-up,
prompts, load, generate), so that the bench can compare the prepare command with it both ways: against
the generate calls alone, and process against process (docs/regeneration.md).

    python -m flashdraft.bench.plain_generate --target DIR --prompts FILE --batch 500 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flashdraft.phases import PhaseClock


def chat_prompts(target: str, prompts_file: str) -> tuple[list[list[int]], list[int], int]:
    """Each conversation's prompt ids (up to its first assistant turn), the target's stop ids, the pad id."""
    from flashdraft.data.chat import normalise
    from flashdraft.data.render import prompt_ids
    from flashdraft.data.sources import iter_records
    from flashdraft.data.stops import target_stop_ids
    from flashdraft.model.target import load_target_tokenizer

    tokenizer = load_target_tokenizer(target, required=True)
    prompts = []
    for record, where in iter_records([prompts_file]):
        messages = normalise(record, where).messages
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        prompts.append(prompt_ids(tokenizer, messages[:first], None))
    stops = target_stop_ids(target, tokenizer, None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    return prompts, stops, pad


@torch.inference_mode()
def generate_all(
    model, prompts: list[list[int]], stops: list[int], pad: int, batch: int, max_new: int
) -> int:
    """One greedy `generate` call per `batch` prompts, input order, left padding; returns the new tokens
    (up to and including the stop token)."""
    device = next(model.parameters()).device
    new_tokens = 0
    for start in range(0, len(prompts), batch):
        part = prompts[start : start + batch]
        width = max(len(p) for p in part)
        ids = torch.full((len(part), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(part):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=pad,
        )
        for row in out[:, width:].tolist():
            ended = [i for i, token in enumerate(row) if token in stops]
            new_tokens += ended[0] + 1 if ended else len(row)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return new_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashdraft.bench.plain_generate")
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--device", default="auto", help="cpu, or any other value: the GPU when present")
    args = parser.parse_args(argv)
    phases = PhaseClock(since_process_start=argv is None)
    prompts, stops, pad = chat_prompts(args.target, args.prompts)
    phases.mark("prompts")
    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    from flashdraft.model.target import load_causal_lm

    model = load_causal_lm(args.target, device, attention="sdpa")  # bf16 on a GPU, fp32 on the CPU
    phases.mark("load")
    started = time.perf_counter()
    new_tokens = generate_all(model, prompts, stops, pad, args.batch, args.max_new_tokens)
    seconds = time.perf_counter() - started
    phases.mark("generate")
    print(
        json.dumps(
            {
                "seconds": round(seconds, 3),
                "new_tokens": new_tokens,
                "tokens_per_s": round(new_tokens / seconds, 1),
                "phases": phases.seconds,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
