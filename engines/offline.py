"""`zpd run`: one process, no disaggregation, the reference path.

It uses the same Compute and DecodeBatch as the decode worker, so greedy outputs of
the disaggregated path can be compared with it token for token.
"""
from __future__ import annotations

from collections import deque

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import LoadedModel
from engines.compute import Compute
from engines.batch import DecodeBatch
from engines.request import Request, Unservable, response, validate
from engines.tp.group import TpGroup


class OfflineEngine:
    def __init__(self, model: LoadedModel, kv_cache_mb: float = 256, page_size: int = 16,
                 max_batch: int = 64, max_prefill_tokens: int = 8192, tp: TpGroup | None = None,
                 routed_experts: bool = False, deterministic: bool = False) -> None:
        """`tp`: `model` is rank 0's part of a tensor-parallel group (engines/tp/).
        `routed_experts`: requests may ask for their routed experts (engines/routed.py).
        `deterministic`: --deterministic (engines/compute.py)."""
        layout = KVLayout.for_model(model.cfg, page_size, model.dtype)
        self.pool = KVPool.with_budget(layout, kv_cache_mb, model.dtype, model.device)
        self.compute = Compute(model, self.pool, tp, routed_experts, deterministic)
        self.batch = DecodeBatch(self.compute, max_batch)
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()

    def submit(self, req: Request) -> None:
        """Raises Unservable (400) for a request that can never be served."""
        validate(req.prompt, req.params, self.compute.model.cfg, self.pool.layout.page_size,
                 self.pool.num_pages, self.compute.routed_experts)
        try:
            self.compute.grammars.check(req.params.constraint)
        except ValueError as e:
            raise Unservable(str(e)) from None
        self.waiting.append(req)

    def step(self) -> list[Request]:
        """Admit and prefill what fits, then one decode step; returns finished requests."""
        admitted = self._admit()
        if admitted:
            self.compute.prefill(admitted)
        done = [r for r in admitted if r.finished]
        for r in admitted:
            if not r.finished:
                self.batch.add(r)
        done += [r for r in self.batch.step() if r.finished]
        for r in done:
            self.pool.allocator.free_pages(r.pages)
            r.pages = []
        return done

    def _admit(self) -> list[Request]:
        admitted, tokens = [], 0
        while self.waiting and len(self.batch) + len(admitted) < self.batch.max_batch:
            req = self.waiting[0]
            need = self.pool.pages_for(req.max_context)
            if not self.pool.allocator.can_alloc(need) or \
                    (admitted and tokens + len(req.prompt) > self.max_prefill_tokens):
                break
            self.waiting.popleft()
            req.pages = self.pool.allocator.alloc(need)
            admitted.append(req)
            tokens += len(req.prompt)
        return admitted

    def run(self, reqs: list[Request]) -> list[dict]:
        """Serve every request to the end; responses in submission order."""
        for r in reqs:
            self.submit(r)
        while self.waiting or len(self.batch):
            self.step()
        return [response(r, self.compute.model.tokenizer) for r in reqs]
