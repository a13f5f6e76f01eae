"""A tensor-parallel group as the engine uses it: its rank and size, the process group
the model's all-reduces run on, and the leader's word to the others.

Rank 0, the leader, owns everything that is not a forward: requests, pages, sampling,
sockets. It `tell`s the other ranks each thing they must do too (a forward with its
inputs, pages to clear, weights to load) and they do it in the same order; the
all-reduces inside a forward then meet. The word travels on a gloo group of its own,
so that on CUDA the model's collectives stay on NCCL.

The groups are process-group objects of their own, not torch.distributed's one global
group: a process may lead several (tests run a prefill and a decode in one process).

Nothing of the group is reachable from another host or user (issue 43): every rank of
a worker runs on one host, started by its leader, so the ranks meet in a FileStore in
a directory only the leader's user can enter (`Rendezvous`), never a TCP store, and
gloo's sockets bind 127.0.0.1 only. The leader's words are data (engines/tp/words.py),
never a pickle.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engines.tp import words as word_codec

log = logging.getLogger(__name__)

# How long a rank waits in a collective for the others: a rank that died or hangs
# fails its worker after this, rather than never.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass
class TpGroup:
    rank: int
    size: int
    group: object          # the model's collectives (gloo on CPU, NCCL on CUDA)
    words: object          # the leader's word to the others (always gloo)
    store: object          # the rendezvous both were made from (kept alive with them)
    broken: str | None = None    # why the group cannot go on (a rank died or timed out)
    stopped: bool = False        # the leader told the others to stop: their exit is no failure
    rendezvous: object = None    # leader: the Rendezvous it made (spawn.stop removes it)
    watchdog: object = None      # leader: engines/tp/heartbeat.py Watchdog of the others

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        self.group.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x from rank 0 into every rank's x, in place (on the model's collectives)."""
        self.group.broadcast(x, 0).wait()
        return x

    def tell(self, op: str, *args: object) -> None:
        """Leader: have every other rank do `op(*args)` (engines/tp/runner.py Follower)."""
        assert op not in word_codec.ASKED, f"{op} is answered: ask it"
        self._send(op, args)

    def _send(self, op: str, args: tuple) -> None:
        assert self.leads, "only rank 0 tells"
        data = word_codec.encode(op, args)
        self.words.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0).wait()
        self.words.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()

    def ask(self, op: str, *args: object) -> list[int]:
        """Leader: `tell`, then the ranks that answered that they failed it (the words
        a rank answers: engines/tp/words.py ASKED)."""
        assert op in word_codec.ASKED, f"{op} is not answered: tell it"
        self._send(op, args)
        flags = torch.zeros(self.size, dtype=torch.int64)
        self.words.allreduce([flags]).wait()
        return [r for r in range(1, self.size) if flags[r]]

    def answer(self, failed: bool) -> None:
        """Other ranks: whether they failed what the leader asked."""
        flags = torch.zeros(self.size, dtype=torch.int64)
        flags[self.rank] = int(failed)
        self.words.allreduce([flags]).wait()

    def hear(self) -> tuple[str, tuple]:
        """Other ranks: the leader's next word (a WordError if it is not one)."""
        n = torch.zeros(1, dtype=torch.int64)
        self.words.broadcast(n, 0).wait()
        data = torch.empty(int(n[0]), dtype=torch.uint8)
        self.words.broadcast(data, 0).wait()
        return word_codec.decode(data.numpy().tobytes())


LOOPBACK = "127.0.0.1"


class Rendezvous:
    """Where a worker's ranks meet: a FileStore in a new directory of the leader's (mode
    0700, so no other user can read or plant a key), removed by `close`. Every rank is a
    child of the leader on its host, so no socket is needed to meet."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="zpd-tp-")
        self.path = os.path.join(self.folder, "store")

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _gloo(store: object, rank: int, size: int, timeout: timedelta) -> object:
    """A gloo group whose sockets listen on loopback only (the default device binds the
    address the host name resolves to, reachable from other hosts)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def join(rank: int, size: int, rendezvous: str, device_type: str = "cpu",
         timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TpGroup:
    """Join the group of `size` ranks meeting at the FileStore `rendezvous` (a
    `Rendezvous`'s path)."""
    if not Path(rendezvous).parent.is_dir():
        raise RuntimeError(f"tensor-parallel rendezvous {rendezvous} is gone")
    timeout = timedelta(seconds=timeout_s)
    store = dist.FileStore(rendezvous, size)
    store.set_timeout(timeout)
    words = _gloo(dist.PrefixStore("words", store), rank, size, timeout)
    if device_type == "cuda":
        group = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, size)
    else:
        group = _gloo(dist.PrefixStore("model", store), rank, size, timeout)
    log.info("tensor-parallel rank %d of %d joined (%s)", rank, size,
             "nccl" if device_type == "cuda" else "gloo")
    return TpGroup(rank, size, group, words, store)
