"""The null engine: a model with no weights and no compute, for simulating a cluster.

`--model null[:OPTIONS]`, OPTIONS comma-separated `key=value` (a bare first number is
`step_ms`): `null`, `null:5`, `null:step_ms=5,prefill_us=20,kv_bytes=131072,seed=1`,
`null:step_ms=40,experts=128/8`.

- step_ms (20): one decode step, whatever the batch (a mixture's: one that reads every weight);
- prefill_us (50): per prompt token a prefill computes (a cached prefix costs nothing);
- experts (0/0, dense): TOTAL/ACTIVE, a mixture of TOTAL experts routing each token to
  ACTIVE (`experts=128/8`, Qwen3-30B-A3B). A decode step is bound by the weights it
  reads: those outside the experts, 1 - expert_share of them, and the experts its
  batch chose, 1 - (1 - ACTIVE/TOTAL)^batch of them in expectation (uniform routing).
  A step takes step_ms times that share: at batch 1 the active parameters' share
  (128/8: 0.11), nearing step_ms as the batch grows (`NullSpec.step_s`);
- expert_share (0.95): of the weights, the routed experts' part (Qwen3-30B-A3B 0.95,
  Mixtral-8x7B 0.97, GLM-4.5-Air 0.95);
- kv_bytes (4096): KV bytes per token, a multiple of 16 (a page is --page-size times
  this: Llama-3-8B in bfloat16 is 131072);
- seed (0): the "weights". `update_weights` to a null spec takes its seed alone.

The forward sleeps out its time rather than spinning: like a torch forward it releases
the GIL, so the worker's busy responder answers pings meanwhile (zpd/worker/busy.py),
and a hundred simulated workers cost a machine no CPU for their "compute".

The tokens are a function of the context, as a real model's are: position i of a
sequence holds h(i) = mix(h(i-1), token i, seed), and the token after it is
`next_token(h(i))`, printable ASCII (32..126; never EOS, so a request runs to its
max_new_tokens). The prefill writes h(i) into the first 4 bytes of position i's K row
in the KV pages and the decode step reads it back from there, so a page the
transport lost or garbled changes the tokens, and KV recomputed under a new seed
gives that seed's tokens. `predict` is what a test expects."""
from __future__ import annotations

from dataclasses import replace

import torch

from engines.config import ModelError
# NullSpec and is_null live in the torch-free engines/models/null_spec.py, for the HTTP front
from engines.models.null_spec import NullSpec, is_null

FIRST, SPAN = 32, 95                 # tokens are printable ASCII
MASK = 0x7FFFFFFF                    # h fits an int32 of the pool
START = 0x2545F491 & MASK            # h before the first token
PEAK = 50.0                          # the chosen token's logit; the others' are 0


class NullNet(torch.nn.Module):
    """The null model's network: no parameters; its "weights" are the spec's seed."""

    def __init__(self, spec: NullSpec) -> None:
        super().__init__()
        self.spec = spec

    def update(self, spec: str) -> None:
        """Take the seed of null spec `spec`, its weights; its other options (times, KV
        size) stay as loaded. ModelError for a spec that is not a null model's."""
        if not is_null(spec):
            raise ModelError(f"the null model updates only from a null spec "
                             f"(null:seed=N), not {spec!r}")
        self.spec = replace(self.spec, seed=NullSpec.parse(spec).seed)


def mix(h: int, token: int, seed: int) -> int:
    return (((h ^ (token + 1)) * 0x01000193) + seed * 0x9E3779B1 + 1) & MASK


def next_token(h: int) -> int:
    return FIRST + ((h * 2654435761) >> 13) % SPAN


def predict(prompt: list[int], max_new: int, seed: int = 0) -> list[int]:
    """The tokens the null model of `seed` answers `prompt` with."""
    h, out = START, []
    for t in prompt:
        h = mix(h, t, seed)
    for _ in range(max_new):
        out.append(next_token(h))
        h = mix(h, out[-1], seed)
    return out
