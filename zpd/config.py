"""Frozen configuration records of each process. Addresses and ports are fields,
never constants, so any number of workers share a host without colliding."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase of a request may take before it fails with 504."""
    wait_kv_dest: float = 30.0       # prefill: computed, waiting for decode's page ids
    transfer: float = 20.0           # prefill: one KV write (Mooncake's own timeout is set below)
    wait_pages: float = 60.0         # either side: waiting for free KV pages
    wait_kv_done: float = 60.0       # decode: from kv_dest sent to kv_done received
    stash: float = 30.0              # a message that arrived before its generate
    heartbeat: float = 0.5           # every peer pair pings this often, both ways
    peer_timeout: float = 2.0        # silent this long: the peer is dead (503 for its requests)
    dead_fence: float = 300.0        # decode: longest pages stay fenced for a silent prefill


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
    max_batch: int = 64
    max_prefill_tokens: int = 8192
    transport: str = "mooncake"
    ib_device: str = ""              # RDMA device names for Mooncake ("" = auto/TCP)
    protocol: str = "tcp"
    deadlines: Deadlines = field(default_factory=Deadlines)
    ready_file: str | None = None
    curve_keys: str | None = None    # CURVE key directory (zpd.wire.security); None: plaintext


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    admin_timeout_s: float = 30.0
    heartbeat: float = 0.5           # ping every worker this often
    peer_timeout: float = 2.0        # a worker silent this long is dead until it answers again
    ready_file: str | None = None
    curve_keys: str | None = None    # CURVE key directory (zpd.wire.security); None: plaintext
