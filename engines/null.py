"""The null engine: a model with no weights and no compute, for simulating a cluster.

`--model null[:OPTIONS]`, OPTIONS comma-separated `key=value` (a bare first number is
`step_ms`): `null`, `null:5`, `null:step_ms=5,prefill_us=20,kv_bytes=131072,seed=1`.

- step_ms (20): one decode step, whatever the batch;
- prefill_us (50): per prompt token a prefill computes (a cached prefix costs nothing);
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

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engines.kv.pool import KVPool
from engines.models.config import ModelError
# NullSpec and is_null live in the torch-free engines/null_spec.py, for the HTTP front
from engines.null_spec import VOCAB, NullSpec, is_null
from engines.prompt_logprobs import PromptLogprobAsk, PromptLogprobs, prompt_logprobs, scored_run
from engines.torch_backend import TorchBackend

if TYPE_CHECKING:
    from engines.loader import LoadedModel

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


class NullRunner:
    """ModelRunner's interface over the null model: writes and reads h (above) in the
    KV pages, sleeps out the spec's time, and answers logits peaked at the next token."""

    def __init__(self, model: LoadedModel, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        self.backend = TorchBackend()                # the sampler's argmax
        L = pool.layout
        self.row_words = L.num_kv_heads * L.head_dim * L.element_bytes // 4   # int32s per K row

    @property
    def spec(self) -> NullSpec:
        return self.model.net.spec

    def prefill(self, prompts: list[list[int]], page_tables: list[list[int]],
                starts: list[int] | None = None) -> torch.Tensor:
        return self.prefill_with_logprobs(prompts, page_tables, starts)[0]

    def prefill_with_logprobs(self, prompts: list[list[int]], page_tables: list[list[int]],
                              starts: list[int] | None = None,
                              logprob_from: list[PromptLogprobAsk | int | None] | None = None
                              ) -> tuple[torch.Tensor, list[PromptLogprobs | None]]:
        """ModelRunner's contract: the logits of each prompt's last token, and the prompt
        logprobs asked for (of the same peaked logits at every position)."""
        began, starts = time.monotonic(), starts or [0] * len(prompts)
        if min(len(p) - s for p, s in zip(prompts, starts)) < 1:
            raise ValueError("a prefill computes at least one token of each prompt")
        computed = [self._chain(p, t, s) for p, t, s in zip(prompts, page_tables, starts)]
        self._wait(began, self.spec.prefill_us * 1e-6 * sum(map(len, computed)))
        logits = self._logits([hs[-1] for hs in computed])
        asks = [PromptLogprobAsk(a) if isinstance(a, int) else a
                for a in logprob_from or [None] * len(prompts)]
        runs = [scored_run(a, len(p), s) for a, p, s in zip(asks, prompts, starts)]
        if not any(runs):
            return logits, [None] * len(prompts)
        rows = [h for hs, s, r in zip(computed, starts, runs) if r
                for h in hs[r.position - s:r.position - s + r.count]]
        hidden = torch.tensor(rows, dtype=torch.int64, device=self.pool.device)[:, None]
        return logits, prompt_logprobs(lambda h: self._logits(h[:, 0].tolist()), hidden,
                                       prompts, asks, runs, VOCAB)

    def _chain(self, prompt: list[int], table: list[int], start: int) -> list[int]:
        """h at positions start..len-1 of `prompt`, written into its pages (what comes
        before `start` is there already: a cached prefix)."""
        h, hs, seed = (self._read([table], [start - 1])[0] if start else START), [], self.spec.seed
        for t in prompt[start:]:
            h = mix(h, t, seed)
            hs.append(h)
        positions = list(range(start, len(prompt)))
        self._write([table] * len(hs), positions, hs)
        return hs

    def decode(self, tokens: list[int], positions: list[int],
               page_tables: list[list[int]]) -> torch.Tensor:
        began, seed = time.monotonic(), self.spec.seed
        before = self._read(page_tables, [p - 1 for p in positions])
        hs = [mix(h, t, seed) for h, t in zip(before, tokens)]
        self._write(page_tables, positions, hs)
        self._wait(began, self.spec.step_ms * 1e-3)
        return self._logits(hs)

    def _index(self, tables: list[list[int]], positions: list[int]) -> tuple[list[int], list[int]]:
        size = self.pool.layout.page_size
        return [t[p // size] for t, p in zip(tables, positions)], \
            [(p % size) * self.row_words for p in positions]

    def _words(self) -> torch.Tensor:
        """The pool as int32 words, one row per page (K rows first: one layer)."""
        return self.pool.buffer.view(self.pool.num_pages, -1).view(torch.int32)

    def _read(self, tables: list[list[int]], positions: list[int]) -> list[int]:
        pages, offsets = self._index(tables, positions)
        return self._words()[pages, offsets].tolist()

    def _write(self, tables: list[list[int]], positions: list[int], hs: list[int]) -> None:
        if hs:
            pages, offsets = self._index(tables, positions)
            self._words()[pages, offsets] = torch.tensor(hs, dtype=torch.int32,
                                                         device=self.pool.device)

    def _logits(self, hs: list[int]) -> torch.Tensor:
        logits = torch.zeros(len(hs), VOCAB, dtype=torch.float32, device=self.pool.device)
        logits[range(len(hs)), [next_token(h) for h in hs]] = PEAK
        return logits

    @staticmethod
    def _wait(began: float, seconds: float) -> None:
        left = began + seconds - time.monotonic()
        if left > 0:
            time.sleep(left)
