"""Attention over the paged KV pool.

The pool is page-major, [pages, layers, 2 (K/V), page_size, kv_heads, head_dim], so one
page of every layer is one contiguous chunk for the transfer engine. Kernels here see it
as flat rows of [kv_heads, head_dim]: row(page, layer, kv, offset) =
((page * layers + layer) * 2 + kv) * page_size + offset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engines.cpu.kernels import PagedDecode
    from engines.cpu.layer_ops import LayerOps


@dataclass
class PrefillMeta:
    """A packed batch of prompts: sequence i computes seq_lens[i] tokens. With a cached
    prefix (starts[i] > 0) its tokens also attend to the KV of positions
    0..starts[i]-1, already in the pool at context_rows[i]."""
    seq_lens: list[int]
    write_rows: torch.Tensor      # [T] pool row of each token for layer 0, K
    starts: list[int] | None = None                       # None: no sequence has a prefix
    context_rows: list[torch.Tensor | None] | None = None  # [starts[i]] rows, layer 0, K
    last: LastTokens | None = None                        # None: every token's output is read


@dataclass
class DecodeGroup:
    """Sequences of similar length, padded to the longest of them."""
    members: torch.Tensor | None  # [b] their rows in the batch (None: the whole batch)
    read_index: torch.Tensor      # [b, kv_heads, S] element rows (row * kv_heads + head) of layer 0, K
    padding: torch.Tensor | None  # [b, 1, 1, S] True past a row's context; None: no row is padded


@dataclass
class DecodeMeta:
    """One new token per sequence, attending to its whole context through its pages.
    With a `kernel` (engines/cpu/kernels.py, CPU) each sequence reads its first
    lengths[b] `read_rows` in place. Otherwise sequences are grouped by length
    (`group_by_length`), so one long context does not make every short one's gathered
    attention as long."""
    write_rows: torch.Tensor      # [B] pool row of the new token for layer 0, K
    groups: list[DecodeGroup]
    kernel: PagedDecode | None = None
    read_rows: torch.Tensor | None = None   # [B, S] layer-0 K rows of each context (kernel)
    lengths: torch.Tensor | None = None     # [B] context lengths (kernel)


@dataclass
class LastTokens:
    """The tokens of a prefill whose output is read: each sequence's last, for its
    logits. The model's last layer computes only them past the KV write (the other
    tokens' keys and values are all any later step reads of that layer), their
    attention a decode step's over the pool, where the layer has just written every
    token's keys and values; forward returns [B, hidden]. The others' attention, o_proj
    and MLP in that layer were ~1/30 of SmolLM2's prefill."""
    rows: torch.Tensor            # [B] their rows in the packed batch
    attend: DecodeMeta            # their attention, each to its whole sequence


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


class PagedKV:
    """Row views of the pool and per-layer offsets into them."""

    def __init__(self, buffer: torch.Tensor) -> None:
        _, self.num_layers, _, self.page_size, self.kv_heads, self.head_dim = buffer.shape
        self.rows = buffer.view(-1, self.kv_heads, self.head_dim)     # [R, kv_heads, head_dim]
        self.elems = buffer.view(-1, self.head_dim)                   # [R * kv_heads, head_dim]
        # views starting at each (layer, K/V), so layer-0 rows index them without an
        # addition per layer and step
        self._rows = [[self.rows[self.offset(i, kv):] for kv in (0, 1)] for i in range(self.num_layers)]
        self._elems = [[self.elems[self.offset(i, kv) * self.kv_heads:] for kv in (0, 1)]
                       for i in range(self.num_layers)]

    def offset(self, layer: int, kv: int) -> int:
        return (layer * 2 + kv) * self.page_size

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_rows, v_rows = self._rows[layer]
        k_rows.index_copy_(0, rows, k)
        v_rows.index_copy_(0, rows, v)

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of `layer`, indexed by layer-0 K rows: [R', kv_heads, head_dim] each."""
        k_rows, v_rows = self._rows[layer]
        return k_rows, v_rows

    def read(self, layer: int, kv: int, rows: torch.Tensor) -> torch.Tensor:
        """K (kv=0) or V of layer-0 pool rows `rows`: [len(rows), kv_heads, head_dim]."""
        return self._rows[layer][kv].index_select(0, rows)

    def gather(self, layer: int, kv: int, index: torch.Tensor) -> torch.Tensor:
        flat = self._elems[layer][kv].index_select(0, index.view(-1))
        return flat.view(*index.shape, self.head_dim)                 # [B, kv_heads, S, head_dim]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PrefillMeta,
                      scale: float, kv: PagedKV | None = None, layer: int = 0,
                      ops: LayerOps | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence (and over its cached prefix, read
    from `kv`). q: [T, Hq, D]; k, v: [T, Hkv, D]. With `ops` (engines/cpu/layer_ops.py)
    a sequence without a cached prefix goes to its causal kernel where it takes it."""
    out, start = torch.empty_like(q), 0
    for i, n in enumerate(meta.seq_lens):
        end = start + n
        ks, vs, mask = k[start:end], v[start:end], None
        cached = meta.starts[i] if meta.starts else 0
        if ops is not None and not cached:
            o = ops.causal_attention(q[start:end], ks, vs, scale)
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


def decode_attention(q: torch.Tensor, kv: PagedKV, layer: int, meta: DecodeMeta,
                     scale: float) -> torch.Tensor:
    """q: [B, Hq, D] -> [B, Hq, D], reading K/V of the whole context from the pool."""
    if meta.kernel is not None:
        return meta.kernel(q.contiguous(), *kv.layer_rows(layer), meta.read_rows, meta.lengths, scale)
    if len(meta.groups) == 1:
        return _attend(q, kv, layer, meta.groups[0], scale)
    out = torch.empty_like(q)
    for group in meta.groups:
        out.index_copy_(0, group.members, _attend(q.index_select(0, group.members), kv, layer,
                                                  group, scale))
    return out


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
