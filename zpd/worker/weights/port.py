"""What the weights wing may use of its worker: a port the assembly fills from the
core (zpd/ops/worker.py), so that neither sync.py nor tensor_stage.py holds the core."""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

from engines.loader import LoadedModel
from engines.tp.runner import TpRunner


@dataclass(frozen=True)
class SyncPort:
    """What weight sync acts on in its worker: the model, the other tensor-parallel
    ranks, the loop to answer on, and the core's checks and its one weight writer."""
    model: LoadedModel
    ranks: TpRunner | None                            # the other tensor-parallel ranks, if any
    timeout_s: float                                  # --weight-sync-timeout
    call_soon_threadsafe: Callable[..., None]         # run on the worker's loop
    long_call: Callable[[], AbstractContextManager]   # pings answered meanwhile
    running_unpaused: Callable[[], bool]              # requests run and no pause holds them
    require_weights: Callable[[str], None]            # 409 while the weights are released
    set_weights: Callable[[str | None], str]          # the weight version's one writer
