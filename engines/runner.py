"""Batched forward passes through page tables: prefill of whole prompts, decode steps."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engines.backend import Backend
from engines.cpu.backend import CpuBackend
from engines.kv.meta import DecodeMeta, LastTokens, PrefillMeta, ScoredRows
from engines.kv.paged import PageRows
from engines.kv.pool import KVPool
from engines.loader import LoadedModel
from engines.models.moe import RoutingCapture
from engines.prompt_logprobs import PromptLogprobAsk, PromptLogprobs, ScoredRun, prompt_logprobs, scored_run
from engines.torch_backend import TorchBackend

if TYPE_CHECKING:
    from engines.tp.group import TpGroup


def backend_for(dtype: torch.dtype, device: torch.device, deterministic: bool = False) -> Backend:
    """The layer operations a model of `dtype` runs on `device` with: the CPU kernels
    where they run (torch's ops for the rest), torch's ops elsewhere. `deterministic`:
    batch-invariant on CPU (engines/cpu/deterministic.py), torch's deterministic
    algorithms elsewhere (engines/torch_backend.py)."""
    if device.type == "cpu":
        return CpuBackend(dtype, deterministic)
    return TorchBackend(deterministic)


class ModelRunner:
    """Runs one model against one KV pool, through the backend it picks for them.
    Inputs are plain lists; outputs are logits of the last position of each sequence,
    [B, vocab], in the model's dtype."""

    def __init__(self, model: LoadedModel, pool: KVPool, tp: TpGroup | None = None,
                 deterministic: bool = False) -> None:
        """`tp`: the tensor-parallel group `model` is one rank's part of (engines/tp/);
        only its leader computes logits, the others' forwards answer None.
        `deterministic`: --deterministic (docs/deterministic.md)."""
        self.model, self.pool, self.device = model, pool, model.device
        L = pool.layout
        self.pages = PageRows(L.page_size, L.num_layers * 2 * L.page_size, L.num_kv_heads, self.device)
        self.backend = backend_for(model.dtype, model.device, deterministic)
        # the attention's and dense MLPs' sums; none where they are whole on every rank
        # (--ep alone: the experts' dispatch has the group, engines/tp/experts.py)
        self.backend.group = None if model.shard is not None and model.shard.plan.replicated else tp
        self.leads = tp is None or tp.leads
        # the routed experts of the last forward's input rows, when it was asked to
        # record them (`routing`: "ids", or "weights" with them; engines/routed.py)
        self.routed: RoutingCapture | None = None

    def prefill(self, prompts: list[list[int]], page_tables: list[list[int]],
                starts: list[int] | None = None) -> torch.Tensor:
        """Compute and store the KV of each prompt from position starts[i] on (the KV
        before it is in its pages already: a cached prefix); logits of each prompt's
        last token."""
        return self.prefill_with_logprobs(prompts, page_tables, starts)[0]

    def prefill_with_logprobs(self, prompts: list[list[int]], page_tables: list[list[int]],
                              starts: list[int] | None = None,
                              logprob_from: list[PromptLogprobAsk | int | None] | None = None,
                              routing: str | None = None
                              ) -> tuple[torch.Tensor, list[PromptLogprobs | None]]:
        """`prefill`'s logits, the same bits, and each prompt's logprobs where
        logprob_from[i] asks (an int k: PromptLogprobAsk(k)), None for the others
        (engines/prompt_logprobs.py has the contract). The logprobs of positions from
        k read the logits of positions max(k, 1) - 1 on, which a prefill from a cached
        prefix does not compute: starts[i] > max(k, 1) - 1 is a ValueError, and the
        caller prefills such a prompt from at most max(k, 1) - 1 (its KV is the same).
        With `routing`, `self.routed` has the experts of every computed position, the
        prompts' rows packed in order (each from starts[i])."""
        starts = starts or [0] * len(prompts)
        lens = [len(p) - s for p, s in zip(prompts, starts)]
        if min(lens) < 1:      # its last token would be another prompt's (the cache leaves one)
            raise ValueError(f"a prefill computes at least one token of each prompt: {lens}")
        asks = [PromptLogprobAsk(a) if isinstance(a, int) else a for a in logprob_from or [None] * len(prompts)]
        runs = [scored_run(a, len(p), s) for a, p, s in zip(asks, prompts, starts)]
        rows_of, tensor = self.pages.rows, self.pages.tensor
        tables = [tensor(pt) for pt in page_tables]
        positions = [torch.arange(s, len(p), device=self.device) for p, s in zip(prompts, starts)]
        rows = torch.cat([rows_of(t, pos) for t, pos in zip(tables, positions)])
        meta = PrefillMeta(lens, rows)
        if any(starts):
            meta.starts = starts
            meta.context_rows = [rows_of(t, torch.arange(s, device=self.device)) if s else None
                                 for t, s in zip(tables, starts)]
        ids = tensor([t for p, s in zip(prompts, starts) for t in p[s:]])
        last = torch.cumsum(tensor(lens), 0) - 1
        ends = [len(p) - 1 for p in prompts]
        meta.last = LastTokens(last, self._decode_meta(rows[last], ends, page_tables))
        meta.scored = self._scored(runs, starts, lens, rows, tables)
        net = self.model.net
        hidden = self._forward(ids, torch.cat(positions), meta, routing)  # [B (+ R), hidden]
        B = len(prompts)
        if not self.leads:
            return None, [None] * B
        logits = net.logits(hidden[:B], self.backend)
        if not any(runs):
            return logits, [None] * B
        return logits, prompt_logprobs(lambda h: net.logits(h, self.backend), hidden[B:], prompts,
                                       asks, runs, net.cfg.vocab_size, self.backend.deterministic)

    def _scored(self, runs: list[ScoredRun | None], starts: list[int], lens: list[int],
                rows: torch.Tensor, tables: list[torch.Tensor]) -> ScoredRows | None:
        """The rows of the runs in the packed batch, and their attention as a prefill
        of each run after its earlier positions."""
        mine = [i for i, r in enumerate(runs) if r is not None and r.count]
        if not mine:
            return None
        offsets = [sum(lens[:i]) - starts[i] for i in range(len(lens))]   # packed row of position 0
        picked = torch.cat([torch.arange(runs[i].count, device=self.device) + offsets[i] + runs[i].position
                            for i in mine])
        at = [runs[i].position for i in mine]
        attend = PrefillMeta([runs[i].count for i in mine], rows[picked], at,
                             [self.pages.rows(tables[i], torch.arange(runs[i].position, device=self.device))
                              if runs[i].position else None for i in mine])
        return ScoredRows(picked, attend)

    def decode(self, tokens: list[int], positions: list[int],
               page_tables: list[list[int]], routing: str | None = None) -> torch.Tensor:
        """Feed token i at position i of its sequence; it attends to positions 0..pos.
        With `routing`, `self.routed` has each token's experts, a row per token."""
        page_size, tensor = self.pages.page_size, self.pages.tensor
        pos = tensor(positions)
        own = tensor([pt[p // page_size] for pt, p in zip(page_tables, positions)])
        meta = self._decode_meta(own * self.pages.page_stride + pos % page_size, positions, page_tables)
        hidden = self._forward(tensor(tokens), pos, meta, routing)
        return self.model.net.logits(hidden, self.backend) if self.leads else None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta, routing: str | None):
        """The network's forward, recording its rows' experts where `routing` asks (every
        rank of a tensor-parallel group records, so all run the same products; a dense
        model records nothing)."""
        net, cfg = self.model.net, self.model.net.cfg
        self.routed = None
        if routing is not None and cfg.moe is not None:
            self.routed = RoutingCapture(ids.shape[0], cfg.num_layers, cfg.moe.top_k,
                                         routing == "weights", self.device)
        net.capture = self.routed
        try:
            return net(ids, positions, self.pool.kv, meta, self.backend)
        finally:
            net.capture = None

    def _decode_meta(self, write_rows: torch.Tensor, positions: list[int],
                     page_tables: list[list[int]]) -> DecodeMeta:
        """Batch row i at positions[i] of its sequence, attending to positions 0..positions[i]."""
        return self.backend.prepare(write_rows, positions, page_tables, self.pages)
