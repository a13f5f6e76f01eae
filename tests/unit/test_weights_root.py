"""`update_weights` reads checkpoints only under --weights-root when it is set, and
its errors tell nothing about the filesystem outside it (tests/unit/inproc.py)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from engines.models.tiny import save_tiny
from tests.unit.inproc import InprocCluster
from zpd.ops.cli import build_parser
from zpd.ops.options import worker_argv, worker_config


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/step-2 (a checkpoint), root/escape -> outside/, outside/secret (a checkpoint)."""
    save_tiny(tmp_path / "root" / "step-2", seed=2)
    save_tiny(tmp_path / "outside" / "secret", seed=3)
    os.symlink(tmp_path / "outside", tmp_path / "root" / "escape")
    return tmp_path


def rooted(c: InprocCluster, root: Path | None) -> None:
    """As --weights-root `root`: the memory commands read it from their port."""
    for core in (c.prefill, c.decode):
        core.memory.port = dataclasses.replace(core.memory.port,
                                               weights_root=None if root is None else str(root))


def update(c: InprocCluster, path: str) -> list[dict]:
    reply = c.admin("update_weights", path=path, version="v2")
    return reply["workers"]


def test_inside_the_root_loads(cluster, tree):
    rooted(cluster, tree / "root")
    for path in ("step-2", str(tree / "root" / "step-2"), "tiny:7"):
        assert all(w["ok"] and w["weight_version"] == "v2" for w in update(cluster, path)), path


@pytest.mark.parametrize("where", ["outside/secret", "outside/nothing-here", "root/../outside/secret",
                                   "root/escape/secret", "root/escape/nothing-here", "/etc"])
def test_outside_the_root_is_403_whether_it_exists_or_not(cluster, tree, where):
    rooted(cluster, tree / "root")
    path = str(tree / where) if not where.startswith("/") else where
    for w in update(cluster, path):
        assert not w["ok"] and w["status"] == 403
        assert w["error"] == f"update_weights: {path!r} is not under this worker's --weights-root"
    assert cluster.decode.model.version == "tiny"


def test_an_index_cannot_name_shards_outside_its_directory(cluster, tree):
    ckpt = tree / "root" / "step-2"
    (ckpt / "model.safetensors").rename(tree / "outside" / "stolen.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../../outside/stolen.safetensors"}}))
    rooted(cluster, tree / "root")
    for w in update(cluster, "step-2"):
        assert not w["ok"] and w["status"] == 400 and "outside" not in w["error"]
    assert cluster.decode.model.version == "tiny"


def test_without_a_root_a_missing_path_names_only_itself(cluster, tree):
    path = str(tree / "nothing-here")
    for w in update(cluster, path):
        assert not w["ok"] and w["status"] == 400 and path in w["error"]
        assert w["error"].replace(path, "").count("/") == 0


def test_the_flag_reaches_workers_and_launch(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["decode", "--model", "tiny", "--weights-root", str(tmp_path)])
    assert worker_config(args, "decode").weights_root == str(tmp_path)
    launch = parser.parse_args(["launch", "--model", "tiny", "--weights-root", str(tmp_path)])
    argv = worker_argv(launch)
    assert argv[argv.index("--weights-root") + 1] == str(tmp_path)
    assert worker_config(parser.parse_args(["prefill", "--model", "tiny"]), "prefill").weights_root is None


def test_a_missing_root_fails_at_start(tmp_path):
    args = build_parser().parse_args(["decode", "--model", "tiny", "--weights-root",
                                      str(tmp_path / "typo")])
    with pytest.raises(ValueError, match="not a directory"):
        worker_config(args, "decode")


@pytest.mark.parametrize("rooted_at", [None, "root"])
def test_a_nul_in_the_path_is_400(cluster, tree, rooted_at):
    rooted(cluster, None if rooted_at is None else tree / rooted_at)
    for w in update(cluster, "step-2\0x"):
        assert not w["ok"] and w["status"] == 400
