"""A worker's weights and KV memory as admin commands: update_weights,
update_weight_version, release_memory, resume_memory, flush_cache.

release_memory / resume_memory take SGLang's `tags`: "kv_cache" (the KV pool),
"weights" (the model's weights: engines/weight_release.py; resumed from a host copy
on CUDA or a private spill file on CPU, bit for bit, never by a weight update), and
"cuda_graph" (zpd has none: accepted, nothing to do). No tags: all of them. While
either is released nothing is scheduled: requests wait, as while paused, and
`continue` is refused (the core's `gate`, zpd/worker/core.py). A resume that fails
(on any tensor-parallel rank) leaves what it could not restore released everywhere
and says so: it can be sent again."""
from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch

import transport
from engines import weight_release
from engines.config import ModelError
from engines.kv.pool import KVPool
from engines.loader import LoadedModel
from engines.text import SMOLLM2
from engines.loader import update_weights as load_new_weights
from engines.models.tiny import is_tiny
from engines.models.null import is_null
from engines.weight_read import first_rows
from zpd.wire.admin import (FlushCache, GetWeights, ReleaseMemory, ResumeMemory, UpdateWeights,
                            UpdateWeightVersion)
from zpd.wire.admin_fields import KV_CACHE, WEIGHTS
from zpd.wire.admin_reply import Flushed, MemoryState, VersionChanged, WeightValues, WeightVersion
from zpd.wire.status import BAD_REQUEST, CONFLICT, INTERNAL, StatusError
from engines.tp.runner import TpRunner
from zpd.worker.scheduler import Respond

log = logging.getLogger("zpd.worker.memory")

FORBIDDEN = 403


def checkpoint_source(path: str, root: str | None) -> str:
    """Where `update_weights` may load `path` from: anywhere without a root; with one,
    only a directory that resolves (symlinks and .. followed) under it, relative paths
    taken from it. The refusal reads the same whether `path` exists or not, so it
    cannot be used to map the host's directories. `tiny` and `null` specs touch no file."""
    if "\0" in path:                  # no file has one; realpath would raise
        raise StatusError(BAD_REQUEST, "update_weights: the path holds a NUL character")
    if root is None or is_tiny(path) or is_null(path) or path == SMOLLM2:
        return path
    base = os.path.realpath(root)
    real = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([base, real]) != base:
        raise StatusError(FORBIDDEN, f"update_weights: {path!r} is not under this worker's "
                                     "--weights-root")
    return real


@dataclass(frozen=True)
class MemoryPort:
    """What the memory commands act on: the worker's model, pool and transport, and its
    scheduler's answers as callables (the scheduler is attached after the core is built).
    The core builds it (`WorkerCore.__init__`); a test may hand fakes."""
    model: LoadedModel
    pool: KVPool
    backend: transport.Backend
    ranks: TpRunner | None                          # the other tensor-parallel ranks, if any
    weights_root: str | None                        # --weights-root
    long_call: Callable[[], AbstractContextManager]  # pings answered meanwhile
    rank_buffers: Callable[[], list[torch.Tensor]]  # every rank's KV pool, in rank order
    running_unpaused: Callable[[], bool]            # requests run and no pause holds them
    busy: Callable[[], bool]                        # requests are in flight, paused or not
    dropping: Callable[[], bool]                    # a retract or abort pause is in force
    set_weights: Callable[[str | None], str]        # the weight version's one writer
    flush_cache: Callable[[], int]                  # cached pages no request uses dropped
    pages_in_use: Callable[[], int]                 # held, fenced or cached
    memory_released: Callable[[], None]             # the scheduler lets go of the pool
    memory_resumed: Callable[[], None]              # the pool is back at a new address


class WeightsAndMemory:
    """The commands that change what the worker holds, not its requests."""

    def __init__(self, port: MemoryPort) -> None:
        self.port = port
        self.kv_released = False            # KV pool dropped
        self.weights_held: weight_release.Released | None = None   # weights dropped

    def commands(self) -> dict[type, Callable[..., None]]:
        return {UpdateWeights: self.update_weights, FlushCache: self.flush_cache,
                UpdateWeightVersion: self.update_weight_version, GetWeights: self.get_weights,
                ReleaseMemory: self.release_memory, ResumeMemory: self.resume_memory}

    @property
    def released(self) -> bool:
        """The KV pool or the weights are released: schedule nothing."""
        return self.kv_released or self.weights_held is not None

    @property
    def state(self) -> str:
        """The KV pool's memory."""
        return "released" if self.kv_released else "resident"

    @property
    def weights_state(self) -> str:
        return "released" if self.weights_held is not None else "resident"

    @property
    def pool_addr(self) -> int:
        """The pool's address, 0 while its memory is released."""
        return 0 if self.kv_released else self.port.pool.data_ptr

    def require_weights(self, what: str) -> None:
        """409 while the weights are released (a copy into them would fail)."""
        if self.weights_held is not None:
            raise StatusError(CONFLICT, f"{what} while the weights are released: "
                                        "resume_memory (tags weights) first")

    def require_resident(self, what: str) -> None:
        """409 while the KV pool or the weights are released: `continue` would leave every
        request waiting for memory that is not there."""
        if self.released:
            raise StatusError(CONFLICT, f"{what} while memory is released (KV pool {self.state}, "
                                        f"weights {self.weights_state}): resume_memory first")

    def update_weights(self, cmd: UpdateWeights, respond: Respond) -> None:
        """Allowed while paused or idle; a bad checkpoint leaves the old weights. Without
        a version the current one stays (SGLang's way)."""
        port = self.port
        path, version = cmd.path, cmd.weight_version
        source = checkpoint_source(path, port.weights_root)
        if port.running_unpaused():
            raise StatusError(CONFLICT, "update_weights while requests are running: pause first")
        self.require_weights("update_weights")
        try:
            with port.long_call():       # every tensor-parallel rank loads its part
                new = port.ranks.update_weights(source, version) if port.ranks else \
                    load_new_weights(port.model, source, version)
        except (ModelError, ValueError) as e:
            raise StatusError(BAD_REQUEST, str(e)) from None
        port.set_weights(new)
        log.warning("weights updated from %r: version %r", path, new)
        respond(True, WeightVersion(new))

    def update_weight_version(self, cmd: UpdateWeightVersion, respond: Respond) -> None:
        """Set the version the next tokens report; the weights stay as they are (SGLang's
        /update_weight_version, after a push that named no version). The prefix cache
        is keyed by version, so its entries are dropped as after an update."""
        version = cmd.weight_version
        old = self.port.model.version
        self.port.set_weights(version)
        log.warning("weight version %r -> %r (weights unchanged)", old, version)
        respond(True, VersionChanged(version, old))

    def get_weights(self, cmd: GetWeights, respond: Respond) -> None:
        """SGLang's get_weights_by_name: the first rows of one weight, as float32 values
        in nested lists. At --tp > 1 each rank holds only its part: refused."""
        self.require_weights("get_weights_by_name")
        if self.port.ranks is not None:
            raise StatusError(BAD_REQUEST, "get_weights_by_name reads a worker at --tp 1; "
                                           "this worker's weights are split over its ranks")
        try:
            rows = first_rows(self.port.model.net, cmd.name, cmd.truncate_size)
        except ModelError as e:
            raise StatusError(BAD_REQUEST, str(e)) from None
        respond(True, WeightValues(rows.detach().to("cpu", torch.float32).tolist()))

    def flush_cache(self, cmd: FlushCache, respond: Respond) -> None:
        """Drop the prefix cache; refused while requests run unpaused (as SGLang does).
        While paused it is allowed (a trainer's pause -> flush -> push): held requests
        keep their pages, a retracted one holds none, as for a push's invalidate."""
        if self.port.running_unpaused():
            raise StatusError(CONFLICT, "flush_cache while requests are running: pause or "
                                        "wait for them first")
        freed = self.port.flush_cache()
        log.warning("prefix cache flushed: %d pages freed", freed)
        respond(True, Flushed(freed))

    def release_memory(self, cmd: ReleaseMemory, respond: Respond) -> None:
        """Release what `tags` name (all by default). Every condition is checked first:
        a refusal releases nothing."""
        tags = cmd.tag_set
        weights = WEIGHTS in tags and self.weights_held is None
        kv = KV_CACHE in tags and not self.kv_released
        if weights:
            self._check_weights_idle()
        if kv:
            self._check_kv_unused()
        if kv:
            self._release_kv()
        if weights:
            self._release_weights()
        respond(True, self._memory_state())

    def _release_weights(self) -> None:
        """Ours, then every other rank's part; if a rank cannot, every rank keeps them."""
        port = self.port
        held = weight_release.release(port.model.net, port.model.device)
        try:
            if port.ranks is not None:
                port.ranks.release_weights()
        except RuntimeError as e:
            weight_release.resume(held)
            raise StatusError(INTERNAL, f"could not release the weights: {e}; they stay "
                                        "resident") from None
        self.weights_held = held

    def resume_memory(self, cmd: ResumeMemory, respond: Respond) -> None:
        """Restore what `tags` name (all by default): the weights bit for bit from their
        host copy or spill file, the KV pool newly allocated (its address changes, so
        the scheduler tells its peers before using it). What cannot be restored stays
        released, on every rank, and the error says so: resume_memory again."""
        tags = cmd.tag_set
        if WEIGHTS in tags and self.weights_held is not None:
            self._resume_weights()
        if KV_CACHE in tags and self.kv_released:
            self._resume_kv()
        respond(True, self._memory_state())

    def _resume_weights(self) -> None:
        held, port = self.weights_held, self.port
        try:
            with port.long_call():
                weight_release.resume(held)          # on an error: still released
                try:
                    if port.ranks is not None:       # every other rank, or none
                        port.ranks.resume_weights()
                except RuntimeError:
                    self.weights_held = weight_release.release(port.model.net, port.model.device)
                    raise
        except (OSError, RuntimeError) as e:
            raise StatusError(INTERNAL, f"could not restore the weights: {e}; they stay "
                                        "released (resume_memory again)") from None
        self.weights_held = None
        log.warning("weights resumed (%d bytes)", held.nbytes)

    def _memory_state(self) -> MemoryState:
        return MemoryState(self.state, self.weights_state)

    def _check_weights_idle(self) -> None:
        """No request may be running on them: idle, or paused with nothing in a batch
        (retract and abort empty it; in_place keeps it)."""
        if self.port.busy() and not self.port.dropping():
            raise StatusError(CONFLICT, "releasing the weights while requests are running: "
                                        "pause (retract or abort) or wait for them first")

    def _check_kv_unused(self) -> None:
        """Only with no page in use: pages are held or fenced exactly while some request's
        KV, or a write into it, may still be there. Cached pages no request uses go first."""
        self.port.flush_cache()
        in_use = self.port.pages_in_use()
        if in_use:
            raise StatusError(CONFLICT, f"{in_use} KV pages in use: pause (retract or abort) "
                                        "and wait for them first")

    def _release_kv(self) -> None:
        """Drop the KV pool (every tensor-parallel rank's) and its transport registration."""
        port, pool = self.port, self.port.pool
        for buf in port.rank_buffers():
            port.backend.unregister(buf.data_ptr())
        if port.ranks is not None:
            port.ranks.release_kv()
        pool.release_memory()
        self.kv_released = True
        port.memory_released()
        if pool.device.type == "cuda":
            import torch
            torch.cuda.empty_cache()
        log.warning("KV pool memory released (%d bytes)", pool.nbytes)

    def _resume_kv(self) -> None:
        """A new pool on every rank, registered with the transport; on any failure none
        is kept anywhere (the memory stays released) and the 500 says why."""
        port, pool = self.port, self.port.pool
        try:
            pool.allocate_memory()
            if port.ranks is not None:
                port.ranks.resume_kv()
        except (OSError, RuntimeError) as e:
            pool.release_memory()
            raise StatusError(INTERNAL, f"could not allocate the KV pool again: {e}; the "
                                        "memory stays released (resume_memory again)") from None
        done = []
        try:
            for buf in port.rank_buffers():
                port.backend.register(buf.data_ptr(), buf.numel() * buf.element_size())
                done.append(buf)
        except transport.TransportError as e:
            for buf in done:
                port.backend.unregister(buf.data_ptr())
            if port.ranks is not None:
                port.ranks.release_kv()
            pool.release_memory()
            raise StatusError(INTERNAL, f"could not register the KV pool again: {e}; the "
                                        "memory stays released (resume_memory again)") from None
        self.kv_released = False
        port.memory_resumed()
        log.warning("KV pool memory resumed at %#x", pool.data_ptr)
