"""Running a role as a process: `zpd prefill`, `decode`, `router` and `http` build their
role, stop it cleanly on SIGINT/SIGTERM and write its ready file. The roles (zpd/worker,
zpd/router, zpd/http) know nothing of processes, signals or ready files; this module
imports them, never the other way round. Each function imports its own role only, so
that a router or an HTTP front does not load a worker's model code."""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import TYPE_CHECKING, Callable

import zmq

from zpd.config import HttpConfig, RouterConfig, WorkerConfig
from zpd.ops.ready import write_role_ready
from zpd.wire.loop import Loop

if TYPE_CHECKING:
    from zpd.http.front import Front
    from zpd.worker.core import WorkerCore
    from zpd.worker.scheduler import Scheduler

log = logging.getLogger("zpd.ops.serve")


def stop_on_signals(loop: Loop) -> threading.Event:
    """An event that SIGINT and SIGTERM set, waking `loop` to see it."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: (stop.set(), loop.stop()))
    return stop


def serve_worker(make_scheduler: Callable[[WorkerCore, zmq.Context], Scheduler],
                 cfg: WorkerConfig) -> int:
    """Run a prefill or decode worker until SIGINT/SIGTERM."""
    from engines.allocator_tuning import freeze_startup_objects, tune_allocator
    from zpd.ops.worker import build_worker
    tune_allocator()
    ctx = zmq.Context()
    core = build_worker(cfg, ctx, make_scheduler)
    freeze_startup_objects()
    stop = stop_on_signals(core.loop)
    write_role_ready(cfg.ready_file, cfg.role, core.endpoint)
    log.warning("%s worker ready on %s (model %s on %s, %d KV pages of %d bytes, transport "
                "session %s)", cfg.role, core.endpoint, cfg.model, core.pool.device,
                core.pool.num_pages, core.layout.page_bytes, core.backend.session_id)
    try:
        core.run(stop)
    finally:
        core.scheduler.close()
        core.close()
        ctx.destroy(linger=0)     # also closes the scheduler's own sockets
    failure = core.failure()
    if failure is not None:       # its router sees it gone: its requests end with 503
        log.error("%s worker on %s stops: %s", cfg.role, core.endpoint, failure)
        return 1
    return 0


def serve_router(cfg: RouterConfig) -> int:
    """Run the router until SIGINT/SIGTERM."""
    from zpd.ops.router import build_router
    ctx = zmq.Context()
    server = build_router(cfg, ctx)
    stop = stop_on_signals(server.loop)
    write_role_ready(cfg.ready_file, "router", server.endpoint)
    log.warning("router ready on %s: prefill %s, decode %s", server.endpoint,
                ",".join(cfg.prefill), ",".join(cfg.decode))
    try:
        server.run(stop)
    finally:
        server.close()
        ctx.destroy(linger=0)
    return 0


def serve_http(cfg: HttpConfig) -> int:
    """Run `zpd http` until SIGINT/SIGTERM: the model's tokenizer and chat template (no
    weights), the router client and the aiohttp server on --host/--port; with
    --workers N, N such processes on that port (zpd/ops/http_workers.py)."""
    if cfg.workers > 1:
        from zpd.ops.http_workers import serve_http_workers
        return serve_http_workers(cfg, serve_one_http)
    return serve_one_http(cfg)


def serve_one_http(cfg: HttpConfig) -> int:
    """One HTTP front process."""
    from engines.text import load_text
    from zpd.http.guard.browser import allowed_hosts
    from zpd.http.front import Front
    tokenizer, chat, problem = load_text(cfg.model, cfg.overrides)
    if problem:
        log.warning("model %s: %s (text or chat requests that need it get a 400)", cfg.model,
                    problem)
    return asyncio.run(_serve_http(cfg, Front(
        None, cfg.served_model_name or cfg.model, tokenizer, chat, problem, cfg.api_key,
        cfg.admin_api_key, cfg.router, cfg.weights_timeout, model_path=cfg.model,
        tokenizer_path=cfg.overrides.tokenizer_path or cfg.model, config=cfg,
        max_body_bytes=cfg.max_body_bytes, body_timeout=cfg.body_timeout,
        allowed_hosts=allowed_hosts(cfg.host, cfg.allowed_hosts))))


async def _serve_http(cfg: HttpConfig, front: Front) -> int:
    from aiohttp import web

    from engines.allocator_tuning import freeze_startup_objects
    from zpd.http.guard.plug import guarded_app
    from zpd.http.guard.connections import BOOK, ConnectionLimits, WatchedSite, server_options
    from zpd.http.router_client import RouterClient
    from zpd.wire.net import format_endpoint
    curve = None
    if cfg.curve_keys:
        from zpd.wire.security import client_curve
        curve = client_curve(cfg.curve_keys, "admin")      # requests and admin commands
    front.backend = RouterClient(cfg.router, curve, cfg.connect_timeout, cfg.router_silence,
                                 cfg.admin_timeout, cfg.front_index)
    await front.backend.start()
    limits = ConnectionLimits(cfg.keepalive_timeout, cfg.header_timeout, cfg.max_connections)
    app = guarded_app(front, limits=limits)
    runner = web.AppRunner(app, **server_options(limits))
    await runner.setup()
    try:
        site = WatchedSite(runner, cfg.host, cfg.port, app[BOOK], reuse_port=cfg.workers > 1)
        await site.start()
        endpoint = format_endpoint(cfg.host, runner.addresses[0][1])
        write_role_ready(cfg.ready_file, "http", endpoint)
        log.warning("zpd http ready on http://%s (router %s, model %s)", endpoint,
                    front.backend.endpoint, cfg.model)
        # At 64 streams on tiny the collector took ~0.5 s of the front's loop in ~25 s
        # before (pauses every stream waits out), ~0.2 s after.
        freeze_startup_objects()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
        await front.backend.close()
    return 0
