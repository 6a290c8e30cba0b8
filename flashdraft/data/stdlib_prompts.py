"""Chat prompts made from the docstrings of the running interpreter's standard library.

Text that ships with every Python, so `flashdraft bench quality` needs no dataset download: each module,
class and function docstring of the stdlib's own .py files (read with `ast`, never imported) becomes a user
turn through a few fixed instruction templates. The order is deterministic (files sorted by path, choices by
CRC32 of the text, not Python's salted hash), docstrings are deduplicated, and the held-out split is by
source module: a top-level module or package (`email`, `asyncio`) is wholly in training or wholly held out,
so no held-out prompt paraphrases a training one from a sibling file (docs/quality-benchmark.md).

Two kinds of prompt (`bench quality --prompt-kinds`): `docs`, the docstrings through the templates above,
and `code`, a question about a 12-line `def`/`class` snippet of the same files (the question `quickstart
--real` asks). Together they give about 2.4x the docstrings' count, for races whose budget outruns the
docstrings alone (docs/quality-benchmark.md, "The race").
"""

from __future__ import annotations

import ast
import functools
import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from flashdraft.durable import atomic_write_text
from flashdraft.errors import FlashdraftError

# Test suites, demos and the bundled installers are not library documentation (and some test files do
# not even parse: they are fixtures of syntax errors).
SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "lib2to3", "ensurepip", "turtledemo"}
)
MIN_CHARS = 40  # shorter docstrings ("Return self.") make prompts with nothing to explain
MAX_CHARS = 1200  # long module docstrings are cut at a paragraph end: the prompt stays a prompt

TEMPLATES = {
    "module": "Summarize what the Python standard library module `{module}` is for, based on its "
    "documentation:\n\n{doc}",
    "class": "Describe the Python class `{qualname}` from the `{module}` module and show a short example "
    "of using it. Its documentation:\n\n{doc}",
    "function": "Explain what the Python function `{qualname}` from the `{module}` module does, given its "
    "documentation. Say what it takes and what it returns.\n\n{doc}",
    "write": "Write a Python function named `{name}` that does the following:\n\n{doc}",
}
# the `code` kind's question, which `quickstart --real` asks too
CODE_QUESTION = "In one or two sentences, what does this Python code do?\n\n```python\n{code}```"
SNIPPET_LINES = 12
PROMPT_KINDS = ("docs", "code")


@dataclass(frozen=True)
class Prompt:
    group: str  # the top-level module or package: the unit of the held-out split
    source: str  # dotted name of what the docstring documents
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _shorten(doc: str) -> str:
    if len(doc) <= MAX_CHARS:
        return doc
    cut = doc.rfind("\n\n", 0, MAX_CHARS)
    return doc[: cut if cut >= MIN_CHARS else MAX_CHARS].rstrip()


def code_snippets(text: str) -> list[tuple[int, str]]:
    """(1-based line, the SNIPPET_LINES lines from it) for each line that opens a `def` or `class`, in
    source order."""
    lines = text.splitlines(keepends=True)
    return [
        (i + 1, "".join(lines[i : i + SNIPPET_LINES]))
        for i, line in enumerate(lines)
        if line.lstrip().startswith(("def ", "class "))
    ]


def _documented(tree: ast.Module) -> list[tuple[str, str, str]]:
    """(kind, qualified name, docstring) of the module and every class and function, in source order."""
    found = []
    doc = ast.get_docstring(tree)
    if doc:
        found.append(("module", "", doc))

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{node.name}"
                doc = ast.get_docstring(node)
                if doc:
                    found.append(("class" if isinstance(node, ast.ClassDef) else "function", name, doc))
                visit(node.body, f"{name}.")

    visit(tree.body, "")
    return found


def wrong_prompt_kinds(kinds: tuple[str, ...]) -> str | None:
    """What is wrong with `kinds` (PROMPT_KINDS, at least one), or None."""
    unknown = [k for k in kinds if k not in PROMPT_KINDS]
    if unknown or not kinds:
        return f"{', '.join(unknown) or 'none given'}: choose from {', '.join(PROMPT_KINDS)}"
    return None


@functools.lru_cache(maxsize=8)
def stdlib_prompts(root: Path | None = None, kinds: tuple[str, ...] = ("docs",)) -> tuple[Prompt, ...]:
    """Every prompt of `kinds` (PROMPT_KINDS) the library gives, deduplicated, in a fixed order: file by
    file, a file's docstring prompts before its code questions."""
    wrong = wrong_prompt_kinds(kinds)
    if wrong:
        raise FlashdraftError(f"--prompt-kinds: {wrong}")
    root = root or stdlib_root()
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts[:-1]))
    prompts, seen_docs, seen_texts = [], set(), set()

    def add(group: str, source: str, text: str) -> None:
        if text not in seen_texts:
            seen_texts.add(text)
            prompts.append(Prompt(group, source, text))

    for path in files:
        relative = path.relative_to(root)
        module = _module_name(relative)
        group = relative.parts[0].removesuffix(".py")
        try:
            source_bytes = path.read_bytes()
            tree = ast.parse(source_bytes)
        except (SyntaxError, ValueError):  # a file the running parser does not read is not text we need
            continue
        for kind, qualname, doc in _documented(tree) if "docs" in kinds else ():
            key = " ".join(doc.split())
            if len(key) < MIN_CHARS or key in seen_docs:
                continue
            seen_docs.add(key)
            fields = {"module": module, "qualname": qualname, "name": qualname.rsplit(".", 1)[-1]}
            fields["doc"] = _shorten(doc)
            templates = [kind]
            if kind == "function" and not fields["name"].startswith("_"):
                templates.append("write")  # a public function also asks for an implementation
            for template in templates:
                add(
                    group,
                    f"{module}.{qualname}" if qualname else module,
                    TEMPLATES[template].format(**fields),
                )
        if "code" in kinds:
            try:
                text = source_bytes.decode("utf-8")
            except UnicodeDecodeError:
                continue
            for line, snippet in code_snippets(text):
                add(group, f"{module}:{line}", CODE_QUESTION.format(code=snippet))
    return tuple(prompts)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def split_prompts(
    prompts: tuple[Prompt, ...] | list[Prompt],
    train: int,
    held_out: int,
    asked: str | None = None,
    spare: int = 0,
) -> tuple[list[Prompt], list[Prompt], list[Prompt]]:
    """`train`, `held_out` and `spare` prompts (`bench quality`'s selection prompts), the three from
    disjoint source modules. Modules are taken in CRC32 order of their names, for the held-out side until it
    has enough, then for the spare side until it has enough; each side's prompts are then ordered by CRC32
    of their text (a spread over modules, not one module's run) and cut to the count asked. So the
    held-out prompts do not depend on `spare`; the training prompts lose the spare side's modules. `asked`
    names the training count's flags in the error (default `--prompts N`)."""
    if train < 1:
        raise FlashdraftError(f"--prompts must be at least 1, got {train}")
    if held_out < 1:
        raise FlashdraftError(f"--eval-prompts must be at least 1, got {held_out}")
    groups: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.group, []).append(prompt)
    order = iter(sorted(groups, key=lambda g: (_crc(g), g)))

    def take_modules(wanted: int) -> set[str]:
        taken: set[str] = set()
        count = 0
        for name in order if wanted else ():
            taken.add(name)
            count += len(groups[name])
            if count >= wanted:
                break
        return taken

    held_groups = take_modules(held_out)
    spare_groups = take_modules(spare)

    def side(keep) -> list[Prompt]:
        return sorted((p for p in prompts if keep(p.group)), key=lambda p: (_crc(p.text), p.text))

    held, spared = side(held_groups.__contains__), side(spare_groups.__contains__)
    rest = side(lambda group: group not in held_groups and group not in spare_groups)
    if len(held) < held_out or len(spared) < spare or len(rest) < train:
        select = f" --select-prompts {spare}" if spare else ""
        raise FlashdraftError(
            f"{asked or f'--prompts {train}'} --eval-prompts {held_out}{select}: the standard library gives "
            f"{len(prompts)} prompts ({len(rest)} for training once {len(held) + len(spared)} are held out); "
            "ask for fewer"
        )
    return rest[:train], held[:held_out], spared[:spare]


def _write_chat_jsonl(path: str | Path, chosen: list[Prompt]) -> None:
    atomic_write_text(
        path,
        "".join(
            json.dumps({"messages": [{"role": "user", "content": p.text}], "source": p.source}) + "\n"
            for p in chosen
        ),
    )


def write_prompt_files(
    train_path: str | Path,
    eval_path: str | Path,
    train: int,
    held_out: int,
    root: Path | None = None,
    prior_path: str | Path | None = None,
    prior: int = 0,
    select_path: str | Path | None = None,
    select: int = 0,
    kinds: tuple[str, ...] = ("docs",),
) -> dict[str, object]:
    """Both splits as chat JSONL (one user turn each, with its source); returns what was written.
    With `prior_path`, also the `prior` training-side prompts that follow the training ones (the data an
    earlier drafter was trained on, for `bench quality --warm-start`): the training and held-out files are
    the same as without it. With `select_path`, also `select` held-out prompts that are not among the
    held-out ones (`bench quality`'s selection prompts, which choose a checkpoint that the held-out ones
    then score). `kinds`: PROMPT_KINDS to draw from."""
    asked = f"--prompts {train} with {prior} prior prompts" if prior_path is not None else None
    spare = select if select_path is not None else 0
    try:
        rest, eval_prompts, select_prompts = split_prompts(
            stdlib_prompts(root, tuple(kinds)), train + prior, held_out, asked, spare=spare
        )
    except FlashdraftError as exc:
        if "code" in kinds:
            raise
        raise FlashdraftError(f"{exc}, or add the code questions: --prompt-kinds docs,code") from None
    train_prompts, prior_prompts = rest[:train], rest[train:]
    _write_chat_jsonl(train_path, train_prompts)
    _write_chat_jsonl(eval_path, eval_prompts)
    written: dict[str, object] = {
        "train_prompts": len(train_prompts),
        "eval_prompts": len(eval_prompts),
        "train_modules": len({p.group for p in train_prompts}),
        "eval_modules": sorted({p.group for p in eval_prompts}),
        "stdlib": str(root or stdlib_root()),
        "kinds": list(kinds),
    }
    if prior_path is not None:
        _write_chat_jsonl(prior_path, prior_prompts)
        written["prior_prompts"] = len(prior_prompts)
    if select_path is not None:
        _write_chat_jsonl(select_path, select_prompts)
        written["select_prompts"] = len(select_prompts)
    return written
