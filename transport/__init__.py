"""transport: move bytes between registered memory regions of zpd processes.

    backend = transport.create_backend("mooncake", host="127.0.0.1")
    backend.register(addr, nbytes)
    backend.write(transfer_id, peer_session_id, transport.coalesce_runs(...))
    ... poller wakes on backend.fileno() ...
    for c in backend.poll_completions(): ...   # one Completion per transfer id

Backends are chosen by name and imported lazily, so `import transport` works
without Mooncake; asking for "mooncake" without it raises
BackendUnavailableError with the command that installs it. Given a fault
plan (transport/fault_plan.py), the backend comes wrapped in a FaultyBackend;
zpd reads its plan from $ZPD_TRANSPORT_FAULT (zpd/env.py) and passes it in.
This package reads no environment variable of its own and imports neither
zpd nor engines, and not torch.
"""

from __future__ import annotations

from typing import Any

from .base import (MAX_BATCH_ENTRIES, Backend, BackendUnavailableError, Completion, Run,
                   TransportError, coalesce_runs, split_batches)
from .fake import FakeBackend, FakeFabric
from .fault_plan import FaultPlan, FaultPlanError, FaultRule, PlanLike
from .faults import FaultyBackend

BACKENDS = ("mooncake", "fake")

__all__ = [
    "BACKENDS", "MAX_BATCH_ENTRIES", "Backend", "BackendUnavailableError",
    "Completion", "FakeBackend", "FakeFabric", "FaultPlan", "FaultPlanError", "FaultRule",
    "FaultyBackend", "Run", "TransportError", "coalesce_runs", "create_backend", "split_batches",
]


def create_backend(name: str, *, fault_plan: PlanLike = None, **options: Any) -> Backend:
    """Build the backend called `name` ("mooncake" or "fake").

    options go to the backend: for "mooncake" host, device_name, protocol,
    transfer_timeout_s; for "fake" fabric (required) and complete_after_polls.
    A `fault_plan` other than None (even an empty one, so that `set_fault` can
    break writes later) wraps the backend in a FaultyBackend.
    """
    backend = _build(name, options)
    return FaultyBackend(backend, fault_plan) if fault_plan is not None else backend


def _build(name: str, options: dict[str, Any]) -> Backend:
    if name == "mooncake":
        from .mooncake import MooncakeBackend  # lazily: Mooncake may be absent
        return MooncakeBackend(**options)
    if name == "fake":
        if "fabric" not in options:
            raise TransportError('the fake backend needs fabric=transport.FakeFabric()')
        return FakeBackend(**options)
    raise TransportError(f"unknown transport backend {name!r}; known: {', '.join(BACKENDS)}")
