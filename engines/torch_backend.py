"""The reference backend: each layer operation in torch's ops, on any device (CUDA runs
it until it has kernels of its own; engines/cpu/backend.py falls back to it op by op)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engines.backend import ExpertWeights, Heads
from engines.kv.meta import DecodeMeta, PrefillMeta
from engines.kv.paged import PageRows, PagedKV
from engines.models.rope import apply_rotary

# A kernel for one uncached prompt's causal attention: (q, k, v, scale) -> out, or None
# where it does not take the shapes.
Causal = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], "torch.Tensor | None"]


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences of similar length, padded to the longest of them."""
    members: torch.Tensor | None  # [b] their rows in the batch (None: the whole batch)
    read_index: torch.Tensor      # [b, kv_heads, S] element rows (row * kv_heads + head) of layer 0, K
    padding: torch.Tensor | None  # [b, 1, 1, S] True past a row's context; None: no row is padded


class TorchBackend:
    """engines/backend.py's `Backend` in torch's ops. Its composite steps (the MLP, the
    residual addition) multiply through `self.linear`, so a subclass's products serve
    them too. `group`: the tensor-parallel group (engines/tp/group.py) its all-reduce
    sums over (None: one rank)."""

    group = None

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        if deterministic:
            deterministic_torch()

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(x, gate_up).split(gate_up.shape[0] // 2, dim=-1)
        return self.linear(F.silu(gate) * up, down)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: ExpertWeights) -> torch.Tensor:
        """Grouped: the (token, expert) pairs sorted by expert, each chosen expert's MLP
        (`self.mlp`, so a subclass's products serve it) on its tokens at once, its
        outputs scaled by their weights and added to their tokens. Experts no token
        chose are not read. On a GPU this loop is what a fused-MoE kernel replaces."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=experts.num).tolist()
        tokens = order // k                                   # the token of each sorted pair
        picked = x.index_select(0, tokens)
        out = torch.empty_like(picked)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate_up, down = experts.expert(e)
                out[start:start + n] = self.mlp(picked[start:start + n], gate_up, down)
                start += n
        out *= weights.reshape(-1)[order].to(x.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x
        return rms_norm(total, weight, eps), total

    def rope_write(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: PagedKV,
                   layer: int, write_rows: torch.Tensor, heads: Heads,
                   qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, keys: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, hq, hkv, d = qkv.shape[0], heads.q, heads.kv, heads.dim
        qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
        qk, v = qk.view(t, hq + hkv, d), v.view(t, hkv, d)
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            qk = torch.cat([rms_norm(qk[:, :hq], q_weight, eps), rms_norm(qk[:, hq:], k_weight, eps)], dim=1)
        qk = apply_rotary(qk, *rope)                     # queries and keys in one pass
        q, k = qk[:, :hq], qk[:, hq:]
        kv.write(layer, write_rows, k, v)
        return q, k, v

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          meta: PrefillMeta, kv: PagedKV, layer: int, heads: Heads) -> torch.Tensor:
        return prefill_attention(q, k, v, meta, heads.scale, kv, layer)

    def decode_attention(self, q: torch.Tensor, kv: PagedKV, layer: int, meta: DecodeMeta,
                         heads: Heads) -> torch.Tensor:
        groups: list[DecodeGroup] = meta.reads
        if len(groups) == 1:
            return _attend(q, kv, layer, groups[0], heads.scale)
        out = torch.empty_like(q)
        for group in groups:
            out.index_copy_(0, group.members, _attend(q.index_select(0, group.members), kv, layer,
                                                      group, heads.scale))
        return out

    def prepare(self, write_rows: torch.Tensor, positions: list[int], page_tables: list[list[int]],
                pages: PageRows) -> DecodeMeta:
        """Sequences grouped by length (`group_by_length`), so one long context does not
        make every short one's gathered attention as long."""
        groups = group_by_length(positions)
        whole = len(groups) == 1
        if whole:                                  # one group: the batch's own row order
            groups = [list(range(len(positions)))]
        return DecodeMeta(write_rows, [_group(rows, positions, page_tables, whole, pages) for rows in groups])

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self.group.all_reduce(x)


def deterministic_torch() -> None:
    """torch's deterministic algorithms, for --deterministic on a GPU: the same bits for
    the same batch from run to run (cuBLAS with a fixed workspace, the deterministic
    form of the kernels that have one; an op without one warns rather than failing a
    request). It does not make a row's bits independent of its batch: cuBLAS and SDPA
    pick their kernels and split K by the shapes (docs/deterministic.md)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")     # read when cuBLAS starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # at least float32 for the variance, as the reference does for half types
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PrefillMeta,
                      scale: float, kv: PagedKV | None = None, layer: int = 0,
                      causal: Causal | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence (and over its cached prefix, read
    from `kv`). q: [T, Hq, D]; k, v: [T, Hkv, D]. A sequence without a cached prefix
    goes to `causal` where it takes it."""
    out, start = torch.empty_like(q), 0
    for i, n in enumerate(meta.seq_lens):
        end = start + n
        ks, vs, mask = k[start:end], v[start:end], None
        cached = meta.starts[i] if meta.starts else 0
        if causal is not None and not cached:
            o = causal(q[start:end], ks, vs, scale)
            if o is not None:
                out[start:end] = o
                start = end
                continue
        if cached:
            rows = meta.context_rows[i]
            ks = torch.cat([kv.read(layer, 0, rows), ks])
            vs = torch.cat([kv.read(layer, 1, rows), vs])
            # query j sits at position cached + j and sees keys 0..cached + j
            mask = (torch.arange(cached + n, device=q.device)[None, :]
                    <= cached + torch.arange(n, device=q.device)[:, None])
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[start:end], ks, vs))  # [1, H, *, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out


def group_by_length(lengths: list[int]) -> list[list[int]]:
    """Batch rows in groups, longest first: each group holds the rows at least half as
    long as its longest, so padding at most doubles a group's work, and there are at
    most log2(longest / shortest) + 1 groups."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and 2 * lengths[i] >= lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _group(rows: list[int], positions: list[int], page_tables: list[list[int]], whole: bool,
           pages: PageRows) -> DecodeGroup:
    """Read rows and mask of batch rows `rows`, padded to the longest of them."""
    read_rows = pages.read_rows(rows, positions, page_tables)        # [b, S]
    span = read_rows.shape[1]
    steps = torch.arange(span, device=pages.device)
    heads = torch.arange(pages.kv_heads, device=pages.device)
    padded = any(positions[i] + 1 < span for i in rows)
    pos = pages.tensor([positions[i] for i in rows]) if padded else None
    return DecodeGroup(
        members=None if whole else pages.tensor(rows),
        read_index=read_rows[:, None, :] * pages.kv_heads + heads[None, :, None],  # [b, Hkv, S]
        padding=(steps[None, :] > pos[:, None])[:, None, None, :] if padded else None)  # [b, 1, 1, S]


# Up to this many rows a group attends with torch's fused kernel, which measured faster
# there (SmolLM2's shapes, 256 positions, one layer: bfloat16 1 row 139 -> 60 us,
# 8 rows 487 -> 322 us; float32 1 row 137 -> 104 us) and more accurate in bfloat16; at
# 16 rows it tied and at 64 it was slower than the plain products below.
FUSED_MAX_ROWS = 8


def _attend(q: torch.Tensor, kv: PagedKV, layer: int, group: DecodeGroup, scale: float) -> torch.Tensor:
    b, hq, d = q.shape
    k = kv.gather(layer, 0, group.read_index)                        # [b, Hkv, S, D]
    v = kv.gather(layer, 1, group.read_index)
    qg = q.view(b, kv.kv_heads, hq // kv.kv_heads, d)                # [b, Hkv, G, D]
    if b <= FUSED_MAX_ROWS:
        keep = None if group.padding is None else ~group.padding
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=keep, scale=scale).view(b, hq, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale           # [b, Hkv, G, S]
    if group.padding is not None:
        scores = scores.masked_fill(group.padding, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)             # [b, Hkv, G, D]
    return out.view(b, hq, d)
