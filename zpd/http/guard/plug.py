"""The hardened front: the core app (zpd/http/app.py) with the guard plugged in.
What serves HTTP (zpd/ops/serve.py, the tests' fronts) builds its app here."""
from __future__ import annotations

from aiohttp import web

from zpd.http.app import Plugs, build_app
from zpd.http.front import Front
from zpd.http.guard.callers import CALLER, CallerBackend
from zpd.http.guard.connections import BOOK, ConnectionLimits, Connections, tracking
from zpd.http.guard.keys import guard


def guarded_app(front: Front, max_body_bytes: int | None = None,
                limits: ConnectionLimits = ConnectionLimits()) -> web.Application:
    """The app around `front`, to serve with `server_options(limits)` on a WatchedSite
    (connections.py): connections tracked outermost, keys checked before the routes,
    and the router client as each caller may see it."""
    def setup(app: web.Application) -> None:
        app[BOOK] = Connections(limits)
    front.sees_internals = lambda: CALLER.get().sees_internals
    plugs = Plugs(outer=(tracking,), inner=(guard,), setup=setup,
                  backend=lambda inner: inner if isinstance(inner, CallerBackend)
                  else CallerBackend(inner, front.router))
    return build_app(front, max_body_bytes, plugs)
