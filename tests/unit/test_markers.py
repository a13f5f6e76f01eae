"""The `slow` marker (tests/conftest.py): what it names exists, and it marks by path, so
`pytest -m "not slow"` (the quick loop) leaves out exactly what it lists."""
from __future__ import annotations

import ast
from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]


def test_every_listed_slow_file_and_test_exists():
    missing = [f for f in conftest.SLOW_FILES if not (ROOT / f).is_file()]
    for entry in conftest.SLOW_TESTS:
        path, name = entry.split("::")
        tree = ast.parse((ROOT / path).read_text()) if (ROOT / path).is_file() else ast.Module([], [])
        if name not in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}:
            missing.append(entry)
    assert missing == []


def test_slow_by_directory_file_and_test_name():
    assert conftest.is_slow("tests/e2e/test_demo.py::test_demo_answers[x]")
    assert not conftest.is_slow("tests/unit/test_loop.py::test_anything")
    assert conftest.is_slow("tests/unit/test_chat.py::test_x", ("tmp_path", "smollm_ref"))
    assert not conftest.is_slow("tests/unit/test_chat.py::test_x", ("tmp_path", "smollm"))
    for path in conftest.SLOW_FILES:
        assert conftest.is_slow(f"{path}::test_any[param]")
    for entry in conftest.SLOW_TESTS:
        assert conftest.is_slow(f"{entry}[param]") and conftest.is_slow(entry)
        assert not conftest.is_slow(f"{entry}_and_more")


def test_the_marker_is_registered():
    assert "markers = [\"slow:" in (ROOT / "pyproject.toml").read_text()
