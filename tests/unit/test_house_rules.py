"""The code's standing rules, checked on the source: imports run one way (no module imports
itself through others), no module uses another module's private names, functions stay short,
the benchmarks import nothing from the tests.
(The layer order itself is import-linter's contract, `lint-imports`, run by `make test`.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 100


def _modules(folder: str) -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / folder).rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(name: str, path: Path, known: dict[str, Path]):
    """(imported module, names) for every import in ``path`` (function-level ones included)."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def _graph() -> dict[str, set[str]]:
    mods = _modules("skiptrain")
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for target, names in _imports(m, p, mods):
            for cand in [target] + [f"{target}.{n}" for n in names]:
                if cand in mods and cand != m:
                    g[m].add(cand)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_private_names_imported_from_another_module():
    mods = _modules("skiptrain")
    bad = []
    for folder in ("skiptrain", "tests", "bench"):
        for m, p in _modules(folder).items():
            for target, names in _imports(m, p, mods):
                if target.startswith("skiptrain") or target in mods:
                    bad += [f"{p.relative_to(ROOT)}: {n} from {target}" for n in names
                            if n.startswith("_") and not n.startswith("__")]
    assert bad == []


def test_functions_stay_under_the_limit():
    long = []
    for p in sorted((ROOT / "skiptrain").rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = n.end_lineno - n.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({lines} lines)")
    assert long == []


def test_bench_imports_nothing_from_tests():
    """The benchmarks run without the test suite: nothing under bench/ imports from tests/ (what
    both use, such as the fault-injecting node ``skiptrain.runtime.faults``, lives in the package)."""
    mods = _modules("skiptrain")
    test_modules = {"tests"} | {p.stem for p in (ROOT / "tests").rglob("*.py")}
    bad = [f"{p.relative_to(ROOT)}: {target}" for m, p in _modules("bench").items()
           for target, _ in _imports(m, p, mods) if target.split(".")[0] in test_modules]
    assert bad == []
