"""Frozen configuration records of each process. Addresses and ports are fields,
never constants, so any number of workers share a host without colliding.

These defaults are the only ones: the `zpd` flags take theirs from here
(`default_of`), so a default changed here changes the CLI and its --help too."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import orjson

from engines.formats.overrides import ModelOverrides
from zpd.wire.protocol import MAX_FRAME_BYTES


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase of a request may take before it fails with 504, and the
    liveness timers. Each field is one `zpd prefill`/`zpd decode` flag."""
    kv_wait: float = 60.0            # --kv-wait-timeout: every wait on the peer or on pages
    transfer: float = 20.0           # --transfer-timeout: one KV write (Mooncake's own timeout is lower)
    heartbeat: float = 0.5           # every peer pair pings this often, both ways
    busy_poll_us: float = 0.0        # --busy-poll-us: the loop spins this long after a message
    peer_timeout: float = 2.0        # silent this long: the peer is dead (503 for its requests)
    dead_fence: float = 300.0        # decode: longest pages stay fenced for a silent prefill
    # decode: a silent router's requests run on this long for a router restarted on its
    # endpoint to adopt (zpd/worker/adoption.py), then end 503
    router_grace: float = 10.0

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
    max_text_bytes: int = 1 << 20    # --max-text-bytes: a text prompt's size in UTF-8
    max_input_ids: int = 1 << 20     # --max-input-ids: a prompt's token ids (and the model's context)

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


@dataclass(frozen=True)
class WorkerConfig:
    role: str                        # "prefill" or "decode"
    model: str
    host: str = "127.0.0.1"
    port: int = 0                    # 0: any free port (the bound one is reported)
    device: str = "cpu"
    dtype: str = "float32"
    weight_version: str | None = None
    page_size: int = 16
    kv_cache_mb: float = 256
    # SGLang's --mem-fraction-static: weights + KV take this fraction of the device's memory
    # (zpd/worker/mem_fraction.py); None: the KV pool is kv_cache_mb
    mem_fraction_static: float | None = None
    overrides: ModelOverrides = field(default_factory=ModelOverrides)  # tokenizer, template, context
    clear_freed_pages: bool = False  # zero each KV page as it is freed (docs/operating.md, "Security")
    prefix_cache: bool = True        # a prefill keeps computed prompt pages for reuse
    max_batch: int = 64
    max_prefill_tokens: int = 8192
    # a prefill step's tokens are also bounded by what this worker computes in this many
    # seconds (measured), so a step does not hold other callers' requests long; 0: off
    prefill_step_seconds: float = 1.0
    transport: str = "mooncake"
    ib_device: str = ""              # RDMA device names for Mooncake ("" = auto/TCP)
    protocol: str = "tcp"
    deadlines: Deadlines = field(default_factory=Deadlines)
    ready_file: str | None = None
    curve_keys: str | None = None    # CURVE key directory (zpd.wire.security); None: plaintext
    # --router-secret-file: without keys, the cluster's routers prove themselves with it
    # (zpd/wire/router_proof.py); None: requests open to anyone, adopt refused
    router_secret_file: str | None = None
    weights_root: str | None = None  # update_weights loads only from under here; None: anywhere
    insecure: bool = False           # a non-loopback host without curve_keys (zpd.ops.exposure)
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    # --weight-sync-timeout: the most seconds a trainer's join or push may take here; past it
    # the helper receiving it is killed and the old weights stay (zpd/worker/weight_sync.py)
    weight_sync_timeout: float = 300.0
    tp: int = 1                      # tensor-parallel ranks (engines/tp/): this process is rank 0


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 5757                 # the well-known port clients dial; 0: any free port
    admin_timeout_s: float = 30.0
    heartbeat: float = 0.5           # ping every worker this often
    busy_poll_us: float = 0.0        # --busy-poll-us: the loop spins this long after a message
    peer_timeout: float = 2.0        # a worker silent this long is dead until it answers again
    ready_file: str | None = None
    curve_keys: str | None = None    # CURVE key directory (zpd.wire.security); None: plaintext
    router_secret_file: str | None = None   # the cluster's router secret (zpd/wire/router_proof.py)
    insecure: bool = False           # a non-loopback host without curve_keys (zpd.ops.exposure)
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    # Each client's share (zpd/router/shares.py): past it, its requests wait their turn.
    # The defaults are generous; set from the decodes' KV pool, they keep one client from
    # starving the others (docs/operating.md, "Limits").
    max_client_requests: int = 1024  # --max-client-requests: routed at once
    max_client_tokens: int = 1 << 22  # --max-client-tokens: prompt + max_new_tokens routed
    # The waiting room (zpd/router/admission.py): requests routed to the workers at once
    # (0: 64 per decode), how many may wait, and how long (seconds) each may.
    max_concurrent_requests: int = 0  # --max-concurrent-requests (sglang-router's name)
    queue_size: int = 1 << 14        # --queue-size: past it, 429 "queue full"
    queue_timeout: float = 300.0     # --queue-timeout: past it, 503 "queue timeout"
    # --coordinator: another router over the same workers that coordinates pauses and
    # weight pushes; this one follows it (zpd/router/peers.py). None: this one coordinates.
    coordinator: str | None = None


@dataclass(frozen=True)
class HttpConfig:
    """`zpd http`: an HTTP server that is a client of one router (or several)."""
    router: str = "127.0.0.1:5757"   # the router's endpoint, or several: "h:p,h:p" (failover.py)
    workers: int = 1                 # front processes sharing host:port (ops/http_workers.py)
    metrics_dir: str | None = None   # where those fronts sum their latency histograms
    front_index: int | None = None   # which of them this is: its own router (None: random)
    model: str = ""                  # the cluster's --model: its tokenizer and chat template
    served_model_name: str | None = None  # the model id clients see (None: `model`)
    overrides: ModelOverrides = field(default_factory=ModelOverrides)  # the workers' text overrides
    host: str = "127.0.0.1"
    port: int = 30000                # SGLang's default port; 0: any free port
    api_key: str | None = None       # Bearer token every route but /health needs
    admin_api_key: str | None = None  # Bearer token the admin routes need (default: api_key)
    insecure: bool = False           # a non-loopback host without api_key (zpd.ops.exposure)
    curve_keys: str | None = None    # CURVE key directory; the admin key pair is used
    ready_file: str | None = None
    connect_timeout: float = 5.0     # the router must acknowledge each request within this
    router_silence: float = 10.0     # with requests in flight, a router silent this long is gone
    admin_timeout: float = 30.0      # seconds an admin command may take (update: weights_timeout)
    weights_timeout: float = 600.0   # seconds a weight update (disk or a trainer's push) may take
    max_body_bytes: int = 64 << 20   # a request body larger than this is refused (413)
    # Connections and bodies (zpd/http/guard/connections.py, body.py): slow or idle ones are closed.
    keepalive_timeout: float = 75.0  # --keepalive-timeout: idle between requests
    header_timeout: float = 10.0     # --header-timeout: a request's headers, from its first byte
    body_timeout: float = 60.0       # --body-timeout: a request's body, once its route reads it (408)
    max_connections: int = 0         # --max-connections: open at once (0: 3/4 of the fd limit)
    allowed_hosts: tuple[str, ...] = ()  # --allowed-hosts: Host names a keyless front answers
    # What one call may ask for and how its stream is written (docs/http.md, "Streams"):
    # refused with 400 before anything reaches the router, or aborted when unread.
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)  # the cluster's caps
    max_batch_requests: int = 1024   # --max-batch-requests: generations per call (prompts x n)
    incremental_streaming_output: bool = False  # SGLang's flag: /generate events carry only news
    # a cumulative /generate stream writes about this many bytes per token: its events spaced
    cumulative_bytes_per_token: int = 8192
    stream_write_timeout: float = 10.0  # a stream its client has not read for this long is aborted
    stream_buffer_bytes: int = 256 << 10  # a stream's unsent bytes before its writes wait
    stream_buffer_total_bytes: int = 32 << 20  # all streams' unsent bytes before any stalled one waits
    max_call_logprobs: int = 1 << 20  # --max-call-logprobs: prompt logprob entries one call may ask
    max_answer_bytes: int = 512 << 20  # --max-answer-bytes: one call's unstreamed answer, about


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` of the dataclass `cls`."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")
