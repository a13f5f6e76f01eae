"""A tensor-parallel group as the engine uses it: its rank and size, the process group
the model's all-reduces run on, and the leader's word to the others.

Rank 0, the leader, owns everything that is not a forward: requests, pages, sampling,
sockets. It `tell`s the other ranks each thing they must do too (a forward with its
inputs, pages to clear, weights to load) and they do it in the same order; the
all-reduces inside a forward then meet. The word travels on a gloo group of its own,
so that on CUDA the model's collectives stay on NCCL.

The groups are process-group objects of their own, not torch.distributed's one global
group: a process may lead several (tests run a prefill and a decode in one process).
"""
from __future__ import annotations

import logging
import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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
        assert self.leads, "only rank 0 tells"
        data = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.words.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0).wait()
        self.words.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()

    def hear(self) -> tuple[str, tuple]:
        """Other ranks: the leader's next word (the leader is trusted: same worker)."""
        n = torch.zeros(1, dtype=torch.int64)
        self.words.broadcast(n, 0).wait()
        data = torch.empty(int(n[0]), dtype=torch.uint8)
        self.words.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join(rank: int, size: int, port: int, device_type: str = "cpu", host: str = "127.0.0.1",
         timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TpGroup:
    """Join the group of `size` ranks meeting at host:port (rank 0 listens there)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
    words = dist.ProcessGroupGloo(dist.PrefixStore("words", store), rank, size, timeout)
    if device_type == "cuda":
        group = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, size)
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore("model", store), rank, size, timeout)
    log.info("tensor-parallel rank %d of %d joined (%s)", rank, size,
             "nccl" if device_type == "cuda" else "gloo")
    return TpGroup(rank, size, group, words, store)
