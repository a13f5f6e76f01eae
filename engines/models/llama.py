"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV pool."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.attention import (DecodeMeta, LastTokens, PagedKV, PrefillMeta, decode_attention,
                               prefill_attention)
from engines.models.config import ModelConfig
from engines.cpu.layer_ops import LayerOps, layer_ops
from engines.linear import gated_linear, linear
from engines.models.rope import RotaryEmbedding, apply_rotary

# checkpoint name suffix -> (our parameter suffix, shard) for fused projections
PACKED_WEIGHTS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised: every value is overwritten by the checkpoint loader.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = _param(dim), eps

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        # at least float32 for the variance, as the reference does for half types
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.shards = {"q": (0, self.hq * self.d), "k": (self.hq * self.d, self.hkv * self.d),
                       "v": ((self.hq + self.hkv) * self.d, self.hkv * self.d)}
        self.qkv_proj = nn.Module()
        self.qkv_proj.weight = _param((self.hq + 2 * self.hkv) * self.d, cfg.hidden_size)
        self.qkv_proj.bias = _param((self.hq + 2 * self.hkv) * self.d) if cfg.attention_bias else None
        self.o_proj = nn.Module()
        self.o_proj.weight = _param(cfg.hidden_size, self.hq * self.d)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.d ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: PagedKV,
                layer: int, meta: PrefillMeta | DecodeMeta, ops: LayerOps | None = None,
                last: LastTokens | None = None) -> torch.Tensor:
        """-> [T, hidden]; with `last` (a prefill's last layer), of its rows only."""
        t = x.shape[0]
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        if ops is not None and self.q_norm is None:
            # rotary embedding and the pool's write in one pass; a decode step reads
            # keys and values from the pool only, a prefill also attends to its own
            if isinstance(meta, DecodeMeta):
                q = ops.rope_write(qkv, *rope, meta.write_rows, *kv.layer_rows(layer), self.hq)
                o = decode_attention(q, kv, layer, meta, self.scale)
            elif last is not None:
                q = ops.rope_write(qkv, *rope, meta.write_rows, *kv.layer_rows(layer), self.hq)
                o = decode_attention(q[last.rows], kv, layer, last.attend, self.scale)
            else:
                q, k = ops.rope_write(qkv, *rope, meta.write_rows, *kv.layer_rows(layer), self.hq, keys=True)
                v = qkv[:, (self.hq + self.hkv) * self.d:].view(t, self.hkv, self.d)
                o = prefill_attention(q, k, v, meta, self.scale, kv, layer, ops)
            return linear(o.reshape(o.shape[0], self.hq * self.d), self.o_proj.weight)
        qk, v = qkv.split([(self.hq + self.hkv) * self.d, self.hkv * self.d], dim=-1)
        qk, v = qk.view(t, self.hq + self.hkv, self.d), v.view(t, self.hkv, self.d)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.hq]), self.k_norm(qk[:, self.hq:])], dim=1)
        qk = apply_rotary(qk, *rope)                     # queries and keys in one pass
        q, k = qk[:, :self.hq], qk[:, self.hq:]
        kv.write(layer, meta.write_rows, k, v)
        if last is not None:
            o = decode_attention(q[last.rows], kv, layer, last.attend, self.scale)
        elif isinstance(meta, PrefillMeta):
            o = prefill_attention(q, k, v, meta, self.scale, kv, layer)   # [T, Hq, D]
        else:
            o = decode_attention(q, kv, layer, meta, self.scale)
        return linear(o.reshape(o.shape[0], self.hq * self.d), self.o_proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.shards = {"gate": (0, self.inter), "up": (self.inter, self.inter)}
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = _param(2 * self.inter, cfg.hidden_size)
        self.down_proj = nn.Module()
        self.down_proj.weight = _param(cfg.hidden_size, self.inter)

    def forward(self, x: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        if ops is not None:             # SiLU(gate) * up in the product where the kernel does it
            h = gated_linear(x, self.gate_up_proj.weight)
            if h is None:
                h = ops.silu_mul(linear(x, self.gate_up_proj.weight))
            return linear(h, self.down_proj.weight)
        gate_up = linear(x, self.gate_up_proj.weight)
        gate, up = gate_up.split(self.inter, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, kv: PagedKV, meta, ops: LayerOps | None = None,
                last: LastTokens | None = None) -> torch.Tensor:
        """`ops`: the compiled element-wise steps (engines/cpu/layer_ops.py), or None for
        torch's ops. With `last`, only its rows come out."""
        h = self.self_attn(self.input_layernorm(x, ops), rope, kv, self.index, meta, ops, last)
        if last is not None:
            x = x[last.rows]
        if ops is None:
            x = x + h
            h = self.post_attention_layernorm(x)
        else:
            norm = self.post_attention_layernorm
            h, x = ops.add_rms_norm(h, x, norm.weight, norm.eps)
        return x + self.mlp(h, ops)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints, except the fused
    qkv_proj / gate_up_proj (see PACKED_WEIGHTS)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Module()
        self.lm_head.weight = (self.model.embed_tokens.weight if cfg.tie_word_embeddings
                               else _param(cfg.vocab_size, cfg.hidden_size))
        self.rotary: RotaryEmbedding | None = None

    def linears(self) -> list[nn.Parameter]:
        """The weights `linear` multiplies by: every projection and the head."""
        out = [self.lm_head.weight]
        for layer in self.model.layers:
            out += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                    layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
        return out

    def column_major_float32(self) -> None:
        """Hold the float32 projection and head weights column-major: still [out, in]
        parameters, now transposed views of contiguous [in, out] memory, so `F.linear`
        runs as x @ W^T without a transposed operand, which MKL does faster here
        (decode steps of SmolLM2 on 2 threads: 6% at batch 1, 25% at batch 16). Loading
        and weight updates copy into the parameters and keep the layout. In bfloat16
        the row-major layout is the faster one, so other dtypes are left as they are."""
        for w in self.linears():
            if w.dtype == torch.float32 and w.is_contiguous():
                w.data = w.data.t().contiguous().t()

    def setup_rotary(self, dtype: torch.dtype, device: torch.device) -> None:
        c = self.cfg
        self.rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, c.rope_scaling,
                                      dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKV,
                meta: PrefillMeta | DecodeMeta) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (before the last
        norm), or of a prefill's meta.last tokens only, [B, hidden]."""
        rope = self.rotary.tables(positions)
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        ops = layer_ops(x.dtype, x.device.type)
        *layers, final = self.model.layers
        for layer in layers:
            x = layer(x, rope, kv, meta, ops)
        return final(x, rope, kv, meta, ops, meta.last if isinstance(meta, PrefillMeta) else None)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(self.model.norm(hidden.contiguous(), layer_ops(hidden.dtype, hidden.device.type)),
                      self.lm_head.weight)
