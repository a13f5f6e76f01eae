"""A worker's torch.distributed group with a trainer: joined from the trainer's
address, our rank and the world size, never as this process's default group, and
received from with broadcasts rooted at the trainer (rank 0).

The group is built from torch's public classes (the store from `rendezvous`, a
`PrefixStore`, `ProcessGroupGloo` or `ProcessGroupNCCL`). Every rank of a group must
use the same store keys, and the trainer decides them by how it creates its side:

- "init_custom_process_group" (the default): the trainer creates a named group as
  SGLang's `init_custom_process_group(..., group_name=G)` does (slime, AReaL and
  verl ship a copy): `rendezvous("tcp://A:P")`, `PrefixStore(G, store)`, a new group
  of the world size. Torch keys it "G/G/<device>/".
- "init_process_group" (an explicit option): the trainer calls
  `torch.distributed.init_process_group(backend, init_method="tcp://A:P", ...)`,
  keyed "default_pg/0/<device>/".

A cluster given fewer ranks than it has workers (AReaL's `sglang:d1`: one rank for
the whole server) joins through a relay (`join_group` with `relay`): one worker
joins the trainer's group and passes each broadcast on, as rank 0 of a second group
of its own with the workers that did not join (gloo on CPU, nccl on CUDA, built the
same way). That group meets on the trainer's store under a prefix of its own
("zpd-relay/<key>/"), so it needs no address or port of the cluster's: every worker
can already reach the trainer's store.

tests/unit/test_weight_sync.py joins a real trainer of each kind, so a torch
release that keys its groups differently fails there, not in a user's cluster.

torch's TCPStore client ignores its timeout while it waits for a server that
accepted the connection but never answers (measured with torch 2.13: a listening
socket that never speaks holds `rendezvous` past 60 s with a 3 s timeout), and gloo
aborts the process (SIGABRT) that receives a broadcast larger than its tensor. So a
worker never calls this module itself: its helper process does
(zpd/worker/weights/helper.py), and the worker kills the helper at its deadline.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("zpd.worker.weights.trainer_group")

BACKENDS = {"gloo": "cpu", "nccl": "cuda"}     # backend -> the device its keys name
DEFAULT_TRAINER_INIT = "init_custom_process_group"     # SGLang's keying


class GroupError(RuntimeError):
    """Joining or receiving failed (trainer gone, timeout, bad address)."""


def _store_prefix(store: dist.Store, trainer_init: str, name: str, device: str) -> dist.Store:
    if trainer_init == "init_process_group":
        group = dist.PrefixStore("0/", dist.PrefixStore("default_pg", store))
    else:
        group = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
    return dist.PrefixStore(f"{device}/", group)


def _group(backend: str, keys: dist.Store, rank: int, size: int, timeout: timedelta
           ) -> dist.ProcessGroup:
    if backend == "gloo":
        return dist.ProcessGroupGloo(keys, rank, size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(keys, rank, size, opts)


def join_group(name: str, backend: str, master_address: str, master_port: int, rank: int,
               world_size: int, trainer_init: str, timeout_s: float,
               relay: tuple[int, int, str] | None = None) -> "TrainerGroup":
    """What a worker's helper joins: the trainer's group as `rank`; with `relay` (its
    rank, size and key in the cluster's relay group) rank 0 joins it too and passes
    each broadcast on, the others join only the relay group."""
    if relay is None or relay[0] == 0:
        group = TrainerGroup.join(name, backend, master_address, master_port, rank, world_size,
                                  trainer_init, timeout_s)
        if relay is not None:
            group.downstream = TrainerGroup.join_relay(name, backend, master_address, master_port,
                                                       relay, timeout_s, group._store)
        return group
    return TrainerGroup.join_relay(name, backend, master_address, master_port, relay, timeout_s)


class TrainerGroup:
    """One joined group, in a weight-sync helper process; `downstream`: the relay
    group this helper passes each broadcast on to (as its rank 0)."""

    def __init__(self, name: str, backend: str, rank: int, world_size: int,
                 pg: dist.ProcessGroup, store: dist.Store) -> None:
        self.name, self.backend, self.rank, self.world_size = name, backend, rank, world_size
        self._pg, self._store = pg, store     # the store must live as long as the group
        self.device = torch.device(BACKENDS[backend])
        self.downstream: TrainerGroup | None = None

    @classmethod
    def join(cls, name: str, backend: str, master_address: str, master_port: int, rank: int,
             world_size: int, trainer_init: str, timeout_s: float) -> "TrainerGroup":
        """Block until every rank, the trainer included, has joined, or `timeout_s`."""
        if backend not in BACKENDS:
            raise GroupError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise GroupError("backend nccl needs CUDA and a torch built with NCCL; use gloo")
        host = f"[{master_address}]" if ":" in master_address else master_address
        timeout = timedelta(seconds=timeout_s)
        try:
            store, _, _ = next(dist.rendezvous(f"tcp://{host}:{master_port}", rank, world_size,
                                               timeout=timeout))
            store.set_timeout(timeout)
            keys = _store_prefix(store, trainer_init, name, BACKENDS[backend])
            pg = _group(backend, keys, rank, world_size, timeout)
        except (RuntimeError, ValueError, OSError) as e:     # DistStoreError is a RuntimeError
            raise GroupError(f"could not join group {name!r} at {host}:{master_port} as rank "
                             f"{rank}/{world_size}: {e}") from None
        log.warning("joined weight group %r (%s) at %s:%d as rank %d of %d",
                    name, backend, host, master_port, rank, world_size)
        return cls(name, backend, rank, world_size, pg, store)

    @classmethod
    def join_relay(cls, name: str, backend: str, master_address: str, master_port: int,
                   relay: tuple[int, int, str], timeout_s: float,
                   store: dist.Store | None = None) -> "TrainerGroup":
        """The cluster's relay group for trainer group `name`, met on the trainer's
        store (`store`, rank 0's from its own join; the others connect to it)."""
        rank, size, key = relay
        timeout = timedelta(seconds=timeout_s)
        try:
            if store is None:
                store = dist.TCPStore(master_address, master_port, is_master=False,
                                      timeout=timeout, wait_for_workers=False)
            keys = dist.PrefixStore(f"zpd-relay/{key}/", store)
            pg = _group(backend, keys, rank, size, timeout)
        except (RuntimeError, ValueError, OSError) as e:
            raise GroupError(f"could not join the relay of group {name!r} (on the trainer's "
                             f"store at {master_address}:{master_port}) as rank {rank}/{size}: "
                             f"{e}") from None
        log.warning("joined the relay of weight group %r (%s) as rank %d of %d",
                    name, backend, rank, size)
        return cls(f"{name} (relay)", backend, rank, size, pg, store)

    def receive(self, tensor: torch.Tensor, deadline: float) -> None:
        """Fill `tensor` from the trainer's next broadcast (the relay's, in the relay
        group), by monotonic `deadline`; a relay passes it on before returning."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = timedelta(seconds=max(0.5, deadline - time.monotonic()))
        try:
            self._pg.broadcast([tensor], opts).wait()
            if tensor.is_cuda:
                torch.cuda.current_stream().synchronize()
        except RuntimeError as e:
            raise GroupError(f"broadcast in group {self.name!r} failed: {e}") from None
        if self.downstream is not None:       # rank 0 there: the same broadcast sends
            self.downstream.receive(tensor, deadline)

    def close(self) -> None:
        """Tear the group down (its connections close with it), its relay first."""
        if self.downstream is not None:
            self.downstream.close()
            self.downstream = None
        pg, self._pg, self._store = self._pg, None, None
        shutdown = getattr(pg, "shutdown", None) if self.backend == "nccl" else None
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError as e:
                log.warning("closing weight group %r: %s", self.name, e)
        log.warning("weight group %r closed", self.name)
