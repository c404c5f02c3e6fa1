"""The package's imports run one way: no module reaches, directly or through others, back to itself
-- counting imports inside functions too, so none can hide a cycle -- and no module uses another
module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlresearch"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement anywhere in the module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "mlresearch"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mlresearch":
                continue
            names = [a.name for a in node.names]
            found.append((target, [n for n in names if f"{target}.{n}" not in known]))
            found += [(f"{target}.{n}", []) for n in names if f"{target}.{n}" in known]
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: {t for t, _ in imports(name, path, known) if t in known and t != name} for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    found = cycles(graph())
    assert not found, f"import cycles (in-function imports included): {found}"


def test_the_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_name_is_imported_from_another_module():
    mods = modules()
    known = set(mods)
    private = [(name, target, n) for name, path in mods.items() for target, names in imports(name, path, known)
               for n in names if n.startswith("_") and not n.startswith("__") and target != name]
    assert not private, f"private names used across modules: {private}"


def test_transitions_use_only_the_run_context_they_declare():
    """A method file reaches the run only through ``methods.base.Context`` (config, data, log, a new
    model, the operator wrapper, ``charge`` for the ledger, ``keep`` for a saved model): no method
    writes the ledger or the checkpoint folder itself. The runner (planning.py) is the one exception."""
    from mlresearch.training.methods.base import Context
    from mlresearch.training.run import Run

    declared = {n for n in vars(Context) if not n.startswith("_")} | set(Context.__annotations__)
    methods = Path(__file__).resolve().parent.parent / "mlresearch" / "training" / "methods"
    used = {}
    for path in sorted(methods.glob("*.py")):
        if path.name == "planning.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "run":
                used.setdefault(node.attr, set()).add(path.name)
    assert used and set(used) <= declared, {a: sorted(f) for a, f in used.items() if a not in declared}
    assert all(hasattr(Run, name) for name in declared - set(Context.__annotations__))  # Run provides the methods
