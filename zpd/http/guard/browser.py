"""What a front without --api-key checks so that a web page cannot drive it.

A keyless front on loopback is open to every local process, and so to every web page
in a browser on that host: a page may POST a form to http://127.0.0.1:30000/
pause_generation (cross-site request forgery), or rename its own host to 127.0.0.1
and read the answers (DNS rebinding). Browsers give such requests away, and each check
here refuses one kind (403, or 415 for the body's type):

- Host must name this front: an IP address, localhost, the host it binds, this
  machine's name, or one of --allowed-hosts ("*": any). A rebound name is none of these.
- Origin, when sent, must be this front's own: the Host it asked for, port included
  (a page served from another port of the same host, say a notebook's, is another
  site); "null" (sandboxed frames, files) never is.
- Sec-Fetch-Site, which browsers add to every request, must not say cross-site or
  same-site: that covers an <img> or a form GET, which carries no Origin.
- A body must say it is JSON (Content-Type application/json or */*+json): the types a
  page may send cross-site without asking first (forms, text/plain) are refused.

Clients that are not browsers (SGLang's and OpenAI's clients, curl with
-H 'Content-Type: application/json') send none of the rest. With --api-key none of
this applies: a page cannot send the key."""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from aiohttp import web

from zpd.http.records import BadRequest

ANY_HOST = "*"
FORBIDDEN = 403
UNSUPPORTED_MEDIA = 415
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
BROWSER_SITES = frozenset({"cross-site", "same-site"})    # Sec-Fetch-Site values refused
HOSTS_FLAG = "--allowed-hosts"
# what a web page may send to another site without a CORS preflight (which is never granted)
PAGE_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})


def check(request: web.Request, allowed: frozenset[str]) -> None:
    """BadRequest (403 or 415) unless `request` could not have come from a web page on
    another site; `allowed`: the host names served besides addresses and localhost."""
    host = request.headers.get("Host")
    if host is not None and not _host_allowed(_hostname(host), allowed):
        raise BadRequest(f"Host {host[:100]!r} is not a name of this server (DNS rebinding?); "
                         f"if it is one, start zpd http with {HOSTS_FLAG} NAME", FORBIDDEN,
                         "permission_error")
    origin = request.headers.get("Origin")
    if origin is not None and not _origin_allowed(origin, host):
        raise BadRequest(f"Origin {origin[:100]!r} is another site: a web page may not use "
                         f"this server without --api-key",
                         FORBIDDEN, "permission_error")
    site = request.headers.get("Sec-Fetch-Site", "").strip().lower()
    if site in BROWSER_SITES and origin is None:
        raise BadRequest(f"a {site} request from a web page: refused without --api-key",
                         FORBIDDEN, "permission_error")
    if request.method in BODY_METHODS:
        _check_json_type(request)


def _check_json_type(request: web.Request) -> None:
    """A body must be JSON; and no request may have a type a page sends cross-site
    without asking first, even empty (an empty octet-stream is aiohttp's bodyless POST)."""
    kind = request.headers.get("Content-Type")
    media = (kind or "").partition(";")[0].strip().lower()
    if media not in PAGE_TYPES and not request.body_exists:
        return
    if media != "application/json" and not (media.count("/") == 1 and media.endswith("+json")):
        raise BadRequest(f"the body must be JSON, sent with 'Content-Type: application/json', "
                         f"not {(kind or 'none')[:80]!r} (curl: -H 'Content-Type: "
                         "application/json', or --json)", UNSUPPORTED_MEDIA)


def _hostname(netloc: str) -> str:
    """The host of "host", "host:port", "[v6]" or "[v6]:port", lower case, no final dot."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:netloc.find("]")] if "]" in netloc else netloc
    if netloc.count(":") > 1:                      # a bare IPv6 address
        return netloc
    return netloc.partition(":")[0].rstrip(".")


def _host_allowed(name: str, allowed: frozenset[str]) -> bool:
    if ANY_HOST in allowed or name in allowed or name == "localhost" or \
            name.endswith(".localhost"):           # browsers keep *.localhost on loopback
        return True
    try:
        ipaddress.ip_address(name.partition("%")[0])
        return True              # a page whose host is an address is that address's own
    except ValueError:
        return False


def _origin_allowed(origin: str, host: str | None) -> bool:
    """Same origin only: the host names this front answers to (its Host check) include
    this machine's, which every other web server on the machine shares."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False                                # "null", file:, extensions...
    return host is not None and parts.netloc.lower() == host.strip().lower()


def allowed_hosts(bound: str, extra: tuple[str, ...]) -> frozenset[str]:
    """The names a keyless front answers to besides addresses and localhost: the host
    it binds, this machine's name, and --allowed-hosts."""
    import socket
    names = {bound, socket.gethostname(), *extra}
    return frozenset(_hostname(n) if n != ANY_HOST else n for n in names if n)
