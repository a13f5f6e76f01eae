"""Issue 43, defect 6: a tensor-parallel resume_memory that fails leaves the worker as
it was. The failure is real: rank 1's process gets an address-space limit (prlimit)
just above what it maps now, so its new KV pool (a 16 MiB shared file) or its weights
cannot be mapped. Before, the rank died of it (the worker with it), or rank 0
answered ok with the weights still released, `continue` answered ok while nothing
could be scheduled (requests waited for good), and a pool file could outlive the
processes. Now the resume answers 500 saying the memory stays released, every rank
is as before (weights: rank 1's spill file taken away and put back), `continue` is refused (409) until a resume works, a retry works for
real, and no /dev/shm/zpd-kv-* file of the rank is left."""
from __future__ import annotations

import glob
import resource
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.unit.inproc import InprocCluster

MB = 1 << 20


def _mapped_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def _pool_files(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/zpd-kv-{pid}-*") + glob.glob(f"/tmp/zpd-kv-{pid}-*")


def _decode(reply: dict) -> dict:
    """The decode's part of a reply through the router."""
    return next(w for w in reply["workers"] if w.get("role") == "decode")


@contextmanager
def _no_room(pid: int, room: int = 4 * MB):
    """Process `pid` can map `room` more than it maps now (4 MiB: less than its 16 MiB
    pool)."""
    limits = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (_mapped_bytes(pid) + room, limits[1]))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_AS, limits)


@contextmanager
def _spill_gone(folder: Path):
    """The spilled weights of the rank processes (their TMPDIR is `folder`) are away."""
    (spill,) = folder.glob("zpd-weights-*")
    away = folder / "away"
    spill.rename(away)
    try:
        yield
    finally:
        away.rename(spill)


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))      # the rank processes' spill files
    c = InprocCluster(tp=(1, 2), kv_cache_mb=16.0)
    yield c
    c.close()


@pytest.mark.parametrize("tags", [["kv_cache"], ["weights"], None], ids=["kv_cache", "weights", "all"])
def test_a_failed_resume_leaves_memory_released_and_a_retry_works(cluster, tags, tmp_path):
    c = cluster
    (rank1,) = c.decode.tp_procs
    args = {} if tags is None else {"tags": tags}
    assert c.admin("release_memory", **args)["ok"]
    weights = tags == ["weights"]
    with _spill_gone(tmp_path) if weights else _no_room(rank1.pid):
        got = _decode(c.admin("resume_memory", **args))
    assert not got["ok"] and got["status"] == 500, got
    assert "rank(s) [1]" in got["error"] and "released (resume_memory again)" in got["error"], got
    assert c.decode.failure() is None and rank1.is_alive()          # the worker goes on
    status = _decode(c.admin("status"))
    # what failed stays released (on every rank), the rest is back
    assert (status["memory"], status["weights_memory"]) == \
        ("resident" if weights else "released", "released" if weights else "resident")
    assert _pool_files(rank1.pid) == []
    refused = _decode(c.admin("continue"))
    assert refused.get("status") == 409 and "resume_memory first" in refused["error"], refused
    got = c.admin("resume_memory", **args)
    assert got["ok"], got
    assert c.admin("continue")["ok"]
    c.serves_again()
    c.check_pages()


def test_a_weight_update_one_rank_cannot_read_leaves_every_rank_as_it_was(cluster, tmp_path):
    """Rank 1 cannot hold the checkpoint it must read (its address space is full):
    before, rank 0 had swapped its part in already and rank 1 died of the error (the
    worker with it). Now every rank keeps its old weights, the worker says so and goes
    on, and a retry moves every rank, in step (the answers are the new model's)."""
    from engines.loader import load_model
    from engines.models.tiny import save_tiny
    from engines.offline import OfflineEngine
    from engines.request import Request
    from engines.sampler import SamplingParams
    c = cluster
    (rank1,) = c.decode.tp_procs
    new = save_tiny(tmp_path / "tiny1", seed=1)
    before = _decode(c.admin("status"))["weight_version"]
    assert c.admin("pause", mode="retract")["ok"]
    with _no_room(rank1.pid, room=0):
        got = _decode(c.admin("update_weights", path=str(new), weight_version="v1"))
    assert not got["ok"] and "rank(s) [1]" in got["error"] and "keeps its weights" in got["error"], got
    assert c.decode.failure() is None and rank1.is_alive()
    assert _decode(c.admin("status"))["weight_version"] == before
    assert c.admin("update_weights", path=str(new), weight_version="v1")["ok"]
    assert c.admin("continue")["ok"]
    prompt = [5, 17, 99, 3, 42, 8]
    answer = c.run(c.submit(prompt, 10))
    ref = OfflineEngine(load_model(str(new), dtype="float64"), kv_cache_mb=1).run([Request(
        "r", prompt, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))])[0]
    assert answer.token_ids == ref["output_ids"] and set(answer.weight_versions) == {"v1"}
    c.check_pages()
