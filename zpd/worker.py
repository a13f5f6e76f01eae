"""What prefill and decode workers share: model, KV pool, transport, socket, loop."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
from typing import Callable

import orjson
import zmq

import transport
from engines.kv_pool import KVLayout, KVPool
from engines.loader import load_model
from zpd.compute import Compute
from zpd.config import WorkerConfig
from zpd.loop import Loop
from zpd.net import Router
from zpd.protocol import Admin, AdminReply, Message, Ping, Pong
from zpd.request import BAD_REQUEST, RequestError

log = logging.getLogger("zpd.worker")


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
        self.router = Router(ctx, cfg.host, cfg.port)
        self.endpoint = self.router.endpoint
        self.loop = Loop()
        self.compat_hash = compat_hash(self.model, self.layout)
        self.handlers: dict[type[Message], Callable[[bytes, Message], None]] = {Ping: self._on_ping}
        self.admin_commands: dict[str, Callable[[dict], dict]] = {}
        self.loop.add_socket(self.router, self._on_router)

    def _on_router(self) -> None:
        got = self.router.recv()
        if got is None:
            return
        identity, msg = got
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("%s: dropping unexpected %s from %r", self.cfg.role, msg.TYPE, identity[:32])
            return
        handler(identity, msg)

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        self.router.send(identity, Pong(msg.seq, msg.sent_at, self.endpoint))

    def on_admin(self, identity: bytes, msg: Admin) -> None:
        command = self.admin_commands.get(msg.command)
        if command is None:
            result, ok = {"error": f"unknown command {msg.command!r}; known: "
                                   f"{', '.join(sorted(self.admin_commands))}", "status": 400}, False
        else:
            try:
                result = command(dict(msg.args))
                ok = result.pop("ok", True)
            except Exception as e:  # an admin command must answer, whatever happened
                log.exception("admin %s failed", msg.command)
                result, ok = {"error": str(e), "status": 500}, False
        self.router.send(identity, AdminReply(msg.req_id, ok, {"endpoint": self.endpoint,
                                                               "role": self.cfg.role} | result))

    def prompt_ids(self, msg) -> list[int]:
        """The request's prompt: its token ids, or its text through our tokenizer."""
        if msg.input_ids or not msg.text:
            return list(msg.input_ids)
        if self.model.tokenizer is None:
            raise RequestError(BAD_REQUEST, f"model {self.model.spec!r} has no tokenizer.json: "
                                            "send input_ids")
        return self.model.tokenizer.encode(msg.text)

    def kv_pages(self, fenced: int = 0) -> dict:
        a = self.pool.allocator
        return {"total": a.total, "free": a.free, "held": a.allocated - fenced, "fenced": fenced}

    def write_ready_file(self) -> None:
        if self.cfg.ready_file:
            tmp = self.cfg.ready_file + ".tmp"
            with open(tmp, "wb") as f:
                f.write(orjson.dumps({"role": self.cfg.role, "endpoint": self.endpoint,
                                      "pid": os.getpid()}))
            os.replace(tmp, self.cfg.ready_file)

    def close(self) -> None:
        self.backend.close()
        self.router.close()
        self.loop.close()


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
