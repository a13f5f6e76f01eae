"""The router process assembled: its core (zpd/router/server.py) with its wings plugged
in: the routers sharing its pool and the adoption of its predecessor's requests
(zpd/router/ha/), and the trainer's weight sync (zpd/router/weights/)."""
from __future__ import annotations

import zmq

from zpd.config import RouterConfig
from zpd.router.ha.adoption import Adoption
from zpd.router.ha.peers import CoordinatorLink, Followers
from zpd.router.server import RouterServer
from zpd.router.weights.sync import RouterWeightSync
from zpd.wire.loop import Loop


def build_router(cfg: RouterConfig, ctx: zmq.Context, loop: Loop | None = None) -> RouterServer:
    """A router with every wing; the adoption last, for it asks the decodes at once."""
    server = RouterServer(cfg, ctx, loop)
    server.admin.sync = RouterWeightSync(server, server.admin.fan_out)
    server.followers = Followers(server)
    if cfg.coordinator is not None:
        server.coordinator = CoordinatorLink(server, cfg.coordinator,
                                             server.dealer(ctx, cfg.coordinator))
    server.adoption = Adoption(server)
    return server
