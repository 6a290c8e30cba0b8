"""The house's import rules, read from the code: no import cycle between modules, and every package
imports only the packages that its row of docs/architecture.md's table names (lazy imports count too)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import flashdraft

PACKAGE = Path(flashdraft.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every flashdraft module `path` imports, at its top or inside a function (`from a import b` names
    a.b too: b may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("flashdraft.")}


def _module_graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

    def known(name: str) -> str | None:  # the module itself, or the package that holds the name
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {
        name: {m for m in map(known, _imports(path)) if m not in (None, name, "flashdraft")}
        for name, path in modules.items()
    }


def _package(module: str) -> str:
    """`core` for flashdraft/*.py, else the folder under flashdraft/."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "core"


def _documented_imports() -> dict[str, set[str]]:
    """The table's "imports" column, by package: names listed, "every package but X and Y",
    "everything", or "nothing"."""
    rows = re.findall(r"^\| (core|`\w+/`)[^|]* \| .*? \| ([^|]+) \|$", ARCHITECTURE.read_text(), re.M)
    packages = {"core" if name == "core" else name.strip("`/") for name, _ in rows}
    allowed = {}
    for name, column in rows:
        package = "core" if name == "core" else name.strip("`/")
        column = column.strip()
        if column.startswith("everything"):
            allowed[package] = packages - {package}
        elif column.startswith("every package but"):
            but = set(re.findall(r"\w+", column.split(";")[0].removeprefix("every package but")))
            allowed[package] = packages - {package} - (but - {"and"})
        elif column.startswith("nothing"):
            allowed[package] = set()
        else:
            allowed[package] = {word.split()[0] for word in re.sub(r"\([^)]*\)", "", column).split(",")}
    return allowed


def test_no_import_cycle_between_modules():
    graph = _module_graph()
    state: dict[str, str] = {}  # "open" while on the path, "done" once every import below it is checked
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                cycles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_every_package_imports_only_what_docs_architecture_md_says():
    allowed = _documented_imports()
    on_disk = {"core"} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert set(allowed) == on_disk, "docs/architecture.md's table must have one row per package"
    wrong = set()
    for module, imported in _module_graph().items():
        if module == "flashdraft.__main__":  # the entry point: it runs the CLI
            continue
        source = _package(module)
        for target in map(_package, imported):
            if target != source and target not in allowed[source]:
                wrong.add(f"{module} imports {target}, which docs/architecture.md's row of {source} omits")
    assert sorted(wrong) == []


def test_the_table_reader_understands_each_kind_of_row():
    """A guard on the reader above: the rows as written today parse to the directions they state."""
    allowed = _documented_imports()
    assert allowed["core"] == set()
    assert allowed["model"] == {"core"}
    assert allowed["generate"] == {"distributed", "model", "core"}
    assert (
        "cli" not in allowed["bench"] and "quickstart" not in allowed["bench"] and "train" in allowed["bench"]
    )
    assert allowed["cli"] >= {"bench", "quickstart", "run", "train", "infer", "data"}
