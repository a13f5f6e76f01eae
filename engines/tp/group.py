"""A tensor-parallel group as the engine uses it: its rank and size, the process group
the model's all-reduces run on, and the leader's word to the others.

Rank 0, the leader, owns everything that is not a forward: requests, pages, sampling,
sockets. It `tell`s the other ranks each thing they must do too (a forward with its
inputs, pages to clear, weights to load) and they do it in the same order; the
all-reduces inside a forward then meet. The word travels on a gloo group of its own,
so that on CUDA the model's collectives stay on NCCL.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta

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

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def tell(self, op: str, *args: object) -> None:
        """Leader: have every other rank do `op(*args)` (engines/tp/runner.py Follower)."""
        assert self.leads, "only rank 0 tells"
        dist.broadcast_object_list([(op, args)], src=0, group=self.words)

    def hear(self) -> tuple[str, tuple]:
        """Other ranks: the leader's next word."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.words)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join(rank: int, size: int, port: int, device_type: str = "cpu", host: str = "127.0.0.1",
         timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TpGroup:
    """Join the group of `size` ranks meeting at host:port (rank 0 listens there)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=size, timeout=timeout)
    words = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    log.info("tensor-parallel rank %d of %d joined (%s)", rank, size, backend)
    return TpGroup(rank, size, dist.group.WORLD, words)
