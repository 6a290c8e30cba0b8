"""The house's size rule, read from the code (issue #30): no function in the training path (train/,
generate/, infer/) is longer than 120 lines, so each reads as its named steps."""

from __future__ import annotations

import ast
from pathlib import Path

import flashdraft

PACKAGE = Path(flashdraft.__file__).parent
TRAINING_PATH = ("train", "generate", "infer")
MAX_LINES = 120


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `source`, nested ones too, longer than `limit` lines
    from its `def` to its last line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def test_no_function_in_the_training_path_is_longer_than_120_lines():
    giants = [
        f"{path.relative_to(PACKAGE.parent)}::{name} ({lines} lines)"
        for package in TRAINING_PATH
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for name, lines in long_functions(path.read_text(), MAX_LINES)
    ]
    assert not giants, f"split these into named steps (at most {MAX_LINES} lines each): {giants}"


def _function(name: str, lines: int, indent: str = "", prefix: str = "def") -> str:
    """The source of a function exactly `lines` lines long, `def` line included."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}{prefix} {name}():\n{body}"


def test_the_count_runs_from_def_to_the_last_line_and_sees_methods_and_nested_functions():
    source = (
        _function("short", MAX_LINES)
        + _function("long", MAX_LINES + 1)
        + "class C:\n"
        + _function("method", MAX_LINES + 1, "    ", "async def")
        + "def outer():\n"
        + _function("inner", MAX_LINES, "    ")
    )
    assert sorted(long_functions(source, MAX_LINES)) == [
        ("long", MAX_LINES + 1),
        ("method", MAX_LINES + 1),
        ("outer", MAX_LINES + 1),  # its own line and the nested function's
    ]
