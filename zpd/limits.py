"""What one request may take: the caps on its prompt (`PromptLimits`), checked at
every hop, and the seconds each phase may last (`Deadlines`). Their fields declare
the flags that set them (zpd/flag.py), as zpd/config.py's records do."""
from __future__ import annotations

from dataclasses import dataclass

import orjson

from zpd.flag import flag
from zpd.wire.protocol import MAX_FRAME_BYTES

# Helps that several records' flags share (a worker's and a router's --heartbeat, ...).
PEER_TIMEOUT_HELP = ("a peer silent this long is dead: its requests fail with 503 and no new "
                     "ones go to it until it answers again (default {default})")
BUSY_POLL_HELP = ("after each message the loop polls without sleeping for this many "
                  "microseconds, so the next hop of a request (usually within a millisecond) "
                  "finds it awake; costs up to that much CPU per message burst (default {default})")
HEARTBEAT_HELP = "seconds between pings to every peer (default {default})"


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase of a request may take before it fails with 504, and the
    liveness timers. Each field is one `zpd prefill`/`zpd decode` flag."""
    # every wait on the peer or on pages
    kv_wait: float = flag(60.0, "seconds to wait for KV pages, kv_dest or kv_done before 504 "
                          "(default {default})", "timeouts", names=("--kv-wait-timeout",),
                          type=float)
    # one KV write (Mooncake's own timeout is lower)
    transfer: float = flag(20.0, "seconds one KV write may take before the request fails with "
                           "504 (default {default})", "timeouts", names=("--transfer-timeout",),
                           type=float)
    # every peer pair pings this often, both ways
    heartbeat: float = flag(0.5, HEARTBEAT_HELP, "timeouts", type=float)
    busy_poll_us: float = flag(0.0, BUSY_POLL_HELP, "timeouts", type=float)
    peer_timeout: float = flag(2.0, PEER_TIMEOUT_HELP, "timeouts", type=float)
    dead_fence: float = flag(300.0, "decode: longest pages stay fenced for a prefill that "
                             "stopped answering in the middle of writing them (default "
                             "{default})", "timeouts", type=float)
    # decode: a silent router's requests run on this long for a router restarted on its
    # endpoint to adopt (zpd/worker/ha/adoption.py), then end 503
    router_grace: float = flag(10.0, "decode: seconds a silent router's requests go on "
                               "running, their pages held, so that a router restarted on the "
                               "same endpoint can adopt them; then they end with 503 (0: at "
                               "once; default {default})", "timeouts", type=float)

    # The schedulers name each wait by its phase; a user sets them all at once (kv_wait).
    @property
    def wait_kv_dest(self) -> float:
        """prefill: computed, waiting for decode's page ids."""
        return self.kv_wait

    @property
    def wait_pages(self) -> float:
        """Either side: waiting for free KV pages."""
        return self.kv_wait

    @property
    def wait_kv_done(self) -> float:
        """decode: from kv_dest sent to kv_done received."""
        return self.kv_wait

    @property
    def stash(self) -> float:
        """A message that arrived before its generate (or the reverse) waits this long."""
        return self.kv_wait


@dataclass(frozen=True)
class PromptLimits:
    """Caps on one request's prompt, checked by the HTTP front before it sends, by the
    router before it routes and by each worker before it tokenizes: a megabyte-sized
    prompt costs time and memory at every hop (a worker tokenizes a long one off its
    loop, zpd/worker/tokenizing.py, but it still takes a second of a core)."""
    max_text_bytes: int = flag(1 << 20, "refuse a text prompt of more bytes of UTF-8 "
                               "(default {default})", "limits", type=int)
    # a prompt's token ids (and the model's context)
    max_input_ids: int = flag(1 << 20, "refuse a prompt of more token ids (default {default})",
                              "limits", type=int)

    def __post_init__(self) -> None:
        # Past these a generate no longer fits one wire frame: text travels in the JSON
        # header (an escaped control character takes 6 bytes), ids as int32.
        for name, ceiling in (("max_text_bytes", MAX_FRAME_BYTES // 8),
                              ("max_input_ids", MAX_FRAME_BYTES // 4)):
            if not 0 < getattr(self, name) <= ceiling:
                raise ValueError(f"{name} must be in 1..{ceiling} (one wire frame), "
                                 f"got {getattr(self, name)}")

    def refusal(self, input_ids: list[int], text: str, chat: dict | None = None) -> str | None:
        """Why this prompt is refused (400), or None."""
        if len(input_ids) > self.max_input_ids:
            return f"prompt of {len(input_ids)} token ids; at most {self.max_input_ids} " \
                   "(--max-input-ids)"
        # Characters never outnumber UTF-8 bytes: a huge text is refused unencoded.
        if len(text) > self.max_text_bytes or utf8_len(text) > self.max_text_bytes:
            return f"text prompt over {self.max_text_bytes} bytes of UTF-8 (--max-text-bytes)"
        if chat and chat_bytes(chat) > self.max_text_bytes:
            return f"chat prompt over {self.max_text_bytes} bytes of JSON (--max-text-bytes)"
        return None


def chat_bytes(chat: dict) -> int:
    """A conversation's size as JSON: it arrived as JSON, so it encodes again."""
    return len(orjson.dumps(chat))


def utf8_len(text: str) -> int:
    """Bytes of `text` in UTF-8 (lone surrogates, which JSON cannot carry, count too)."""
    return len(text.encode("utf-8", "surrogatepass"))
