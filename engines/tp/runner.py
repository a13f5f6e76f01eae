"""The two sides of a tensor-parallel forward: the leader's runner, which tells the
other ranks each forward before running its own part, and the loop those ranks run
(a `Follower`: the leader's word, done in order, until it says stop)."""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Protocol

import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import LoadedModel
from engines.runner import ModelRunner
from engines.tp.group import TpGroup
from engines.tp.words import ASKED
from engines.tp.shard import apply_rows, read_whole, swap_part
from engines.tp.shared_pool import HandleError, open_buffer, shared_buffer

log = logging.getLogger(__name__)


class StagedPush(Protocol):
    """A trainer's push staged whole (engines/weights/push.py's Shadow): the copies by
    parameter name, and the rows of each that the push wrote."""
    copy: dict[str, torch.Tensor]

    def written_rows(self, written: list) -> dict[str, list[tuple[int, int]]]: ...


class TpRunner(ModelRunner):
    """Rank 0's runner: the other ranks make a pool like its own (which it opens too:
    `rank_buffers`, every rank's pool in rank order), then run each of its forwards
    with the same inputs; their logits are not computed (rank 0 samples)."""

    def __init__(self, model: LoadedModel, pool: KVPool, tp: TpGroup) -> None:
        super().__init__(model, pool, tp)
        self.tp = tp
        clears = pool.allocator.on_free
        self.pools_made = 1                 # each new set of the others' pools has its own keys
        failed = tp.ask("make_pool", pool.layout.page_size, pool.num_pages, clears is not None)
        self.others = self._open_pools(failed)
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

    def _open_pools(self, failed: list[int] = ()) -> list[torch.Tensor]:
        """The other ranks' new pools (set number `pools_made`), or a RuntimeError naming
        the ranks that made none or whose handle we refuse; the ranks that made one then
        drop it again, so every rank is as before (released)."""
        failed, opened = list(failed), []
        for r in range(1, self.tp.size):
            if r in failed:
                continue
            try:
                opened.append(open_buffer(self.tp.store.get(pool_key(r, self.pools_made))))
            except (HandleError, OSError, RuntimeError) as e:
                log.error("rank %d's KV pool cannot be opened here: %s", r, e)
                failed.append(r)
        if failed:
            self.tp.ask("release_kv")
            raise RuntimeError(f"tensor-parallel rank(s) {sorted(failed)} could not make their "
                               "KV pool (their log says why)")
        return opened

    def release_kv(self) -> None:
        """Every other rank drops its pool (rank 0 drops its own and its views)."""
        self.tp.ask("release_kv")
        self.others = []

    def resume_kv(self) -> None:
        """Every other rank makes its pool again, at new addresses rank 0 opens. A
        RuntimeError if any rank could not: then no rank holds a pool (as before)."""
        failed = self.tp.ask("resume_kv", self.pools_made + 1)
        self.pools_made += 1
        self.others = self._open_pools(failed)

    def release_weights(self) -> None:
        """Every other rank releases its weights, or (a RuntimeError) none keeps them
        released."""
        failed = self.tp.ask("release_weights")
        if failed:
            self.tp.ask("resume_weights")
            raise RuntimeError(f"tensor-parallel rank(s) {failed} could not release their "
                               "weights (their log says why)")

    def resume_weights(self) -> None:
        """Every other rank's weights back; a RuntimeError if any rank could not, and
        then every other rank's are released again (as before)."""
        failed = self.tp.ask("resume_weights")
        if failed:
            self.tp.ask("release_weights")
            raise RuntimeError(f"tensor-parallel rank(s) {failed} could not restore their "
                               "weights (their log says why)")

    def whole_template(self) -> torch.nn.Module:
        """The whole model's parameters by name and shape, holding no memory (the meta
        device): what a trainer's push is checked against and staged as."""
        from engines.models.llama import LlamaForCausalLM
        with torch.device("meta"):
            return LlamaForCausalLM(self.model.shard.whole).to(self.model.dtype)

    def commit_weights(self, shadow: StagedPush, written: list) -> int:
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
        """Every rank's part from checkpoint `path`, all or none: rank 0 reads it first
        (a checkpoint it refuses changes nothing anywhere), then every other rank reads
        it beside its weights and says whether it could; only when all could does every
        rank swap its part in. A rank that could not (no memory, a file gone) leaves
        every rank on its old weights and the group in step."""
        whole = read_whole(self.model, path)
        failed = self.tp.ask("stage_weights", path)
        if failed:
            self.tp.tell("drop_staged")
            raise RuntimeError(f"tensor-parallel rank(s) {failed} could not read {path} "
                               "(their log says why): every rank keeps its weights")
        self.tp.tell("swap_staged", version)
        return swap_part(self.model, whole, version)


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
        self.staged = None                       # a checkpoint read, not yet swapped in

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
        if self.pool is not None:              # (none if making it failed)
            self.pool.release_memory()

    def resume_kv(self, made: int) -> None:
        self.pool.allocate_memory(self._shared(self.pool.shape, made))

    def release_weights(self) -> None:
        from engines import weight_release
        if self.weights_held is None:          # (a rank whose resume failed still holds them)
            self.weights_held = weight_release.release(self.model.net, self.model.device)

    def resume_weights(self) -> None:
        from engines import weight_release
        if self.weights_held is not None:
            weight_release.resume(self.weights_held)     # on an error they stay released
            self.weights_held = None

    def forward(self, name: str, args: tuple) -> None:
        getattr(ModelRunner, name)(self.runner, *args)

    def clear_pages(self, pages: list[int]) -> None:
        self.pool.clear_pages(pages)

    def stage_weights(self, path: str) -> None:
        self.staged = None                      # (one staged checkpoint at most in memory)
        self.staged = read_whole(self.model, path)

    def swap_staged(self, version: str | None) -> None:
        whole, self.staged = self.staged, None
        swap_part(self.model, whole, version)

    def drop_staged(self) -> None:
        self.staged = None

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
        """Do the leader's word until it says stop. A word the leader asks about
        (`TpGroup.ask`) is answered: an error there is this rank's failure to report,
        not the group's end; any other error ends this rank (and so the worker)."""
        while True:
            op, args = self.tp.hear()
            if op == "stop":
                log.info("rank %d: stopped by the leader", self.tp.rank)
                return
            if op not in ASKED:
                getattr(self, op)(*args)
                continue
            try:
                getattr(self, op)(*args)
                failed = False
            except (OSError, RuntimeError, ValueError, MemoryError) as e:
                log.error("rank %d: %s failed: %s", self.tp.rank, op, e)
                failed = True
            self.tp.answer(failed)
