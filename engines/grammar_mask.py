"""The logits mask of a batch's constrained rows: llguidance fills one bit per token for
each row's matcher (in parallel, on its own threads), and the bits become a boolean
mask the sampler applies (engines/sampler.py). CPU work: at batch 16 with a JSON schema
it is bench/bench_grammar.py's figure."""
from __future__ import annotations

from dataclasses import dataclass, field

import llguidance as llg
import numpy as np
import torch

from engines.grammar import Matcher


@dataclass
class Allowed:
    """The tokens each constrained row may draw: `rows` of the batch, `blocked`
    [len(rows), vocab] (True: not allowed), `ended` the rows whose grammar is complete
    (only an end token may follow: the min_new_tokens ban does not hold them back)."""
    rows: list[int]
    blocked: torch.Tensor
    ended: set[int] = field(default_factory=set)

    @property
    def mask(self) -> torch.Tensor:
        """True where allowed."""
        return ~self.blocked


class MaskMaker:
    """One per worker: llguidance's thread pool and a reusable bit buffer."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.words = vocab, (vocab + 31) // 32
        self.executor = llg.LLExecutor()

    def __call__(self, matchers: list[Matcher | None], device: torch.device) -> Allowed | None:
        """The mask of the rows with a matcher that follows its grammar (None: no row)."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.problem]
        if not rows:
            return None
        words = torch.empty((len(rows), self.words), dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr([(matchers[i].inner, j) for j, i in enumerate(rows)],
                                              words.data_ptr(), self.words * 4, len(rows))
        # bit j of word w is token 32w + j (little-endian): one byte per token, 1 = blocked
        blocked = np.unpackbits((~words).numpy().view(np.uint8), axis=1, count=self.vocab,
                                bitorder="little")
        return Allowed(rows, torch.from_numpy(blocked).view(torch.bool).to(device, non_blocking=True),
                       {i for i in rows if matchers[i].ended})
