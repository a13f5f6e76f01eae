"""Reading a request's body: within a time, within a size, and decompressed here.

aiohttp would inflate a gzip body as it arrives, on the event loop, before any route
or key is checked: a 509 KB bomb stalled the front 1.2 s even when answered 401. The
server runs with auto_decompress=False (zpd/http/guard/connections.py) and a route's body
is read here, after the key is checked: raw bytes and inflated bytes are both capped
by --max-body-bytes (413 as soon as either passes it, without inflating the rest), the
whole read by --body-timeout (408), and inflating yields to the loop every step."""
from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from zpd.http.records import BadRequest

TOO_LARGE = 413
TIMED_OUT = 408
UNSUPPORTED_MEDIA = 415
STEP = 1 << 20            # bytes inflated between two turns of the loop
CODINGS = ("gzip", "x-gzip", "deflate", "identity")


async def read(request: web.Request, max_bytes: int, timeout: float) -> bytes:
    """The body, decoded from its Content-Encoding; BadRequest when it is too large
    (413), too slow (408), or its coding is unknown (415) or broken (400)."""
    inflate = _inflater(request.headers.get("Content-Encoding", ""))
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)
    try:
        return await asyncio.wait_for(_read(request, inflate, max_bytes), timeout)
    except asyncio.TimeoutError:
        raise BadRequest(f"the body did not arrive within {timeout:g} s (--body-timeout)",
                         TIMED_OUT) from None


async def _read(request: web.Request, inflate, max_bytes: int) -> bytes:
    raw = out = 0
    parts: list[bytes] = []
    async for chunk in request.content.iter_any():
        raw += len(chunk)
        if raw > max_bytes:
            raise _too_large(max_bytes)
        if inflate is None:
            parts.append(chunk)
            continue
        for piece in _pieces(inflate, chunk):
            out += len(piece)
            if out > max_bytes:
                raise _too_large(max_bytes, "inflated ")
            parts.append(piece)
            await asyncio.sleep(0)
    if inflate is not None and not inflate.eof:
        raise BadRequest("the compressed body ends before its end (Content-Encoding)")
    return b"".join(parts)


def _pieces(inflate, data: bytes):
    """What `data` inflates to, STEP bytes at a time, so a bomb is stopped after the
    step that passes the cap, not after inflating whole."""
    try:
        while data and not inflate.eof:
            piece = inflate.decompress(data, STEP)
            data = inflate.unconsumed_tail
            yield piece
        if inflate.unused_data:
            raise BadRequest("bytes after the end of the compressed body (Content-Encoding)")
    except zlib.error as e:
        raise BadRequest(f"the body is not valid for its Content-Encoding: {e}") from None


def _inflater(header: str):
    """A zlib decompressor for the Content-Encoding `header`; None for none/identity."""
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in CODINGS:
        raise BadRequest(f"Content-Encoding {header[:60]!r} is not served: send gzip, deflate "
                         "or none", UNSUPPORTED_MEDIA)
    # gzip, or deflate as zlib data (RFC 9110); 32 + 15: either header, found by zlib
    return zlib.decompressobj(32 + 15 if codings[0] != "deflate" else 15)


def _too_large(max_bytes: int, what: str = "") -> BadRequest:
    return BadRequest(f"the {what}body is larger than {max_bytes} bytes (--max-body-bytes)",
                      TOO_LARGE)
