"""Rotary position embeddings, including linear and llama3 frequency scaling."""
from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # float32 like the reference implementation, so float64 runs still match it exactly
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept,
    and the band between is interpolated smoothly."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position. The sin table's first
    half is negated: rotating is then x * cos + roll(x) * sin (`apply_rotary`)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                      # [max_pos, head_dim]
        sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = (emb.sin() * sign).to(dtype=dtype, device=device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each token: [T, 1, head_dim], broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated in the half-split convention: x * cos +
    (-x2, x1) * sin, with the sign in the table (roll(x) is (x2, x1)): the same
    products, bit for bit, in four operations instead of seven. Tables narrower than
    the heads (partial rotary, GLM-4.5) turn each head's first dims and pass the rest."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, -1) * sin
    turned = x[..., :r]
    return torch.cat([turned * cos + turned.roll(r // 2, -1) * sin, x[..., r:]], dim=-1)
