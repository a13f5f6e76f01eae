"""A trainer's side of weight sync, on threads of the test process: rank 0 of a real
torch.distributed gloo group on loopback, made the way SGLang-based frameworks do
(`init_custom_process_group`, a named group that is not the default one: zpd's
default) or with torch's `init_process_group` (zpd's explicit option)."""
from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _new_process_group_helper, _world


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sglang_style_group(address: str, port: int, world_size: int, group_name: str, backend: str,
                       timeout: timedelta) -> dist.ProcessGroup:
    """Rank 0 of a named group built the way SGLang's init_custom_process_group builds
    it (slime, AReaL and verl carry that helper): the rendezvous store at
    tcp://address:port, a PrefixStore named after the group over it, and a new group
    of `world_size` made by torch's `_new_process_group_helper`, which those frameworks
    call (torch has no public call that makes a named group over a given store; the
    keys it writes are what the workers must match), registered so `dist.broadcast`
    takes it."""
    store, _, _ = next(dist.rendezvous(f"tcp://{address}:{port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, 0, [], backend,
                                         dist.PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class Trainer:
    """Rank 0. `join` and `push` run on a thread (the workers join and receive at the
    same time); `wait` returns what the thread raised, if anything."""

    def __init__(self, world_size: int, trainer_init: str = "init_custom_process_group",
                 group_name: str = "g", timeout_s: float = 30.0) -> None:
        self.port, self.world_size = free_port(), world_size
        self.trainer_init, self.group_name = trainer_init, group_name
        self.timeout = timedelta(seconds=timeout_s)
        self.group = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _run(self, fn) -> None:
        def body() -> None:
            try:
                fn()
            except BaseException as e:       # handed to the test by `wait`
                self.error = e
        self.error = None
        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def wait(self, timeout: float = 60.0) -> BaseException | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the trainer thread is stuck"
        return self.error

    def join(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        if self.trainer_init == "init_process_group":
            self._run(lambda: dist.init_process_group("gloo", init_method=url, rank=0,
                                                      world_size=self.world_size,
                                                      timeout=self.timeout))
        else:
            self._run(self._custom_group)

    def _custom_group(self) -> None:
        self.group = sglang_style_group("127.0.0.1", self.port, self.world_size, self.group_name,
                                        "gloo", self.timeout)

    def push(self, tensors: list[torch.Tensor], bucket: bool = False, stop_after: int | None = None) -> None:
        """Broadcast `tensors` (one flat bucket with `bucket`); with `stop_after`, the
        trainer dies after that many broadcasts: its group closes under the workers."""
        def body() -> None:
            if bucket:
                flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
                dist.broadcast(flat, src=0, group=self.group)
                return
            for i, t in enumerate(tensors):
                if stop_after is not None and i == stop_after:
                    self.close()
                    return
                dist.broadcast(t.contiguous(), src=0, group=self.group)
        self._run(body)

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        elif dist.is_initialized():
            dist.destroy_process_group()


def announce(tensors: dict[str, torch.Tensor]) -> dict:
    """The body of update_weights_from_distributed for `tensors`, in their order."""
    return {"names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.")
                                               for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}
