"""The CPU backend's deterministic mode (--deterministic, docs/deterministic.md): every
number a row computes is reduced in one order, whatever else is in its batch, where
it sits in the batch, how its prompt was chunked and how many threads run.

- products: the library's panel kernel (engines/cpu/panel_products.cpp) for every
  number of rows. Each output is one FMA chain over K from zero, in K's order, then
  the bias; threads share the outputs, never K. The default picks among four paths by
  the number of rows (the 1-8 row kernel, the panels, MKL's or oneDNN's packed
  GEMM, the plain weight), and those round differently.
- attention: a prefill's queries attend through the decode kernel
  (engines/cpu/decode_attention.cpp), each query over its sequence's pool rows in
  position order, as a decode step's query does: so a prompt's positions give the
  same bits in a prefill, in a prefill after a cached prefix and in decode steps.
- norms, rotary and SiLU(gate) * up: the library's per-row kernels, as by default
  (each row in one pass; the SiLU is not fused into the product).
- log-softmax: torch's, one row at a time in one thread (engines/sampler.py,
  engines/prompt_logprobs.py).
"""
from __future__ import annotations

import torch

from engines.config import ModelError
from engines.cpu import products as cpu_products
from engines.cpu.kernels import PagedDecode
from engines.cpu.products import PackedLinear
from engines.kv.meta import PrefillMeta
from engines.kv.paged import PagedKV

# Queries per call of the decode kernel in a prefill: their [queries, context] row
# table is the memory this takes (8 MiB at 4,096 positions).
QUERIES_PER_CALL = 256


class RowProducts:
    """y = x w^T (+ bias) by the panel kernel of w's dtype at every number of rows, from a
    packed copy of w held on the parameter (rebuilt when its values change)."""

    ATTR = "_zpd_rows_packed"

    def __init__(self, dtype: torch.dtype) -> None:
        self.kernel: PackedLinear | None = cpu_products.row_invariant_linear(dtype)
        if self.kernel is None:
            raise ModelError(f"--deterministic on cpu needs the compiled CPU kernels' panel products "
                             f"for {str(dtype).removeprefix('torch.')} (AVX-512 for float32, "
                             f"AVX512-BF16 for bfloat16; ZPD_CPU_KERNELS on): none on this machine")

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.kernel.fits(w) or x.dim() != 2 or x.shape[0] == 0:
            raise ModelError(f"--deterministic: no row-invariant product for a {tuple(w.shape)} "
                             f"{w.dtype} weight and {tuple(x.shape)} input")
        return self.kernel(x, self._copy(w), w.shape[0], bias)

    def _copy(self, w: torch.Tensor) -> torch.Tensor:
        try:
            key = (w.data_ptr(), w._version)
        except RuntimeError:                   # an inference tensor counts no versions
            return self.kernel.pack(w.detach())
        got = getattr(w, self.ATTR, None)
        if got is None or got[0] != key:
            got = (key, self.kernel.pack(w.detach()))
            setattr(w, self.ATTR, got)
        return got[1]


def prefill_by_rows(kernel: PagedDecode, q: torch.Tensor, meta: PrefillMeta, kv: PagedKV, layer: int,
                    scale: float) -> torch.Tensor:
    """Causal attention of a packed prefill, each query as a decode step's: over the
    pool rows of its sequence's positions 0..its own (the layer's keys and values of
    every computed token are in the pool already). q: [T, Hq, D] -> [T, Hq, D]."""
    out, start = torch.empty_like(q), 0
    k_rows, v_rows = kv.layer_rows(layer)
    for i, n in enumerate(meta.seq_lens):
        cached = meta.starts[i] if meta.starts else 0
        own = meta.write_rows[start:start + n]
        rows = own if not cached else torch.cat([meta.context_rows[i], own])
        for lo in range(0, n, QUERIES_PER_CALL):
            hi = min(n, lo + QUERIES_PER_CALL)
            width = cached + hi
            table = rows[:width].expand(hi - lo, width).contiguous()          # [queries, width]
            lengths = torch.arange(cached + lo + 1, cached + hi + 1, dtype=torch.long)
            out[start + lo:start + hi] = kernel(q[start + lo:start + hi].contiguous(), k_rows, v_rows,
                                                table, lengths, scale)
        start += n
    return out
