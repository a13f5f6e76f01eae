"""Starting `zpd http`: the model's tokenizer and chat template (no weights), the
router client, the aiohttp server on --host/--port, the ready file, and a clean stop
on SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

from aiohttp import web

from engines.allocator_tuning import freeze_startup_objects
from engines.loader import load_text
from zpd.config import HttpConfig
from zpd.http.app import build_app
from zpd.http.browser import allowed_hosts
from zpd.http.connections import BOOK, ConnectionLimits, WatchedSite, server_options
from zpd.http.front import Front
from zpd.http.router_client import RouterClient
from zpd.ops.ready import write_ready_file
from zpd.wire.net import format_endpoint

log = logging.getLogger("zpd.http.server")


def serve_http(cfg: HttpConfig) -> int:
    tokenizer, chat, problem = load_text(cfg.model, cfg.overrides)
    if problem:
        log.warning("model %s: %s (text or chat requests that need it get a 400)", cfg.model,
                    problem)
    return asyncio.run(_serve(cfg, Front(
        None, cfg.served_model_name or cfg.model, tokenizer, chat, problem, cfg.api_key,
        cfg.admin_api_key, cfg.router, cfg.weights_timeout, model_path=cfg.model,
        tokenizer_path=cfg.overrides.tokenizer_path or cfg.model, config=cfg,
        max_body_bytes=cfg.max_body_bytes, body_timeout=cfg.body_timeout,
        allowed_hosts=allowed_hosts(cfg.host, cfg.allowed_hosts))))


async def _serve(cfg: HttpConfig, front: Front) -> int:
    curve = None
    if cfg.curve_keys:
        from zpd.wire.security import client_curve
        curve = client_curve(cfg.curve_keys, "admin")      # requests and admin commands
    front.backend = RouterClient(cfg.router, curve, cfg.connect_timeout, cfg.router_silence,
                                 cfg.admin_timeout)
    await front.backend.start()
    limits = ConnectionLimits(cfg.keepalive_timeout, cfg.header_timeout, cfg.max_connections)
    app = build_app(front, limits=limits)
    runner = web.AppRunner(app, **server_options(limits))
    await runner.setup()
    try:
        site = WatchedSite(runner, cfg.host, cfg.port, app[BOOK])
        await site.start()
        port = runner.addresses[0][1]
        endpoint = format_endpoint(cfg.host, port)
        write_ready_file(cfg.ready_file, {"role": "http", "endpoint": endpoint, "pid": os.getpid()})
        log.warning("zpd http ready on http://%s (router %s, model %s)", endpoint, cfg.router,
                    cfg.model)
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
