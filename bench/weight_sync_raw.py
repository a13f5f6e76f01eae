"""bench_weight_sync.py's raw baseline: this process as rank 0 of a gloo group of its own
broadcasting to one receiver process per cluster worker, into buffers they allocated
and touched up front (or fresh ones, as a worker's staging does)."""
from __future__ import annotations

import multiprocessing as mp
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

STOP, TENSORS, BUCKETS, FRESH = 0, 1, 2, 3           # the receivers' commands
Weights = dict[str, torch.Tensor]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_group(port: int, rank: int, world: int, timeout_s: float) -> tuple[dist.ProcessGroup, dist.Store]:
    """A gloo group of its own (not the default one, which the cluster push uses)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, world, timeout), store


def broadcast(pg: dist.ProcessGroup, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([t], opts).wait()


def receiver(port: int, rank: int, world: int, specs: list[tuple[list[int], torch.dtype]],
             bucket_bytes: list[int], timeout_s: float) -> None:
    """A raw rank: receive into preallocated (touched) buffers until told to stop."""
    torch.set_num_threads(1)
    pg, _store = raw_group(port, rank, world, timeout_s)
    bufs = [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
    flat = torch.zeros(max(bucket_bytes), dtype=torch.uint8)
    cmd, ack = torch.zeros(1, dtype=torch.int64), torch.zeros(1)
    while True:
        broadcast(pg, cmd)
        kind, kept = cmd.item(), []
        if kind == STOP:
            return
        if kind == FRESH:            # kept until the ack, as staging is until the commit
            for shape, dtype in specs:
                kept.append(torch.empty(shape, dtype=dtype))
                broadcast(pg, kept[-1])
        else:
            for t in bufs if kind == TENSORS else [flat[:n] for n in bucket_bytes]:
                broadcast(pg, t)
        pg.allreduce([ack]).wait()


class RawBaseline:
    """This process as rank 0 of a gloo group with `receivers` receiver processes."""

    def __init__(self, receivers: int, tensors: Weights, bucket_bytes: list[int],
                 timeout_s: float) -> None:
        port, world = free_port(), receivers + 1
        specs = [(list(t.shape), t.dtype) for t in tensors.values()]
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=receiver, daemon=True,
                                  args=(port, r, world, specs, bucket_bytes, timeout_s))
                      for r in range(1, world)]
        self.pg, self.store = None, None
        for p in self.procs:
            p.start()
        try:
            self.pg, self.store = raw_group(port, 0, world, timeout_s)
        except RuntimeError:
            self.close()
            raise

    def send(self, parts: list[torch.Tensor], kind: int) -> float:
        """Seconds from the first broadcast of `parts` to every receiver's ack."""
        broadcast(self.pg, torch.tensor([kind], dtype=torch.int64))
        started = time.perf_counter()
        for t in parts:
            broadcast(self.pg, t)
        self.pg.allreduce([torch.zeros(1)]).wait()
        return time.perf_counter() - started

    def close(self) -> None:
        try:
            if self.pg is not None:
                broadcast(self.pg, torch.tensor([STOP], dtype=torch.int64))
        except RuntimeError:          # a receiver gone: the ones left are killed below
            pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
