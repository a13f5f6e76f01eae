"""The layout the README describes is the code's: dependencies point one way
(zpd -> engines, zpd -> transport) and every zpd subpackage is explained."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_packages(package: str) -> dict[str, set[str]]:
    """file -> the top-level packages it imports (absolute imports only)."""
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        tops = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = tops
    return out


def test_engines_import_neither_zpd_nor_transport():
    bad = {f: t & {"zpd", "transport"} for f, t in imported_packages("engines").items()
           if t & {"zpd", "transport"}}
    assert not bad


def test_transport_imports_neither_zpd_nor_engines_nor_torch():
    bad = {f: t & {"zpd", "engines", "torch"} for f, t in imported_packages("transport").items()
           if t & {"zpd", "engines", "torch"}}
    assert not bad


def test_every_zpd_subpackage_is_in_the_readme_layout():
    readme = (ROOT / "README.md").read_text()
    described = set(re.findall(r"^zpd/(\w+)/", readme, re.M))
    actual = {p.parent.name for p in (ROOT / "zpd").glob("*/__init__.py")}
    assert actual and described == actual


ROLES = ("worker", "router", "http", "wire")     # what zpd/ops runs, and their wire


def test_roles_do_not_import_ops():
    """ops runs the roles (zpd/ops/serve.py starts each one's process); a role that
    imported ops would make the layers a circle."""
    graph = import_graph()
    roles = [m for m in graph if m.startswith("zpd.") and m.split(".")[1] in ROLES]
    upward = {m: sorted(t for t in graph[m] if t.startswith("zpd.ops")) for m in roles}
    assert len({m.split(".")[1] for m in roles}) == len(ROLES)
    assert not {m: t for m, t in upward.items() if t}


# The engine's backends: a model sees only the protocol (engines/backend.py); the
# compiled CPU kernels are reached through engines/cpu/ alone.

PACKAGES = ("engines", "zpd", "transport", "scripts")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path, module: str) -> set[str]:
    """Dotted names `path` imports anywhere: at module level, in functions and under
    TYPE_CHECKING (an import for annotations still ties two files together); relative
    ones resolved; `from a import b` names a.b (a module, or a name in module a)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of PACKAGES it imports. scripts/ run as files, so a bare
    name there is a sibling script."""
    paths = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        targets = set()
        for name in _imported_names(path, module):
            if module.startswith("scripts.") and f"scripts.{name.split('.')[0]}" in paths:
                name = f"scripts.{name}"
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component, member = set(), None
                    while member != node:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                    if len(component) > 1:
                        found.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_circles():
    assert _circles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _circles(graph) == [{"a", "b", "c"}]


def test_models_see_only_the_backend_protocol():
    """engines/models/ computes through engines/backend.py: no backend's code, no kernel."""
    graph = import_graph()
    backends = ("engines.cpu", "engines.torch_backend", "engines.runner")
    bad = {m: sorted(t for t in targets if t.startswith(backends))
           for m, targets in graph.items() if m.startswith("engines.models.")}
    assert {m: t for m, t in bad.items() if t} == {}
    assert "engines.backend" in graph["engines.models.llama"]


# Who outside engines/cpu/ may import it, and why: the runner picks the backend, the
# loader the float32 weights' layout for the products, weight release drops packed
# copies, zpd/env.py hands the kernels their switches.
CPU_IMPORTERS = {"engines.runner", "engines.loader", "engines.weight_release", "zpd.env"}


def test_only_engines_cpu_reaches_the_compiled_kernels():
    graph = import_graph()
    importers = {m for m, targets in graph.items() if not m.startswith("engines.cpu")
                 and any(t.startswith("engines.cpu") for t in targets)}
    assert importers <= CPU_IMPORTERS, importers - CPU_IMPORTERS
    # the kernels' own modules: the runner reaches them through the CPU backend only
    wrappers = {"engines.cpu.kernels", "engines.cpu.layer_ops", "engines.cpu.products"}
    direct = {m for m, targets in graph.items() if not m.startswith("engines.cpu.") and targets & wrappers}
    assert direct <= {"engines.loader", "zpd.env"}, direct


# The optional parts ("wings"): each may import the core; the core never imports one,
# not even inside a function. zpd/ops/ builds each process and plugs its wings in
# (zpd/ops/router.py, zpd/ops/worker.py, zpd/ops/serve.py).
WINGS = ("zpd.router.ha", "zpd.router.weights", "zpd.worker.ha", "zpd.worker.weights",
         "zpd.http.guard", "engines.weights")
ASSEMBLY = ("zpd.ops", "scripts")


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_wings_are_packages():
    graph = import_graph()
    assert [w for w in WINGS if w not in graph] == []
    assert all(any(m.startswith(w + ".") for m in graph) for w in WINGS)


def test_the_core_never_imports_a_wing():
    graph = import_graph()
    reached = {m: sorted(t for t in targets if _within(t, WINGS))
               for m, targets in graph.items() if not _within(m, WINGS + ASSEMBLY)}
    assert {m: t for m, t in reached.items() if t} == {}
    # the assembly does plug them in
    assert "zpd.worker.weights.sync" in graph["zpd.ops.worker"]
    assert "zpd.worker.ha.adoption" in graph["zpd.ops.worker"]


def test_an_import_for_annotations_counts(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from zpd.router.server import RouterServer\n"
                    "def f():\n    from . import admin\n")
    names = _imported_names(path, "zpd.router.x")
    assert {"zpd.router.server.RouterServer", "zpd.router.admin"} <= names


def test_test_files_have_distinct_names():
    """pytest imports test modules by basename (the test folders are not packages):
    two files of one name in tests/unit and tests/e2e stop the whole run at collection."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_the_tests_the_docs_name_exist():
    """docs/*.md back claims with test names (`tests/...py::test_x`, or `::test_x`
    after one): each must exist, or the claim has lost its evidence."""
    sources = {p: p.read_text() for p in (ROOT / "tests").rglob("*.py")}
    missing = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        text = doc.read_text()
        for path, name in re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text):
            source = sources.get(ROOT / path)
            if source is None or (name and f"def {name}(" not in source):
                missing.append(f"{doc.name}: {path}::{name}")
        for name in re.findall(r"`::(test_\w+)`", text):
            if not any(f"def {name}(" in s for s in sources.values()):
                missing.append(f"{doc.name}: ::{name}")
    assert not missing
