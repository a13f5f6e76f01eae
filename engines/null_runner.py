"""The null model's runner (engines/models/null.py says what the model is): ModelRunner's
interface, writing and reading h in the KV pages, sleeping out the spec's time. A
runner, not a model: it picks its backend (the sampler's argmax), as engines/runner.py
does for the real models."""
from __future__ import annotations

import time
from typing import Protocol

import torch

from engines.kv.pool import KVPool
from engines.models.null import PEAK, START, NullNet, mix, next_token
from engines.models.null_spec import VOCAB, NullSpec
from engines.prompt_logprobs import PromptLogprobAsk, PromptLogprobs, prompt_logprobs, scored_run
from engines.torch_backend import TorchBackend


class NullModel(Protocol):
    """What the runner reads of the loaded model (engines/loader.py's LoadedModel):
    its net, which update_weights may replace with one of another seed."""

    net: NullNet


class NullRunner:
    """ModelRunner's interface over the null model: writes and reads h (above) in the
    KV pages, sleeps out the spec's time, and answers logits peaked at the next token."""

    def __init__(self, model: NullModel, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        self.backend = TorchBackend()                # the sampler's argmax
        L = pool.layout
        self.routed = None                           # a dense model: no routed experts
        self.row_words = L.num_kv_heads * L.head_dim * L.element_bytes // 4   # int32s per K row

    @property
    def spec(self) -> NullSpec:
        return self.model.net.spec

    def prefill(self, prompts: list[list[int]], page_tables: list[list[int]],
                starts: list[int] | None = None) -> torch.Tensor:
        return self.prefill_with_logprobs(prompts, page_tables, starts)[0]

    def prefill_with_logprobs(self, prompts: list[list[int]], page_tables: list[list[int]],
                              starts: list[int] | None = None,
                              logprob_from: list[PromptLogprobAsk | int | None] | None = None,
                              routing: str | None = None
                              ) -> tuple[torch.Tensor, list[PromptLogprobs | None]]:
        """ModelRunner's contract: the logits of each prompt's last token, and the prompt
        logprobs asked for (of the same peaked logits at every position). The null model
        is dense: `routing` records nothing (workers refuse requests that ask)."""
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
               page_tables: list[list[int]], routing: str | None = None) -> torch.Tensor:
        began, seed = time.monotonic(), self.spec.seed
        before = self._read(page_tables, [p - 1 for p in positions])
        hs = [mix(h, t, seed) for h, t in zip(before, tokens)]
        self._write(page_tables, positions, hs)
        self._wait(began, self.spec.step_s(len(tokens)))
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
