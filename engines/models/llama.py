"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and its mixtures of experts
(Qwen3-MoE, Mixtral, GLM-4.5: engines/models/moe.py) over a paged KV pool."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.backend import Backend, Heads
from engines.kv.meta import DecodeMeta, LastTokens, PrefillMeta
from engines.kv.paged import PagedKV
from engines.config import ModelConfig
from engines.models.mlp import MLP, param as _param
from engines.models.moe import RoutingCapture, SparseMoe
from engines.models.rope import RotaryEmbedding

# checkpoint name suffix -> (our parameter suffix, shard) for fused projections
PACKED_WEIGHTS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = _param(dim), eps

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.heads = Heads(self.hq, self.hkv, self.d, cfg.qk_norm)
        self.shards = {"q": (0, self.hq * self.d), "k": (self.hq * self.d, self.hkv * self.d),
                       "v": ((self.hq + self.hkv) * self.d, self.hkv * self.d)}
        self.qkv_proj = nn.Module()
        self.qkv_proj.weight = _param((self.hq + 2 * self.hkv) * self.d, cfg.hidden_size)
        self.qkv_proj.bias = _param((self.hq + 2 * self.hkv) * self.d) if cfg.attention_bias else None
        self.o_proj = nn.Module()
        self.o_proj.weight = _param(cfg.hidden_size, self.hq * self.d)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: PagedKV,
                layer: int, meta: PrefillMeta | DecodeMeta, backend: Backend,
                last: LastTokens | None = None) -> torch.Tensor | list[torch.Tensor]:
        """-> [T, hidden]; with `last` (a prefill's last layer), of its rows only, then
        of meta.scored's rows if any: a list, each part computed on its own."""
        qkv = backend.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)   # [T, (Hq + 2 Hkv) D]
        norms = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        prefill = isinstance(meta, PrefillMeta)
        scored = meta.scored if prefill and last is not None else None
        q, k, v = backend.rope_write(qkv, rope, kv, layer, meta.write_rows, self.heads, norms,
                                     keys=prefill and (last is None or scored is not None))  # q: [T, Hq, D]
        if last is not None:        # their attention over the pool, where every token now is
            parts = [backend.decode_attention(q[last.rows], kv, layer, last.attend, self.heads)]
            if scored is not None:
                r = scored.rows
                parts.append(backend.prefill_attention(q[r], k[r], v[r], scored.attend, kv, layer, self.heads))
            return [self._out(o, backend) for o in parts]
        if prefill:
            return self._out(backend.prefill_attention(q, k, v, meta, kv, layer, self.heads), backend)
        return self._out(backend.decode_attention(q, kv, layer, meta, self.heads), backend)

    def _out(self, o: torch.Tensor, backend: Backend) -> torch.Tensor:
        # row parallel under tensor parallelism: each rank's heads give a partial sum
        return backend.all_reduce(backend.linear(o.reshape(o.shape[0], self.hq * self.d),
                                                 self.o_proj.weight))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_attn = Attention(cfg)
        sparse = cfg.moe is not None and cfg.moe.sparse(index)
        self.mlp = SparseMoe(cfg, index) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, kv: PagedKV, meta, backend: Backend,
                last: LastTokens | None = None, capture: RoutingCapture | None = None) -> torch.Tensor:
        """With `last`, only its rows come out, followed by meta.scored's; each part
        through its own products, so the last rows' bits do not depend on the others.
        `capture`: where a mixture records its tokens' experts (every row: not with `last`)."""
        h = self.self_attn(self.input_layernorm(x, backend), rope, kv, self.index, meta, backend, last)
        if last is None:
            return self._rest(h, x, backend, capture)
        rows = [last.rows] + ([meta.scored.rows] if meta.scored is not None else [])
        parts = [self._rest(o, x[r], backend) for o, r in zip(h, rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _rest(self, h: torch.Tensor, x: torch.Tensor, backend: Backend,
              capture: RoutingCapture | None = None) -> torch.Tensor:
        norm = self.post_attention_layernorm
        h, x = backend.add_rms_norm(h, x, norm.weight, norm.eps)
        return x + self.mlp(h, backend, capture)


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
        # set by the runner for a forward whose tokens' experts are asked for
        self.capture: RoutingCapture | None = None

    def linears(self) -> list[nn.Parameter]:
        """The weights `linear` multiplies by: every projection and the head."""
        out = [self.lm_head.weight]
        for layer in self.model.layers:
            out += [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight]
            mlp = layer.mlp if isinstance(layer.mlp, MLP) else layer.mlp.shared_experts
            if mlp is not None:
                out += [mlp.gate_up_proj.weight, mlp.down_proj.weight]
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
        self.rotary = RotaryEmbedding(c.rotary, c.max_position, c.rope_theta, c.rope_scaling,
                                      dtype, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKV,
                meta: PrefillMeta | DecodeMeta, backend: Backend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (before the last
        norm), or of a prefill's meta.last tokens only, [B, hidden], followed by its
        meta.scored rows', [R, hidden], where it has them. With `self.capture` set, the
        mixtures record every token's experts (a prefill's last layer then runs on all
        its rows, whose experts are asked for too, and picks those rows after)."""
        rope = self.rotary.tables(positions)
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        *layers, final = self.model.layers
        capture = self.capture
        for layer in layers:
            x = layer(x, rope, kv, meta, backend, capture=capture)
        last = meta.last if isinstance(meta, PrefillMeta) else None
        if capture is None or last is None:      # (a decode step records its last layer too)
            return final(x, rope, kv, meta, backend, last, capture=capture)
        x = final(x, rope, kv, meta, backend, capture=capture)
        rows = [last.rows] + ([meta.scored.rows] if meta.scored is not None else [])
        return x[torch.cat(rows)]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, backend: Backend) -> torch.Tensor:
        return backend.linear(self.model.norm(hidden.contiguous(), backend), self.lm_head.weight)
