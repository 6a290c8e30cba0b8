"""Tiny word-level tokenizers with Qwen3-style and Llama-3-style chat templates, a character-level one for any
template, built in the test; a fake OpenAI-compatible chat server."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
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


# With `pieces`: the words a special token's text falls into when it is tokenized as plain text (typed in a
# message, docs/inputs-and-outputs.md), after the special tokens, so the other ids stay as they are.
PIECES = ["<", "|", ">", "/", "im_start", "im_end", "think", "begin_of_text", "start_header_id"]
PIECES += ["end_header_id", "eot_id"]


def make_tokenizer(style: str, pieces: bool = False) -> PreTrainedTokenizerFast:
    specials = QWEN_SPECIALS if style == "qwen" else LLAMA_SPECIALS
    vocab = {w: i for i, w in enumerate(WORDS + specials + (PIECES if pieces else []))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    pattern = "|".join(s.replace("|", r"\|") for s in specials) + r"|\n\n|\n| "
    if pieces:  # special tokens are matched before this split; their text typed as plain text splits here
        pattern = r"\n\n|\n| |<|\||>|/"
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


# What the fake server says instead of answering: (HTTP status, body, headers), or RESET (the connection is
# closed without a reply).
Failure = tuple[int, str, dict[str, str]] | str
RESET = "reset"


def make_char_tokenizer(
    template: str, specials: tuple[str, ...] = tuple(QWEN_SPECIALS)
) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (and newline) plus `specials`; decoding gives back the exact
    text, so tests can compare supervised spans as text. 100 + len(specials) ids."""
    chars = ["\n", *map(chr, range(32, 127)), "[UNK]"]
    vocab = {w: i for i, w in enumerate(chars + list(specials))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    pattern = r"[\s\S]"  # special tokens are matched before this split; as plain text they are characters
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        eos_token=specials[1],
        additional_special_tokens=list(specials),
    )
    fast.chat_template = template
    return fast


@dataclass
class FakeChatServer:
    """An OpenAI-compatible chat endpoint on loopback: answers with `answer(request body)`, records every
    request in `seen` (with its arrival time in `arrivals`), and waits `delay` seconds before each reply.
    While `script` holds failures, each request gets the next one instead of an answer. With `hold_after`
    set, requests beyond that many are held unanswered until `release()` (a client to be killed mid-run
    waits there, whatever the machine's speed: `wait_held` says when it does)."""

    # the content, (content, finish_reason), or the whole assistant message (a dict), optionally with a reason
    answer: Callable[[dict], str | dict | tuple[str | dict, str]]
    url: str = ""
    delay: float = 0.0
    seen: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    script: list[Failure] = field(default_factory=list)
    hold_after: int | None = None
    held: int = 0  # requests waiting for release()
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _released: threading.Event = field(default_factory=threading.Event)

    def wait_held(self, count: int, timeout: float = 600.0) -> bool:
        """Wait until `count` requests are held (a generous limit: a loaded machine starts a client slowly)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.held >= count, timeout)

    def release(self) -> None:
        """Answer the held requests and every later one."""
        self._released.set()


@contextlib.contextmanager
def fake_chat_server(
    answer: Callable[[dict], str | dict | tuple[str | dict, str]], script: list[Failure] | None = None
) -> Iterator[FakeChatServer]:
    server = FakeChatServer(answer, script=list(script or []))
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                server.seen.append(body)
                server.arrivals.append(time.monotonic())
                failure = server.script.pop(0) if server.script else None
                hold = server.hold_after is not None and len(server.seen) > server.hold_after
            if hold and not server._released.is_set():
                with server._changed:
                    server.held += 1
                    server._changed.notify_all()
                server._released.wait()
                with contextlib.suppress(OSError):  # the client may be gone (killed while it waited)
                    self._answer(body)
                return
            if failure == RESET:
                self.close_connection = True  # closed without a reply: the client sees a broken connection
                return
            if failure is not None:
                status, text, headers = failure
                self._send(status, text.encode(), headers)
                return
            time.sleep(server.delay)
            self._answer(body)

        def _answer(self, body: dict) -> None:
            answer = server.answer(body)
            message, reason = answer if isinstance(answer, tuple) else (answer, "stop")
            if not isinstance(message, dict):
                message = {"role": "assistant", "content": message}
            reply = {"choices": [{"message": message, "finish_reason": reason}]}
            self._send(200, json.dumps(reply).encode(), {})

        def _send(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # the default backlog (5) resets connections under concurrent requests

    httpd = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield server
    finally:
        httpd.shutdown()


def supervised_spans(tokenizer, ids, mask) -> list[str]:
    """The text of each run of supervised tokens (what the model is taught to generate)."""
    spans, run = [], []
    for token, supervised in [*zip(list(ids), list(mask), strict=True), (None, 0)]:
        if supervised:
            run.append(int(token))
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans
