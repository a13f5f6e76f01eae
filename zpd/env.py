"""Every environment variable zpd reads, declared, parsed and validated here once.

All three exist for fault and liveness tests, which reach a worker started as
another process through its environment; unset or empty, each changes nothing.

    ZPD_SLOW_CALLS       seconds (0 <= s < 3600) added to every long call of a
                         worker (a forward, a weight load), so a test can keep a
                         worker busy for longer than its peers' --peer-timeout.
    ZPD_DROP_MESSAGES    a drop plan (zpd/wire/drops.py): outgoing control
                         messages the worker loses on purpose, e.g. "kv_done:1"
                         or "kv_dest:2,kv_failed:1".
    ZPD_TRANSPORT_FAULT  a transport fault plan (transport/fault_plan.py): KV
                         writes that fail, are delayed, hang or vanish, e.g.
                         "fail:count=1" or "delay:seconds=2.5;drop:skip=1,count=1"
                         or JSON '[{"mode": "hang", "count": 1}]'. zpd hands it
                         to transport.create_backend, which reads no environment.

`zpd http` and `zpd launch` also read, where neither the flag nor its file
(--api-key-file, --admin-api-key-file) is given (`zpd launch` hands the keys to its
HTTP server this way, so they never show in a process list):

    ZPD_API_KEY          the Bearer token every HTTP route but /health needs (--api-key)
    ZPD_ADMIN_API_KEY    the Bearer token of the admin routes (--admin-api-key)

`zpd slurm` reads its job from Slurm's own variables (SLURM_JOB_ID,
SLURM_JOB_NODELIST, SLURM_JOB_CPUS_PER_NODE, SLURM_SUBMIT_DIR, SLURM_MEM_PER_*;
`slurm_job`), which zpd/ops/slurm.py checks.

A malformed value raises ValueError naming the variable, its value and what is
expected, so the worker stops at start-up. The ZPD_* variables of scripts/*.sh
are the launch scripts' own (they become flags) and are not read here.

The engine reads no environment (it is also used without zpd, from Python); `zpd
run` and every worker hand it these before their model loads (`configure_engine`):

    ZPD_CPU_KERNELS      "0": torch's ops, attention and products instead of the
                         compiled kernels (engines/cpu/kernels.py)
    ZPD_KERNEL_CACHE     a directory: where those kernels are built and kept
                         (default ~/.cache/zpd/kernels)
    ZPD_PACKED_WEIGHTS   "0": no packed weight copies (engines/cpu/linear.py), for a
                         host that cannot spare their memory
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from transport import FaultPlan
from zpd.wire.drops import DropPlan

SLOW_ENV = "ZPD_SLOW_CALLS"
DROP_ENV = "ZPD_DROP_MESSAGES"
FAULT_ENV = "ZPD_TRANSPORT_FAULT"
MAX_SLOW_S = 3600.0

CPU_KERNELS_ENV = "ZPD_CPU_KERNELS"
KERNEL_CACHE_ENV = "ZPD_KERNEL_CACHE"
PACKED_WEIGHTS_ENV = "ZPD_PACKED_WEIGHTS"

API_KEY_ENV = "ZPD_API_KEY"
ADMIN_API_KEY_ENV = "ZPD_ADMIN_API_KEY"

log = logging.getLogger("zpd.env")


@dataclass(frozen=True)
class Knobs:
    """What the environment asks of one worker. `drops` counts down as messages
    are lost, so each worker process builds its own Knobs when it starts."""
    slow_s: float = 0.0                                     # ZPD_SLOW_CALLS
    drops: DropPlan = field(default_factory=DropPlan)       # ZPD_DROP_MESSAGES
    fault_plan: FaultPlan | None = None                     # ZPD_TRANSPORT_FAULT; None: no faults

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "Knobs":
        return cls(slow_s=_seconds(environ, SLOW_ENV),
                   drops=DropPlan.parse(environ.get(DROP_ENV, ""), source=f"${DROP_ENV}"),
                   fault_plan=_fault_plan(environ))


def _seconds(environ: Mapping[str, str], name: str) -> float:
    raw = environ.get(name, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        value = -1.0
    if not 0 <= value < MAX_SLOW_S:      # also refuses nan and inf
        raise ValueError(f"${name}={raw!r}: want seconds, 0 <= s < {MAX_SLOW_S:g}")
    if value:
        log.warning("$%s=%g: every forward of this worker takes %g s more", name, value, value)
    return value


def _fault_plan(environ: Mapping[str, str]) -> FaultPlan | None:
    text = environ.get(FAULT_ENV, "")
    return FaultPlan.parse(text, source=f"${FAULT_ENV}") if text.strip() else None


def configure_engine(environ: Mapping[str, str] = os.environ) -> None:
    """Hand the engine its CPU switches (ZPD_CPU_KERNELS, ZPD_KERNEL_CACHE,
    ZPD_PACKED_WEIGHTS); ValueError on a malformed one, before anything changes."""
    from engines.cpu import kernels as cpu_kernels
    kernels, packed = _switch(environ, CPU_KERNELS_ENV), _switch(environ, PACKED_WEIGHTS_ENV)
    cache = environ.get(KERNEL_CACHE_ENV, "").strip()
    cpu_kernels.configure(kernels, Path(cache) if cache else None, packed)


def _switch(environ: Mapping[str, str], name: str) -> bool:
    raw = environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"${name}={raw!r}: want 1 (on, the default) or 0 (off)")
    if raw == "0":
        log.info("$%s=0: switched off", name)
    return raw != "0"


def http_keys(environ: Mapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """(API key, admin API key) from the environment; None where unset or empty."""
    return environ.get(API_KEY_ENV) or None, environ.get(ADMIN_API_KEY_ENV) or None


def http_child_environ(api_key: str | None, admin_key: str | None,
                       environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment of a `zpd http` child: this one's, with exactly the given keys
    (None: that key unset), so a key never travels on a command line."""
    keys = {API_KEY_ENV: api_key, ADMIN_API_KEY_ENV: admin_key}
    return {k: v for k, v in environ.items() if k not in keys} | \
        {k: v for k, v in keys.items() if v}


def slurm_job(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The SLURM_* variables of the job this process runs in (`zpd slurm`)."""
    return {k: v for k, v in environ.items() if k.startswith("SLURM_")}
