"""Issue 43, defect 1: a tensor-parallel worker's rank group is not reachable from
another host or user, and nothing it reads is unpickled. The old group met on a
TCPStore that listened on every interface; at resume_memory rank 0 unpickled the pool
handle under `pool/<rank>/<n>` from it, so a pickle planted there ran code in the
worker. Here: no socket of the leader or its rank listens outside loopback; an
attacker that plants a pickle wherever it can reach (every non-loopback listener that
answers as a TCPStore; and, as if it could, the group's own store) runs nothing, the
resume it spoils fails cleanly and the next one works (defect 6)."""
from __future__ import annotations

import os
import pickle
import stat
from datetime import timedelta

import torch.distributed as dist

from engines.tp.runner import pool_key
from engines.tp.shared_pool import HandleError, open_buffer
from engines.tp.words import WordError, decode, encode
from tests.unit.inproc import InprocCluster
from tests.unit.listening import is_loopback, listening, reach

import pytest


class Touch:
    """A pickle that, when loaded, creates `path` (any code could run instead)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant_everywhere_reachable(listeners, key: str, value: bytes) -> list[int]:
    """Set `key` on every listener outside loopback that answers as a TCPStore: the
    ports an attacker on another host reaches. Returns the ports it planted into."""
    planted = []
    for address, port in listeners:
        if is_loopback(address):
            continue
        try:
            store = dist.TCPStore(reach(address), port, is_master=False,
                                  timeout=timedelta(seconds=2))
            store.set(key, value)
            planted.append(port)
        except (RuntimeError, OSError):
            pass                                   # not a store
    return planted


@pytest.fixture
def tp_decode():
    before = set(listening(os.getpid()))
    c = InprocCluster(tp=(1, 2))
    yield c, before
    c.close()


def test_the_rank_group_listens_on_loopback_only_and_runs_no_planted_pickle(tp_decode, tmp_path):
    c, before = tp_decode
    (rank1,) = c.decode.tp_procs
    listeners = [s for s in listening(os.getpid()) if s not in before] + listening(rank1.pid)
    exposed = [s for s in listeners if not is_loopback(s[0])]
    marker = tmp_path / "ran"
    evil = pickle.dumps(Touch(str(marker)))
    key = pool_key(1, c.decode.compute.runner.pools_made + 1)       # what the next resume reads
    planted = _plant_everywhere_reachable(listeners, key, evil)
    assert c.admin("release_memory")["ok"]
    c.admin("resume_memory")
    assert not marker.exists(), f"a planted pickle ran (planted through ports {planted})"
    assert exposed == [], f"the rank group listens outside loopback: {exposed}"
    c.serves_again()


def test_the_group_meets_in_a_private_store_and_reads_no_planted_pickle(tp_decode, tmp_path):
    """The group's store is a FileStore in a directory only this user may enter; even a
    pickle written into it under the next pool key (as only this user could) is not
    what rank 0 reads: it reads a rank's handle once the rank says it wrote it, and
    only as a JSON record (the handle tests below)."""
    c, _ = tp_decode
    tp, marker = c.decode.tp, tmp_path / "ran"
    folder = os.path.dirname(tp.rendezvous.path)
    mode = os.stat(folder)
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.geteuid()
    assert c.admin("release_memory")["ok"]
    tp.store.set(pool_key(1, c.decode.compute.runner.pools_made + 1), pickle.dumps(Touch(str(marker))))
    got = c.admin("resume_memory")
    assert got["ok"], got
    assert not marker.exists()
    c.serves_again()
    c.close()
    assert not os.path.exists(folder)          # the leader removes it when the ranks stop


@pytest.mark.parametrize("handle, named", [
    (b"\x80\x04K\x01.", "JSON record"),
    (b'{"kind": "file", "path": "/etc/passwd", "shape": [1], "dtype": "float32"}', "not a pool file"),
    (b'{"kind": "file", "path": "/dev/shm/zpd-kv-1-0000000a/../x", "shape": [1], "dtype": "float32"}',
     "not a pool file"),
    (b'{"kind": "file", "path": "/dev/shm/zpd-kv-1-0000000a", "shape": [1], "dtype": "object"}', "dtype"),
    (b'{"kind": "cuda", "size": [1]}', "IPC fields"),
])
def test_pool_handles_other_than_ours_are_refused(handle, named):
    with pytest.raises(HandleError, match=named):
        open_buffer(handle)


def test_a_pool_file_link_is_refused(tmp_path):
    """A name of ours that is a symlink (to a file the leader would then map) is refused."""
    link = "/dev/shm/zpd-kv-1-0123abcd"
    os.symlink(tmp_path / "target", link)
    try:
        (tmp_path / "target").write_bytes(b"\0" * 4)
        with pytest.raises(HandleError, match="not a pool file of this user"):
            open_buffer(f'{{"kind": "file", "path": "{link}", "shape": [1], "dtype": "float32"}}'
                        .encode())
    finally:
        os.unlink(link)


@pytest.mark.parametrize("word", [
    pickle.dumps(("forward", ("decode", ()))), b'["system", ["id"]]', b'["forward", ["__init__", {"tuple": []}]]',
    b'["clear_pages", [{"__reduce__": 1}]]', b'{"op": "stop"}',
])
def test_words_other_than_the_leaders_are_refused(word):
    with pytest.raises(WordError):
        decode(word)


def test_the_leaders_words_round_trip():
    from engines.prompt_logprobs import PromptLogprobAsk
    args = ("prefill_with_logprobs", ([[1, 2]], [[0]], [0], [PromptLogprobAsk(1, 2, (3,)), 4, None]))
    assert decode(encode("forward", args)) == ("forward", args)
    assert decode(encode("take_weights", ([("w", (2, 3), "float32", [(0, 2)])],))) == \
        ("take_weights", ([("w", (2, 3), "float32", [(0, 2)])],))
