"""Every script the README runs directly (not through `bash scripts/...`) must be
executable in git, or a fresh clone answers "Permission denied" (issue #10)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = re.compile(r"^scripts/[\w.-]+\.sh$")


def code_in(markdown: str) -> list[str]:
    """The text of fenced code blocks and inline code spans: where commands are."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M))
    return blocks + spans


def run_directly(markdown: str) -> set[str]:
    """scripts/*.sh paths in code that no `bash` or `sh` runs."""
    found = set()
    for code in code_in(markdown):
        words = code.split()
        for before, word in zip([""] + words, words):
            if SCRIPT.match(word) and before not in ("bash", "sh"):
                found.add(word)
    return found


def git_modes(paths: list[str]) -> dict[str, str] | None:
    """path -> git file mode, or None where git or the repository is unavailable."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    out = subprocess.run(["git", "ls-files", "-s", "--", *paths], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return {line.split("\t", 1)[1]: line.split()[0] for line in out.splitlines()}


def not_executable(paths: list[str]) -> list[str]:
    """The paths missing, or not executable for everyone who clones the repository."""
    modes = git_modes(paths)
    missing = [p for p in paths if not (ROOT / p).is_file()]
    if modes is None:
        return missing + [p for p in paths if p not in missing and not os.access(ROOT / p, os.X_OK)]
    return missing + [f"{p} ({modes.get(p, 'not in git')})" for p in paths
                      if p not in missing and modes.get(p) != "100755"]


def test_scripts_the_readme_runs_are_executable() -> None:
    scripts = sorted(run_directly((ROOT / "README.md").read_text()))
    assert "scripts/launch_cluster.sh" in scripts     # the one issue #10 found; the scan works
    assert not_executable(scripts) == []


def test_every_script_with_a_shebang_is_executable() -> None:
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.sh")
                     if p.read_bytes().startswith(b"#!"))
    assert scripts and not_executable(scripts) == []


def test_the_scan_tells_direct_runs_from_bash_runs() -> None:
    readme = ("```bash\nbash scripts/a.sh && scripts/b.sh x\nFOO=1 \\\n    scripts/c.sh\n```\n"
              "Run `sh scripts/d.sh` or `scripts/e.sh --help`; see scripts/f.sh.\n")
    assert run_directly(readme) == {"scripts/b.sh", "scripts/c.sh", "scripts/e.sh"}
    assert not_executable(["scripts/no-such.sh"]) == ["scripts/no-such.sh"]


def test_without_git_the_file_mode_decides(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    script = tmp_path / "s.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    assert not_executable([str(script)]) == [str(script)]
    script.chmod(0o755)
    assert not_executable([str(script)]) == []
