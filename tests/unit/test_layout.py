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


def zpd_modules_imported(path: Path) -> set[str]:
    """The zpd modules a file imports, by their dotted names (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n == "zpd" or n.startswith("zpd.")}


def test_roles_do_not_import_ops():
    """ops runs the roles (zpd/ops/serve.py starts each one's process); a role that
    imported ops would make the layers a circle."""
    roles = [p for d in ("worker", "router", "http", "wire") for p in (ROOT / "zpd" / d).rglob("*.py")]
    upward = {str(p.relative_to(ROOT)): sorted(m for m in zpd_modules_imported(p)
                                               if m == "zpd.ops" or m.startswith("zpd.ops."))
              for p in roles}
    assert roles
    assert not {f: m for f, m in upward.items() if m}
