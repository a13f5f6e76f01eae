"""The two sides of a tensor-parallel forward: the leader's runner, which tells the
other ranks each forward before running its own part, and the loop those ranks run
(a `Follower`: the leader's word, done in order, until it says stop)."""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager

import torch

from engines.kv.pool import KVLayout, KVPool
from engines.loader import LoadedModel
from engines.runner import ModelRunner
from engines.tp.group import TpGroup
from engines.tp.shard import apply_rows, update_part
from engines.weight_push import Shadow
from engines.tp.shared_pool import open_buffer, shared_buffer

log = logging.getLogger(__name__)


class TpRunner(ModelRunner):
    """Rank 0's runner: the other ranks make a pool like its own (which it opens too:
    `rank_buffers`, every rank's pool in rank order), then run each of its forwards
    with the same inputs; their logits are not computed (rank 0 samples)."""

    def __init__(self, model: LoadedModel, pool: KVPool, tp: TpGroup) -> None:
        super().__init__(model, pool, tp)
        self.tp = tp
        clears = pool.allocator.on_free
        self.pools_made = 0                 # each new set of the others' pools has its own keys
        tp.tell("make_pool", pool.layout.page_size, pool.num_pages, clears is not None)
        self.others = self._open_pools()
        if clears is not None:         # every rank's part of a freed page is zeroed
            pool.allocator.on_free = lambda pages: self._clear_everywhere(pages, clears)

    def _clear_everywhere(self, pages: list[int], clear_own) -> None:
        """Zero freed pages on every rank. Pages are freed from any handler of the loop:
        a group that fails here is marked broken (the worker stops) instead of raising
        into it, and our own part is zeroed regardless."""
        try:
            with self._group_errors():
                self.tp.tell("clear_pages", pages)
        except RuntimeError:
            pass                       # logged and marked by _group_errors
        clear_own(pages)

    def prefill_with_logprobs(self, *args):
        with self._group_errors():
            self.tp.tell("forward", "prefill_with_logprobs", args)
            return super().prefill_with_logprobs(*args)

    def decode(self, *args):
        with self._group_errors():
            self.tp.tell("forward", "decode", args)
            return super().decode(*args)

    @contextmanager
    def _group_errors(self):
        """A collective that fails (a rank died, or hung past the group's timeout) leaves
        the ranks out of step for good: the group is marked broken (its worker stops)."""
        try:
            yield
        except RuntimeError as e:
            if self.tp.broken is None:
                self.tp.broken = f"tensor-parallel group failed: {e}"
                log.error("%s", self.tp.broken)
            raise

    @property
    def rank_buffers(self) -> list[torch.Tensor]:
        """Every rank's pool buffer, rank 0's first (none while released)."""
        return [] if self.pool.buffer is None else [self.pool.buffer] + self.others

    def _open_pools(self) -> list[torch.Tensor]:
        self.pools_made += 1
        return [open_buffer(self.tp.store.get(pool_key(r, self.pools_made)))
                for r in range(1, self.tp.size)]

    def release_kv(self) -> None:
        """Every other rank drops its pool (rank 0 drops its own and its views)."""
        self.tp.tell("release_kv")
        self.others = []

    def resume_kv(self) -> None:
        """Every other rank makes its pool again, at new addresses rank 0 opens."""
        self.tp.tell("resume_kv", self.pools_made + 1)
        self.others = self._open_pools()

    def release_weights(self) -> None:
        self.tp.tell("release_weights")

    def resume_weights(self) -> None:
        self.tp.tell("resume_weights")

    def whole_template(self) -> torch.nn.Module:
        """The whole model's parameters by name and shape, holding no memory (the meta
        device): what a trainer's push is checked against and staged as."""
        from engines.models.llama import LlamaForCausalLM
        with torch.device("meta"):
            return LlamaForCausalLM(self.model.shard.whole).to(self.model.dtype)

    def commit_weights(self, shadow: Shadow, written: list) -> int:
        """A trainer's push, staged whole in `shadow` on this rank: each rank takes the
        rows of its part the push wrote. The whole tensors travel to the other ranks on
        the group (one broadcast each, in the order told). Returns elements written."""
        rows = shadow.written_rows(written)
        items = [(name, tuple(shadow.copy[name].shape), str(shadow.copy[name].dtype), spans)
                 for name, spans in rows.items()]
        self.tp.tell("take_weights", items)
        params, (whole, plan) = dict(self.model.net.named_parameters()), \
            (self.model.shard.whole, self.model.shard.plan)
        for name, _, _, spans in items:
            staged = shadow.copy[name].to(self.model.device)     # where the group's collectives run
            self.tp.broadcast(staged)
            apply_rows(params[name], name, staged, spans, whole, plan)
        return sum(math.prod(a.shape) for a in written if a.where is not None)

    def update_weights(self, path: str, version: str | None) -> str:
        """Every rank's part from checkpoint `path`. Rank 0 loads first: a checkpoint it
        refuses changes nothing anywhere; the others then read the same files."""
        got = update_part(self.model, path, version)
        self.tp.tell("update_weights", path, version)
        return got


def pool_key(rank: int, made: int) -> str:
    return f"pool/{rank}/{made}"


class Follower:
    """A rank other than 0: its part of the model and of every page, and nothing else.
    Pages are named by the leader (its allocator is the only one); this rank's pool
    has the same pages, holding its own heads."""

    def __init__(self, model: LoadedModel, tp: TpGroup) -> None:
        self.model, self.tp = model, tp
        self.pool: KVPool | None = None
        self.runner: ModelRunner | None = None
        self.weights_held = None                 # engines.weight_release.Released

    def make_pool(self, page_size: int, num_pages: int, clear_on_free: bool) -> None:
        m = self.model
        layout = KVLayout.for_model(m.cfg, page_size, m.dtype)
        self.pool = KVPool(layout, num_pages, m.dtype, m.device, clear_on_free,
                           self._shared(layout.pool_shape(num_pages), 1))
        self.runner = ModelRunner(m, self.pool, self.tp)

    def _shared(self, shape: tuple[int, ...], made: int) -> torch.Tensor:
        buffer, handle = shared_buffer(shape, self.model.dtype, self.model.device)
        self.tp.store.set(pool_key(self.tp.rank, made), handle)
        return buffer

    def release_kv(self) -> None:
        self.pool.release_memory()

    def resume_kv(self, made: int) -> None:
        self.pool.allocate_memory(self._shared(self.pool.shape, made))

    def release_weights(self) -> None:
        from engines import weight_release
        self.weights_held = weight_release.release(self.model.net, self.model.device)

    def resume_weights(self) -> None:
        from engines import weight_release
        held, self.weights_held = self.weights_held, None
        weight_release.resume(held)

    def forward(self, name: str, args: tuple) -> None:
        getattr(ModelRunner, name)(self.runner, *args)

    def clear_pages(self, pages: list[int]) -> None:
        self.pool.clear_pages(pages)

    def update_weights(self, path: str, version: str | None) -> None:
        update_part(self.model, path, version)

    def take_weights(self, items: list) -> None:
        """The rows of a trainer's push the leader says, from its broadcasts in order."""
        params = dict(self.model.net.named_parameters())
        whole, plan = self.model.shard.whole, self.model.shard.plan
        for name, shape, dtype, spans in items:
            staged = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                                 device=self.model.device)
            self.tp.broadcast(staged)
            apply_rows(params[name], name, staged, spans, whole, plan)

    def serve(self) -> None:
        """Do the leader's word until it says stop."""
        while True:
            op, args = self.tp.hear()
            if op == "stop":
                log.info("rank %d: stopped by the leader", self.tp.rank)
                return
            getattr(self, op)(*args)
