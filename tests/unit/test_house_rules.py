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


# private names of other libraries the runtime relies on knowingly: os._exit (the documented way to
# leave without interpreter teardown) and torch.distributed internals (abandoning process groups
# whose threads may block, the source rank of a receive from any peer)
FOREIGN_PRIVATE = {"os._exit", "c10d._world", "c10d._update_default_pg", "c10d._unregister_all_process_groups",
                   "work._source_rank"}


def _names_defined(tree: ast.AST) -> set[str]:
    """Every name a module defines: functions, classes, assigned names and attributes, arguments."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


def _private_attributes_of_others(source: str) -> list[str]:
    """``x._name`` reads and calls where ``x`` is not ``self``/``cls`` and the module does not
    define ``_name`` itself: a private name of another module reached by attribute."""
    tree = ast.parse(source)
    own = _names_defined(tree)
    out = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
            continue
        if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls") or n.attr in own:
            continue
        if ast.unparse(n) not in FOREIGN_PRIVATE:
            out.append(f"{n.lineno}: {ast.unparse(n)}")
    return out


def test_the_checker_finds_a_private_attribute_of_another_module():
    assert _private_attributes_of_others("def f(node):\n    node._sync(1)\n") == ["2: node._sync"]
    assert _private_attributes_of_others("class A:\n    def f(self, o):\n        self._x = o._x\n") == []


def test_no_private_names_reached_by_attribute_from_another_module():
    bad = []
    for p in sorted((ROOT / "skiptrain").rglob("*.py")):
        bad += [f"{p.relative_to(ROOT)}:{x}" for x in _private_attributes_of_others(p.read_text())]
    assert bad == []


def test_runtime_modules_and_functions_stay_small():
    """No file of the runtime is over 450 lines, and no function there over 60."""
    big, long = [], []
    for p in sorted((ROOT / "skiptrain" / "runtime").rglob("*.py")):
        text = p.read_text()
        if len(text.splitlines()) > 450:
            big.append(f"{p.relative_to(ROOT)} ({len(text.splitlines())} lines)")
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60:
                long.append(f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert big == [] and long == []


def test_bench_imports_nothing_from_tests():
    """The benchmarks run without the test suite: nothing under bench/ imports from tests/ (what
    both use, such as the fault-injecting node ``skiptrain.runtime.faults``, lives in the package)."""
    mods = _modules("skiptrain")
    test_modules = {"tests"} | {p.stem for p in (ROOT / "tests").rglob("*.py")}
    bad = [f"{p.relative_to(ROOT)}: {target}" for m, p in _modules("bench").items()
           for target, _ in _imports(m, p, mods) if target.split(".")[0] in test_modules]
    assert bad == []
