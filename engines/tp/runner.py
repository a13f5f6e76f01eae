"""The two sides of a tensor-parallel forward: the leader's runner, which tells the
other ranks each forward before running its own part, and the loop those ranks run
(a `Follower`: the leader's word, done in order, until it says stop)."""
from __future__ import annotations

import logging

from engines.kv.pool import KVLayout, KVPool
from engines.loader import LoadedModel
from engines.runner import ModelRunner
from engines.tp.group import TpGroup

log = logging.getLogger(__name__)


class TpRunner(ModelRunner):
    """Rank 0's runner: the other ranks make a pool like its own, then run each of its
    forwards with the same inputs (their logits are not computed: rank 0 samples)."""

    def __init__(self, model: LoadedModel, pool: KVPool, tp: TpGroup) -> None:
        super().__init__(model, pool, tp)
        self.tp = tp
        clears = pool.allocator.on_free
        tp.tell("make_pool", pool.layout.page_size, pool.num_pages, clears is not None)
        if clears is not None:         # every rank's part of a freed page is zeroed
            pool.allocator.on_free = lambda pages: (tp.tell("clear_pages", pages), clears(pages))

    def prefill_with_logprobs(self, *args):
        self.tp.tell("forward", "prefill_with_logprobs", args)
        return super().prefill_with_logprobs(*args)

    def decode(self, *args):
        self.tp.tell("forward", "decode", args)
        return super().decode(*args)


class Follower:
    """A rank other than 0: its part of the model and of every page, and nothing else.
    Pages are named by the leader (its allocator is the only one); this rank's pool
    has the same pages, holding its own heads."""

    def __init__(self, model: LoadedModel, tp: TpGroup) -> None:
        self.model, self.tp = model, tp
        self.pool: KVPool | None = None
        self.runner: ModelRunner | None = None

    def make_pool(self, page_size: int, num_pages: int, clear_on_free: bool) -> None:
        m = self.model
        self.pool = KVPool(KVLayout.for_model(m.cfg, page_size, m.dtype), num_pages, m.dtype,
                           m.device, clear_on_free)
        self.runner = ModelRunner(m, self.pool, self.tp)

    def forward(self, name: str, args: tuple) -> None:
        getattr(ModelRunner, name)(self.runner, *args)

    def clear_pages(self, pages: list[int]) -> None:
        self.pool.clear_pages(pages)

    def serve(self) -> None:
        """Do the leader's word until it says stop."""
        while True:
            op, args = self.tp.hear()
            if op == "stop":
                log.info("rank %d: stopped by the leader", self.tp.rank)
                return
            getattr(self, op)(*args)
