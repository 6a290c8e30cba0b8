"""Tiny word-level tokenizers with Qwen3-style and Llama-3-style chat templates, built in the test; a real
small (or read-only) filesystem for disk-full tests."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = [
    "user",
    "assistant",
    "system",
    "\n",
    "\n\n",
    " ",
    "hi",
    "there",
    "be",
    "brief",
    "ok",
    "sure",
    "why",
    "because",
    "2+2",
    "4",
    "thanks",
    "[UNK]",
]

# Qwen3-like: the last assistant turn of a rendering gets an (empty) think block when thinking is off,
# earlier ones do not: the template rewrites history, as Qwen3's own does.
QWEN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last and enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA_GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def make_tokenizer(style: str) -> PreTrainedTokenizerFast:
    specials = QWEN_SPECIALS if style == "qwen" else LLAMA_SPECIALS
    vocab = {w: i for i, w in enumerate(WORDS + specials)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    pattern = "|".join(s.replace("|", r"\|") for s in specials) + r"|\n\n|\n| "
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), "isolated")
    kwargs = {"unk_token": "[UNK]", "additional_special_tokens": specials}
    if style == "qwen":
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", **kwargs)
        fast.chat_template = QWEN_TEMPLATE
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", **kwargs
        )
        fast.chat_template = LLAMA_GENERATION_TEMPLATE if style == "llama-generation" else LLAMA_TEMPLATE
    return fast


@dataclass
class FakeChatServer:
    """An OpenAI-compatible chat endpoint on loopback: answers with `answer(request body)`, records every
    request in `seen`, and waits `delay` seconds before each reply (to be killed mid-run)."""

    answer: Callable[[dict], str | tuple[str, str]]  # the content, or (content, finish_reason)
    url: str = ""
    delay: float = 0.0
    seen: list[dict] = field(default_factory=list)


@contextlib.contextmanager
def fake_chat_server(answer: Callable[[dict], str | tuple[str, str]]) -> Iterator[FakeChatServer]:
    server = FakeChatServer(answer)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server.seen.append(body)
            time.sleep(server.delay)
            answer = server.answer(body)
            content, reason = answer if isinstance(answer, tuple) else (answer, "stop")
            reply = {
                "choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": reason}]
            }
            payload = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield server
    finally:
        httpd.shutdown()
