"""GGUF files of the Llama family and its mixtures of experts: config, weights and
metadata for the loader.

A GGUF file (llama.cpp's format) carries the config as `{arch}.*` metadata, the
tokenizer and chat template as `tokenizer.*` metadata, and the weights under
llama.cpp's names, often quantized. We read it with the `gguf` package (memory-mapped),
turn the metadata into a Hugging Face-style config, and hand the weights out one
tensor at a time, dequantized only when the loader copies them in, so a file is never
held in memory twice.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from engines.config import ModelConfig, ModelError
from engines.formats.gguf_header import BadHeader, read_header
from engines.formats.gguf_moe import (MOE_BLOCK_NAMES, MOE_FULL_NAMES, STACKED, STACKED_NAME,
                                      moe_architecture, moe_fields, unexpected)

if TYPE_CHECKING:
    import torch

# GGUF architecture -> (Hugging Face architecture, q/k rows permuted by llama.cpp)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    # mixtures of experts (engines/formats/gguf_moe.py); "llama" with experts is Mixtral
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
    "glm4moe": ("Glm4MoeForCausalLM", False),      # llama.cpp runs GLM in NeoX order: no permutation
}

# llama.cpp tensor name (per block) -> Hugging Face name
BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
} | MOE_BLOCK_NAMES
GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER = re.compile(r"blk\.(\d+)\.")

# Types read without the gguf package's dequantizer (it leaves F64 out).
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64}

# one tensor of a checkpoint: (name, shape, read it as a float32 CPU tensor)
# (torch is imported only where a tensor is read: the HTTP front takes the config,
# tokenizer and chat template from the header without it)
LazyTensor = tuple[str, tuple[int, ...], Callable[[], "torch.Tensor"]]


def is_gguf(spec: str) -> bool:
    return spec.endswith(".gguf")


class GGUFFile:
    """One opened GGUF file. Every problem with it is a ModelError naming the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"{path}: no such GGUF file")
        try:
            header = read_header(self.path)   # every count bounded (engines/formats/gguf_header.py)
        except BadHeader as e:
            raise ModelError(f"{path}: not a readable GGUF file: {e}") from None
        except OSError as e:
            raise ModelError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from None
        self.meta: dict[str, Any] = header.meta
        self.infos = header.tensors
        self.arch = str(self.meta.get("general.architecture", "?"))
        if self.arch not in ARCHITECTURES:
            raise ModelError(f"{path}: unsupported GGUF architecture {self.arch!r}; "
                             f"supported: {', '.join(ARCHITECTURES)}")
        self._check_tensor_types()

    def _check_tensor_types(self) -> None:
        from gguf import quants

        for t in self.infos:
            kind = t.tensor_type
            # the package's own table of types it can dequantize (I8..I64, Q8_K... are not)
            if kind.name not in _PLAIN and kind not in quants._type_traits:
                raise ModelError(f"{self.path}: tensor {t.name!r} has type {kind.name}, "
                                 "which cannot be dequantized")
            if t.name.endswith("rope_freqs.weight"):
                raise ModelError(f"{self.path}: per-frequency rope factors (rope_freqs, "
                                 "Llama 3.1-style scaling) are not supported")

    def key(self, name: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{name}", default)

    def config(self) -> ModelConfig:
        """The model's config, spelled as a Hugging Face config.json would be."""
        hf_arch, _ = ARCHITECTURES[self.arch]
        moe_arch = moe_architecture(self.arch, self.key)
        names = {t.name for t in self.infos}
        embd = next((t for t in self.infos if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ModelError(f"{self.path}: no token_embd.weight tensor")
        raw = {
            "architectures": [moe_arch or hf_arch],
            "vocab_size": self.key("vocab_size", int(embd.shape[1])),
            "hidden_size": self.key("embedding_length"),
            "intermediate_size": self.key("feed_forward_length"),
            "num_hidden_layers": self.layers(),
            "num_attention_heads": self.key("attention.head_count"),
            "num_key_value_heads": self.key("attention.head_count_kv"),
            "head_dim": self.key("attention.key_length"),
            "max_position_embeddings": self.key("context_length", 2048),
            "rms_norm_eps": decimal(self.key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": decimal(self.key("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._stop_ids(),
        }
        missing = [k for k, v in raw.items() if v is None and k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")]
        if missing:
            raise ModelError(f"{self.path}: metadata lacks {self.arch}.* keys for {missing}")
        if isinstance(raw["intermediate_size"], list):   # per-layer sizes: not this family
            raise ModelError(f"{self.path}: per-layer feed_forward_length is not supported")
        if moe_arch is not None:
            head_dim = raw["head_dim"] or raw["hidden_size"] // raw["num_attention_heads"]
            raw |= moe_fields(str(self.path), moe_arch, self.key, names,
                              raw["num_hidden_layers"], head_dim)
            if moe_arch == "Glm4MoeForCausalLM":
                raw["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
        try:
            return ModelConfig.from_dict(raw)
        except ModelError as e:
            raise ModelError(f"{self.path}: {e}") from None

    def layers(self) -> int | None:
        """The model's layers: GLM's multi-token-prediction blocks follow them."""
        blocks = self.key("block_count")
        return None if blocks is None else blocks - int(self.key("nextn_predict_layers", 0) or 0)

    def _rope_scaling(self) -> dict | None:
        kind = self.key("rope.scaling.type")
        if kind in (None, "none"):
            return None
        factor = self.key("rope.scaling.factor")
        if kind != "linear" or factor is None:
            raise ModelError(f"{self.path}: unsupported rope scaling {kind!r} in GGUF metadata")
        return {"rope_type": "linear", "factor": decimal(factor)}

    def _stop_ids(self) -> list[int]:
        # The end-of-turn token ends a chat answer even where EOS is another token
        # (Llama 3: <|eot_id|> vs <|end_of_text|>).
        ids = [self.meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return sorted({int(i) for i in ids if i is not None})

    def tensors(self) -> Iterator[LazyTensor]:
        """Every weight under its Hugging Face name, with the shape the model expects;
        read it only by calling the third item. A stack of experts is one tensor per
        expert, each read from its own bytes (engines/formats/gguf_moe.py)."""
        cfg = self.config()
        permuted = ARCHITECTURES[self.arch][1]
        heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
        for t in self.infos:
            layer = _LAYER.match(t.name)
            if layer and int(layer.group(1)) >= cfg.num_layers and self.key("nextn_predict_layers"):
                continue        # GLM's multi-token-prediction block: no speculative decoding here
            shape = tuple(reversed(t.shape))       # ggml lists dims inner first
            stacked = STACKED_NAME.fullmatch(t.name)
            if stacked:
                yield from _experts(self.path, t, shape, int(stacked.group(1)),
                                    STACKED[stacked.group(2)])
                continue
            name = hf_name(t.name)
            if name is None:
                raise unexpected(str(self.path), t.name)
            rows = next((h for k, h in heads.items() if permuted and f".{k}." in name), 0)
            yield name, shape, _reader(t.data, t.tensor_type, shape, rows)


def _experts(path: Path, t, shape: tuple[int, ...], layer: int, proj: str) -> Iterator[LazyTensor]:
    """Stacked experts [E, rows, cols] as E checkpoint tensors, expert e's from its
    bytes of the stack (whole quantization blocks: a block never spans rows)."""
    if len(shape) != 3:
        raise ModelError(f"{path}: tensor {t.name!r} has shape {list(shape)}; stacked experts are "
                         "[experts, rows, cols]")
    each = len(t.data) // shape[0]
    for e in range(shape[0]):
        yield (f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight", shape[1:],
               _reader(t.data[e * each:(e + 1) * each], t.tensor_type, shape[1:], 0))


def decimal(value: float) -> float:
    """A float32 from the file as the decimal it was written from (1e-05, not
    9.999999747378752e-06), so the config equals the checkpoint's config.json."""
    return float(str(np.float32(value)))


def hf_name(gguf_name: str) -> str | None:
    m = _BLOCK.fullmatch(gguf_name)
    if m:
        whole = MOE_FULL_NAMES.get(f"{m.group(2)}.{m.group(3)}")    # GLM's exp_probs_b.bias
        if whole is not None:
            return f"model.layers.{m.group(1)}.{whole}"
        ours = BLOCK_NAMES.get(m.group(2))
        return None if ours is None else f"model.layers.{m.group(1)}.{ours}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    ours = GLOBAL_NAMES.get(stem)
    return None if ours is None or kind != "weight" else f"{ours}.weight"


def _reader(data: np.ndarray, qtype, shape: tuple[int, ...],
            heads: int) -> Callable[[], torch.Tensor]:
    """Bytes `data` of GGML type `qtype` as a float32 tensor of `shape`; q/k rows of
    `heads` heads un-permuted where `heads`."""
    def read() -> torch.Tensor:
        import torch
        from gguf import quants

        kind = qtype.name
        if kind in _PLAIN:
            arr = np.asarray(data).view(_PLAIN[kind]).astype(np.float32)
        else:
            arr = quants.dequantize(data, qtype)
        w = torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))
        return unpermute(w, heads) if heads else w
    return read


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: it stores each head's rotary halves interleaved
    (pairs), Hugging Face's rotate_half wants them as two contiguous halves."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])    # [H, D/2, 2, ...]
            .transpose(1, 2).reshape(w.shape))                        # [H, 2, D/2, ...]


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order from Hugging Face's (the inverse of `unpermute`)."""
    rows = w.shape[0]
    return (w.reshape(heads, 2, rows // heads // 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))
