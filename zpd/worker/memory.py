"""A worker's weights and KV memory as admin commands: update_weights, release_memory,
resume_memory, flush_cache."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

import transport
from engines.config import ModelError
from engines.loader import SMOLLM2
from engines.loader import update_weights as load_new_weights
from engines.request import BAD_REQUEST, CONFLICT, INTERNAL, StatusError
from engines.tiny import is_tiny
from zpd.worker.scheduler import Respond

if TYPE_CHECKING:
    from zpd.worker.core import WorkerCore

log = logging.getLogger("zpd.worker.memory")

FORBIDDEN = 403


def checkpoint_source(path: str, root: str | None) -> str:
    """Where `update_weights` may load `path` from: anywhere without a root; with one,
    only a directory that resolves (symlinks and .. followed) under it, relative paths
    taken from it. The refusal reads the same whether `path` exists or not, so it
    cannot be used to map the host's directories. `tiny` specs touch no file."""
    if "\0" in path:                  # no file has one; realpath would raise
        raise StatusError(BAD_REQUEST, "update_weights: the path holds a NUL character")
    if root is None or is_tiny(path) or path == SMOLLM2:
        return path
    base = os.path.realpath(root)
    real = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([base, real]) != base:
        raise StatusError(FORBIDDEN, f"update_weights: {path!r} is not under this worker's "
                                     "--weights-root")
    return real


class WeightsAndMemory:
    """The commands that change what the worker holds, not its requests."""

    def __init__(self, core: "WorkerCore") -> None:
        self.core = core
        self.released = False               # KV pool dropped: schedule nothing

    def commands(self) -> dict[str, Callable[[dict, Respond], None]]:
        return {"update_weights": self.update_weights, "flush_cache": self.flush_cache,
                "release_memory": self.release_memory, "resume_memory": self.resume_memory}

    @property
    def state(self) -> str:
        return "released" if self.released else "resident"

    @property
    def pool_addr(self) -> int:
        """The pool's address, 0 while its memory is released."""
        return 0 if self.released else self.core.pool.data_ptr

    def update_weights(self, args: dict, respond: Respond) -> None:
        """Allowed while paused or idle; a bad checkpoint leaves the old weights."""
        core = self.core
        path, version = args.get("path"), args.get("version")
        if not isinstance(path, str) or not path:
            raise StatusError(BAD_REQUEST, "update_weights needs a checkpoint path")
        if version is not None and (not isinstance(version, str) or not version):
            raise StatusError(BAD_REQUEST, "update_weights: version must be a non-empty string")
        source = checkpoint_source(path, core.cfg.weights_root)
        if core.paused is None and core.scheduler.busy():
            raise StatusError(CONFLICT, "update_weights while requests are running: pause first")
        try:
            with core.long_call():
                new = load_new_weights(core.model, source, version)
        except (ModelError, ValueError) as e:
            raise StatusError(BAD_REQUEST, str(e)) from None
        core.scheduler.on_weights_changed()
        log.warning("weights updated from %r: version %r", path, new)
        respond(True, {"weight_version": new})

    def flush_cache(self, args: dict, respond: Respond) -> None:
        """Drop the prefix cache; refused while requests run (as SGLang does)."""
        if self.core.scheduler.busy():
            raise StatusError(CONFLICT, "flush_cache while requests are running: pause or "
                                        "wait for them first")
        freed = self.core.scheduler.flush_cache()
        log.warning("prefix cache flushed: %d pages freed", freed)
        respond(True, {"flushed_pages": freed})

    def release_memory(self, args: dict, respond: Respond) -> None:
        """Drop the KV pool and its transport registration (e.g. to update weights in
        the room it frees). Only with no page in use: pages are held or fenced exactly
        while some request's KV, or a write into it, may still be there."""
        pool = self.core.pool
        if not self.released:
            self.core.scheduler.flush_cache()      # cached pages no request uses go first
            in_use = pool.allocator.allocated
            if in_use:
                raise StatusError(CONFLICT, f"{in_use} KV pages in use: pause (retract or abort) "
                                            "and wait for them first")
            self.core.backend.unregister(pool.data_ptr)
            pool.release_memory()
            self.released = True
            if pool.device.type == "cuda":
                import torch
                torch.cuda.empty_cache()
            log.warning("KV pool memory released (%d bytes)", pool.nbytes)
        respond(True, {"memory": self.state})

    def resume_memory(self, args: dict, respond: Respond) -> None:
        """Allocate and register the pool again; its address changes, so the
        scheduler tells its peers before using it."""
        pool = self.core.pool
        if self.released:
            pool.allocate_memory()
            try:
                self.core.backend.register(pool.data_ptr, pool.nbytes)
            except transport.TransportError as e:
                pool.release_memory()
                raise StatusError(INTERNAL, f"could not register the KV pool again: {e}") from None
            self.released = False
            self.core.scheduler.on_memory_resumed()
            log.warning("KV pool memory resumed at %#x", pool.data_ptr)
        respond(True, {"memory": self.state})
