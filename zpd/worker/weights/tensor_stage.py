"""SGLang's update_weights_from_tensor on one worker: the first phase (staging) of a
push whose tensors are in memory the trainer shares on this host, not broadcast.
Committed or discarded by WeightSync like a broadcast push."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from engines.config import ModelError
from zpd.wire.status import CONFLICT, StatusError
from engines.formats.tensor_payload import PayloadError, decode_named_tensors
from engines.weights.push import MAX_TENSORS, Announced, Shadow, announce, push_limit
from zpd.wire.admin import StageTensors
from zpd.wire.admin_fields import SyncStep
from zpd.wire.admin_reply import Failed, StagedPush
from zpd.worker.scheduler import Respond
from zpd.worker.weights.port import SyncPort


@dataclass(eq=False)
class Staged:
    """A push received in full (into the shadow), waiting for the router's commit or
    discard."""
    update_id: str
    group: str | None          # None: a tensor push (update_weights_from_tensor)
    written: list[Announced]
    nbytes: int


class Staging(Protocol):
    """What a tensor push uses of WeightSync (zpd/worker/weights/sync.py): its port,
    its one-step-at-a-time check, its staging memory and its background step."""
    port: SyncPort
    staged: Staged | None
    shadow: Shadow | None
    abandoned: set[str]                 # pushes discarded while arriving

    @property
    def template(self) -> torch.nn.Module: ...

    def idle_or_409(self) -> None: ...

    def new_shadow(self, device: torch.device) -> Shadow: ...

    def drop_shadow(self) -> None: ...

    def background(self, step: SyncStep, group: str | None,
                   done: Callable[[Any, Exception | None], None],
                   work: Callable[[Any], Any], update_id: str | None = None) -> None: ...


def stage_tensors(sync: Staging, cmd: StageTensors, respond: Respond) -> None:
    """`payload` is this rank's entry of `serialized_named_tensors`. Decoded and
    checked off the loop (engines/formats/tensor_payload.py, a restricted unpickler), then
    staged; answered 400 (nothing staged) if refused."""
    port = sync.port
    update_id, payload, load_format = cmd.update_id, cmd.payload, cmd.load_format
    sync.idle_or_409()
    if port.running_unpaused():
        raise StatusError(CONFLICT, "weights pushed while requests are running: pause first")
    port.require_weights("update_weights_from_tensor")
    net = sync.template
    limit = push_limit(net)
    sync.staged = None                # a newer push replaces one never committed

    def work(_job) -> list[Announced]:
        named = decode_named_tensors(payload, limit, MAX_TENSORS,
                                     bucket=load_format == "flattened_bucket",
                                     rank=cmd.rank, ranks=cmd.ranks)
        items = announce(net, [n for n, _ in named], [str(t.dtype) for _, t in named],
                         [list(t.shape) for _, t in named])
        if sync.shadow is None:       # made here, off the loop: it copies the weights
            sync.shadow = sync.new_shadow(port.model.device)
        with torch.no_grad():
            for a, (_, tensor) in zip(items, named):
                target = sync.shadow.target(a)
                if target is not None:
                    target.copy_(tensor)
        return items

    def done(items: list[Announced] | None, error: Exception | None) -> None:
        abandoned = update_id in sync.abandoned
        sync.abandoned.discard(update_id)
        if isinstance(error, (PayloadError, ModelError)):
            respond(False, Failed(400, f"{error}; nothing applied"))
        elif error is not None:
            respond(False, Failed(500, f"staging the tensors failed: {error}"))
        elif abandoned:
            respond(False, Failed(409, "discarded while receiving"))
        else:
            sync.staged = Staged(update_id, None, items, sum(a.nbytes for a in items))
            respond(True, StagedPush(len(items), sync.staged.nbytes))
        sync.drop_shadow()

    sync.background(SyncStep.PUSHING, None, done, work, update_id)
