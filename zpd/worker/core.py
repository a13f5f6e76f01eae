"""What prefill and decode workers share: model, KV pool, transport, socket, loop."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import orjson
import zmq

import transport
from engines.kv_pool import KVLayout, KVPool
from engines.config import ModelError
from engines.loader import load_model, update_weights as load_new_weights
from zpd.worker.busy import BusyResponder
from engines.compute import Compute
from zpd.config import WorkerConfig
from zpd.wire.drops import DropPlan
from zpd.wire.loop import Loop
from zpd.wire.net import Router
from zpd.wire.security import WORKER_POLICY, Security
from zpd.wire.protocol import Admin, AdminReply, Message, Ping, Pong, TokenPart, Tokens
from engines.request import BAD_REQUEST, RequestError

log = logging.getLogger("zpd.worker.core")

Respond = Callable[[bool, dict], None]
# For liveness tests: seconds added to every long call (forward, weight load) of a worker.
SLOW_ENV = "ZPD_SLOW_CALLS"
PAUSE_MODES = ("abort", "in_place", "retract")


class AdminError(Exception):
    """An admin command refused, with the status code to report."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def pause_mode(args: dict) -> str:
    mode = args.get("mode", "retract")
    if mode not in PAUSE_MODES:
        raise AdminError(400, f"unknown pause mode {mode!r}; use one of {', '.join(PAUSE_MODES)}")
    return mode


class WorkerCore:
    """The parts of a worker that are not request state. The scheduler (prefill or
    decode) owns the requests and registers its message handlers here."""

    def __init__(self, cfg: WorkerConfig, ctx: zmq.Context) -> None:
        self.cfg = cfg
        self.model = load_model(cfg.model, cfg.device, cfg.dtype, cfg.weight_version)
        self.layout = KVLayout.for_model(self.model.cfg, cfg.page_size, self.model.dtype)
        self.pool = KVPool.with_budget(self.layout, cfg.kv_cache_mb, self.model.dtype,
                                       self.model.device)
        self.compute = Compute(self.model, self.pool)
        self.backend = transport.create_backend(
            cfg.transport, host=cfg.host, device_name=cfg.ib_device, protocol=cfg.protocol,
            transfer_timeout_s=cfg.deadlines.transfer * 0.75)
        self.backend.register(self.pool.data_ptr, self.pool.nbytes)
        self.security = Security(cfg.curve_keys, ctx)
        self.router = Router(ctx, cfg.host, cfg.port, self.security.server_options(WORKER_POLICY))
        self.endpoint = self.router.endpoint
        self.loop = Loop()
        self.compat_hash = compat_hash(self.model, self.layout)
        self.handlers: dict[type[Message], Callable[[bytes, Message], None]] = {Ping: self._on_ping}
        self.admin_commands: dict[str, Callable[[dict, Respond], None]] = {
            "update_weights": self.update_weights, "flush_cache": self.flush_cache,
            "release_memory": self.release_memory, "resume_memory": self.resume_memory}
        self.paused: str | None = None            # None or the pause mode
        self.memory_released = False              # KV pool dropped: schedule nothing
        self.pinged_at: dict[bytes, float] = {}     # peer identity -> last message from it
        self.busy: Callable[[], bool] = lambda: False   # set by the scheduler
        self.on_memory_resumed: Callable[[], None] = lambda: None   # set by the scheduler
        self.drops = DropPlan.from_env()
        self.slow_s = _seconds_from_env(SLOW_ENV)
        self.outbox: dict[bytes, dict[str, TokenPart]] = {}   # peer -> rid -> tokens not sent yet
        self.loop.add_socket(self.router, self._on_router)
        # Pings are answered during forwards longer than this, so a busy worker stays alive.
        self.responder = BusyResponder(self.router, self._answer_while_busy,
                                       min(cfg.deadlines.heartbeat, cfg.deadlines.peer_timeout / 4))

    @contextmanager
    def long_call(self) -> Iterator[None]:
        """Wrap a long call on the scheduler thread (a forward, a weight load): peers'
        pings are answered meanwhile; other messages wait for the loop, in order."""
        try:
            with self.responder.busy():
                yield
                if self.slow_s:
                    time.sleep(self.slow_s)
        finally:
            if self.responder.backlog:
                self.loop.call_soon_threadsafe(self._drain_backlog)   # even if the socket is quiet

    def _answer_while_busy(self, identity: bytes, msg: Message) -> bool:
        """On the responder thread: answer a ping now; keep anything else."""
        if isinstance(msg, Ping):
            self._on_ping(identity, msg)
            return True
        if identity in self.pinged_at:
            self.pinged_at[identity] = self.loop.time()
        return False

    def _drain_backlog(self) -> None:
        while self.responder.backlog:
            self._dispatch(*self.responder.backlog.popleft())

    def send(self, identity: bytes, msg: Message) -> None:
        """Every message to a peer goes out here (ZPD_DROP_MESSAGES may lose it),
        after the tokens queued before it, so the peer sees them in order."""
        if self.outbox:
            self.flush_tokens()
        if not self.drops.drops(msg):
            self.router.send(identity, msg)

    def queue_token(self, identity: bytes, part: TokenPart) -> None:
        """Queue a request's new tokens for `flush_tokens`; a second part for the same
        rid before the flush is appended to the first."""
        parts = self.outbox.setdefault(identity, {})
        old = parts.get(part.rid)
        if old is not None:
            part = TokenPart(part.rid, old.token_ids + part.token_ids,
                             old.weight_versions + part.weight_versions, part.finish, part.meta)
        parts[part.rid] = part

    def flush_tokens(self) -> None:
        """Send the queued tokens: one message per peer (a decode step's worth)."""
        outbox, self.outbox = self.outbox, {}
        for identity, parts in outbox.items():
            msg = Tokens.pack(list(parts.values()))
            if not self.drops.drops(msg):
                self.router.send(identity, msg)

    def _on_router(self) -> None:
        self._drain_backlog()               # what came during a long call goes first
        got = self.router.recv()
        if got is not None:
            self._dispatch(*got)

    def _dispatch(self, identity: bytes, msg: Message) -> None:
        if identity in self.pinged_at:
            # Any message shows the peer is alive: a burst of requests queued ahead of
            # its ping must not make it look silent.
            self.pinged_at[identity] = self.loop.time()
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("%s: dropping unexpected %s from %r", self.cfg.role, msg.TYPE, identity[:32])
            return
        handler(identity, msg)

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        """Also called on the responder thread: it sends straight to the socket (a pong's
        place among queued tokens does not matter), never through the token outbox."""
        self.pinged_at[identity] = self.loop.time()
        pong = Pong(msg.seq, msg.sent_at, self.endpoint)
        if not self.drops.drops(pong):
            self.router.send(identity, pong)

    def silent_peers(self) -> list[bytes]:
        """Peers that used to ping us and stopped (a dead router, for orphan cleanup)."""
        limit = self.loop.time() - self.cfg.deadlines.peer_timeout
        return [peer for peer, at in self.pinged_at.items() if at < limit]

    def on_admin(self, identity: bytes, msg: Admin) -> None:
        def respond(ok: bool, result: dict) -> None:
            self.send(identity, AdminReply(msg.req_id, ok, {"endpoint": self.endpoint,
                                                            "role": self.cfg.role} | result))
        command = self.admin_commands.get(msg.command)
        if command is None:
            respond(False, {"error": f"unknown command {msg.command!r}; known: "
                                     f"{', '.join(sorted(self.admin_commands))}", "status": 400})
            return
        log.info("admin %s %s", msg.command, dict(msg.args))
        try:
            command(dict(msg.args), respond)
        except AdminError as e:
            respond(False, {"error": str(e), "status": e.status})
        except Exception as e:  # an admin command must answer, whatever happened
            log.exception("admin %s failed", msg.command)
            respond(False, {"error": f"{type(e).__name__}: {e}", "status": 500})

    def update_weights(self, args: dict, respond: Respond) -> None:
        """Allowed while paused or idle; a bad checkpoint leaves the old weights."""
        path, version = args.get("path"), args.get("version")
        if not isinstance(path, str) or not path:
            raise AdminError(400, "update_weights needs a checkpoint path")
        if self.paused is None and self.busy():
            raise AdminError(409, "update_weights while requests are running: pause first")
        try:
            with self.long_call():
                new = load_new_weights(self.model, path, version if isinstance(version, str) else None)
        except (ModelError, ValueError) as e:
            raise AdminError(400, str(e)) from None
        log.warning("weights updated from %s: version %s", path, new)
        respond(True, {"weight_version": new})

    def flush_cache(self, args: dict, respond: Respond) -> None:
        # zpd keeps no prefix cache: KV lives only as long as its request.
        respond(True, {"flushed_pages": 0, "note": "no prefix cache; nothing to flush"})

    def release_memory(self, args: dict, respond: Respond) -> None:
        """Drop the KV pool and its transport registration (e.g. to update weights in
        the room it frees). Only with no page in use: pages are held or fenced exactly
        while some request's KV, or a write into it, may still be there."""
        if not self.memory_released:
            in_use = self.pool.allocator.allocated
            if in_use:
                raise AdminError(409, f"{in_use} KV pages in use: pause (retract or abort) "
                                      "and wait for them first")
            self.backend.unregister(self.pool.data_ptr)
            self.pool.release_memory()
            self.memory_released = True
            if self.pool.device.type == "cuda":
                import torch
                torch.cuda.empty_cache()
            log.warning("KV pool memory released (%d bytes)", self.pool.nbytes)
        respond(True, {"memory": self.memory_state()})

    def resume_memory(self, args: dict, respond: Respond) -> None:
        """Allocate and register the pool again; its address changes, so the
        scheduler tells its peers (`on_memory_resumed`) before using it."""
        if self.memory_released:
            self.pool.allocate_memory()
            try:
                self.backend.register(self.pool.data_ptr, self.pool.nbytes)
            except transport.TransportError as e:
                self.pool.release_memory()
                raise AdminError(500, f"could not register the KV pool again: {e}") from None
            self.memory_released = False
            self.on_memory_resumed()
            log.warning("KV pool memory resumed at %#x", self.pool.data_ptr)
        respond(True, {"memory": self.memory_state()})

    def memory_state(self) -> str:
        return "released" if self.memory_released else "resident"

    @property
    def pool_addr(self) -> int:
        """The pool's address, 0 while its memory is released."""
        return 0 if self.memory_released else self.pool.data_ptr

    def prompt_ids(self, msg) -> list[int]:
        """The request's prompt: its token ids, or its text through our tokenizer."""
        if msg.input_ids or not msg.text:
            return list(msg.input_ids)
        if self.model.tokenizer is None:
            raise RequestError(BAD_REQUEST, f"model {self.model.spec!r} has no tokenizer.json: "
                                            "send input_ids")
        return self.model.tokenizer.encode(msg.text)

    def kv_pages(self, held: int, fenced: int) -> dict:
        """Counted from the scheduler's own records, so free + held + fenced == total
        is a real check: a page allocated to no live request or fence breaks it."""
        a = self.pool.allocator
        return {"total": a.total, "free": a.free, "held": held, "fenced": fenced}

    def write_ready_file(self) -> None:
        if self.cfg.ready_file:
            tmp = self.cfg.ready_file + ".tmp"
            with open(tmp, "wb") as f:
                f.write(orjson.dumps({"role": self.cfg.role, "endpoint": self.endpoint,
                                      "pid": os.getpid()}))
            os.replace(tmp, self.cfg.ready_file)

    def close(self) -> None:
        self.responder.close()
        self.backend.close()
        self.router.close()
        self.loop.close()
        self.security.close()


def _seconds_from_env(name: str) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        value = -1.0
    if not 0 <= value < 3600:
        raise ValueError(f"{name}={raw!r}: want seconds, 0 <= s < 3600")
    if value:
        log.warning("%s=%g: every forward of this worker takes %g s more", name, value, value)
    return value


def compat_hash(model, layout: KVLayout) -> str:
    """Two workers may exchange KV only if this matches: same model shape, same
    KV layout and dtype, same tokenizer."""
    tok = model.tokenizer.to_json() if model.tokenizer is not None else ""
    blob = json.dumps({"model": model.cfg.fingerprint(), "layout": layout.to_dict(),
                       "tokenizer": hashlib.sha256(tok.encode()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def serve(scheduler_factory: Callable[[WorkerCore, zmq.Context], object], cfg: WorkerConfig) -> int:
    """Run a worker until SIGINT/SIGTERM."""
    ctx = zmq.Context()
    core = WorkerCore(cfg, ctx)
    scheduler = scheduler_factory(core, ctx)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: (stop.set(), core.loop.stop()))
    core.write_ready_file()
    log.warning("%s worker ready on %s (model %s, %d KV pages of %d bytes, transport session %s)",
                cfg.role, core.endpoint, cfg.model, core.pool.num_pages, core.layout.page_bytes,
                core.backend.session_id)
    try:
        scheduler.run(stop)
    finally:
        core.close()
        ctx.destroy(linger=0)     # also closes the scheduler's own sockets
    return 0
