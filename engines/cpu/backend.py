"""The CPU backend: the compiled kernels (engines/cpu/kernels.py, layer_ops.py,
products.py, experts.py) where they take the dtype and the shapes, torch's reference ops
(engines/torch_backend.py) op by op where not. Which kernels run is settled once, when
the backend is made (each is checked against torch or float64 on first use in the
process: a missing or disagreeing one is left out, with a warning)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.backend import ExpertWeights, Heads
from engines.config import ModelError
from engines.cpu.deterministic import RowProducts, prefill_by_rows
from engines.cpu.experts import grouped_experts
from engines.cpu.kernels import SETTINGS, kernel_for
from engines.cpu.layer_ops import layer_ops
from engines.cpu.linear import PackedWeights
from engines.kv.meta import DecodeMeta, PrefillMeta
from engines.kv.paged import PageRows, PagedKV
from engines.torch_backend import TorchBackend, prefill_attention


# The experts kernel reads an expert's weights once per 8 of its rows; past this many
# rows per expert on average torch's loop by packed copies was faster (16 experts, top-2,
# hidden 512, intermediate 512, 2 threads of an AMD EPYC: bfloat16 100 tokens 2.9 ms
# by the kernel against 4.1 ms, 512 tokens 11.0 against 9.9 ms; float32 256 tokens 10.7
# against 6.6 ms).
GROUPED_MAX_ROWS_PER_EXPERT = 16


@dataclass(frozen=True)
class ContextRows:
    """What the decode kernel reads: sequence b's first lengths[b] rows."""
    rows: torch.Tensor            # [B, S] layer-0 K rows of each context, padded to the longest
    lengths: torch.Tensor         # [B] context lengths


class CpuBackend(TorchBackend):
    """`ops`: a layer's element-wise steps in one call each (None: torch's);
    `paged_decode`: decode attention reading the pool in place (None: torch's, over
    gathered copies); `weights`: products by packed weight copies or the library's
    kernels (engines/cpu/linear.py). `deterministic`: one reduction order per row at
    every batch size (engines/cpu/deterministic.py); ModelError where the kernels it
    needs are missing."""

    def __init__(self, dtype: torch.dtype, deterministic: bool = False) -> None:
        super().__init__()
        self.ops = layer_ops(dtype, "cpu")
        self.paged_decode = kernel_for(dtype, "cpu")
        self.weights = PackedWeights(SETTINGS.packed_weights)
        self.deterministic = deterministic
        self.rows: RowProducts | None = None
        if deterministic:
            if self.ops is None or self.paged_decode is None:
                raise ModelError(f"--deterministic on cpu needs the compiled CPU kernels for "
                                 f"{str(dtype).removeprefix('torch.')} (float32 or bfloat16, a C++ "
                                 f"compiler, AVX-512; ZPD_CPU_KERNELS on): not available here")
            self.rows = RowProducts(dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.rows is not None:
            return self.rows.linear(x, weight, bias)
        return self.weights.linear(x, weight, bias)

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            return super().mlp(x, gate_up, down)
        h = None if self.rows is not None else self.weights.gated_linear(x, gate_up)  # fused, where it runs
        if h is None:
            h = self.ops.silu_mul(self.linear(x, gate_up))
        return self.linear(h, down)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: ExpertWeights) -> torch.Tensor:
        """Decode steps and short prompts (up to GROUPED_MAX_ROWS_PER_EXPERT rows per
        expert on average) by the library's experts kernel (engines/cpu/experts.py), one
        call per layer from the plain stacked weights; longer prompts by torch's grouped
        loop, whose experts' products (`mlp`) run by packed copies of the experts they
        read (engines/cpu/linear.py: a second copy of those experts' weights, made on
        first use, rebuilt after a weight update; ZPD_PACKED_WEIGHTS=0: none)."""
        small = ids.numel() <= GROUPED_MAX_ROWS_PER_EXPERT * experts.num and not self.deterministic
        kernel = grouped_experts(x.dtype) if small and x.device.type == "cpu" else None
        gate_up, down = experts.stacked()
        if kernel is None or not (gate_up.is_contiguous() and down.is_contiguous()):
            return super().experts(x, ids, weights, experts)
        return kernel(x, ids, weights, gate_up, down)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.ops is None:
            return super().rms_norm(x, weight, eps)
        return self.ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops is None:
            return super().add_rms_norm(x, residual, weight, eps)
        return self.ops.add_rms_norm(x, residual, weight, eps)

    def rope_write(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: PagedKV,
                   layer: int, write_rows: torch.Tensor, heads: Heads,
                   qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, keys: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rotary embedding and the pool's write in one pass (the kernel has no q/k
        norms and turns whole heads: a model with norms or partial rotary takes torch's).
        A decode step reads keys and values from the pool only: without `keys`, k and v
        are None."""
        if self.ops is None or qk_norm is not None or rope[0].shape[-1] != heads.dim:
            return super().rope_write(qkv, rope, kv, layer, write_rows, heads, qk_norm, keys)
        k_rows, v_rows = kv.layer_rows(layer)
        if not keys:
            return self.ops.rope_write(qkv, *rope, write_rows, k_rows, v_rows, heads.q), None, None
        q, k = self.ops.rope_write(qkv, *rope, write_rows, k_rows, v_rows, heads.q, keys=True)
        v = qkv[:, (heads.q + heads.kv) * heads.dim:].view(qkv.shape[0], heads.kv, heads.dim)
        return q, k, v

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          meta: PrefillMeta, kv: PagedKV, layer: int, heads: Heads) -> torch.Tensor:
        """An uncached prompt by the causal kernel where it takes the heads (a model
        with q/k norms keeps torch's attention, as it keeps torch's rotary). Deterministic:
        every query as a decode step's, by the decode kernel."""
        if self.deterministic:
            return prefill_by_rows(self.paged_decode, q, meta, kv, layer, heads.scale)
        causal = None if self.ops is None or heads.qk_norm else self.ops.causal_attention
        return prefill_attention(q, k, v, meta, heads.scale, kv, layer, causal)

    def decode_attention(self, q: torch.Tensor, kv: PagedKV, layer: int, meta: DecodeMeta,
                         heads: Heads) -> torch.Tensor:
        if self.paged_decode is None:
            return super().decode_attention(q, kv, layer, meta, heads)
        reads: ContextRows = meta.reads
        return self.paged_decode(q.contiguous(), *kv.layer_rows(layer), reads.rows, reads.lengths, heads.scale)

    def prepare(self, write_rows: torch.Tensor, positions: list[int], page_tables: list[list[int]],
                pages: PageRows) -> DecodeMeta:
        """For the kernel: every context's rows, padded to the longest, and its length."""
        if self.paged_decode is None:
            return super().prepare(write_rows, positions, page_tables, pages)
        everyone = list(range(len(positions)))
        return DecodeMeta(write_rows, ContextRows(pages.read_rows(everyone, positions, page_tables),
                                                  pages.tensor(positions) + 1))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """By the kernel of the logits' own dtype where there is one (torch's CPU argmax
        is a scalar loop: 0.84 ms for 16 rows of 49,152 float32 logits and 2.3 ms in
        bfloat16, against 0.08 ms)."""
        ops = layer_ops(logits.dtype, logits.device.type)
        if ops is None or logits.dim() != 2 or not logits.is_contiguous() or logits.shape[1] == 0:
            return super().argmax(logits)
        return ops.argmax(logits)
