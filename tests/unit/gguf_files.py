"""GGUF files written for tests with the `gguf` package's own writer: the tiny model
(any seed) under llama.cpp's tensor names and q/k row order, quantized on request, with
a byte-level vocabulary equal to the tiny model's tokenizer; mixtures of experts with
their experts stacked and the metadata llama.cpp's convert_hf_to_gguf.py writes."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import torch

from engines.formats.gguf_file import BLOCK_NAMES, GLOBAL_NAMES, permute
from engines.models.tiny import BOS_ID, EOS_ID, TINY_CONFIG, tiny_state_dict, tiny_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def gguf_meta(path: Path) -> dict:
    """A file's metadata as the engine reads it (GGUFFile.meta), without its model checks."""
    from engines.formats.gguf_header import read_header
    return read_header(Path(path)).meta


def gguf_name(hf: str) -> str:
    """Hugging Face name -> llama.cpp's (the inverse of engines.formats.gguf_file.hf_name)."""
    if hf.startswith("blk."):
        return hf                       # named by _moe_tensors already
    for ours, theirs in GLOBAL_NAMES.items():
        if hf == f"{theirs}.weight":
            return f"{ours}.weight"
    _, _, layer, rest = hf.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    ours = next(k for k, v in BLOCK_NAMES.items() if v == stem)
    return f"blk.{layer}.{ours}.{kind}"


def write_tiny_gguf(path: Path, seed: int = 0, qtype: str = "F32", arch: str = "llama",
                    vocab: bool = True, extra: dict | None = None) -> Path:
    """tiny:`seed` as a GGUF file (see `write_gguf`)."""
    return write_gguf(path, TINY_CONFIG, tiny_state_dict(seed), qtype, arch, vocab, extra)


def write_gguf(path: Path, c: dict, state: dict[str, torch.Tensor], qtype: str = "F32",
               arch: str = "llama", vocab: bool = False, extra: dict | None = None,
               meta: dict[str, int] | None = None) -> Path:
    """A checkpoint (Hugging Face config dict and state dict) as a GGUF file, as llama.cpp's
    converter writes one: 2-D weights stored as `qtype` (norms and biases stay F32), q/k
    rows permuted for the llama architecture, no output.weight when embeddings are tied.
    `vocab`: the tiny model's byte-level tokenizer and a chatml template.
    `extra`: name -> (numpy array, GGML type name) added as is, in place of the
    checkpoint's tensor of that name. `meta`: uint32 metadata written over the rest."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    heads = c["num_attention_heads"]
    tensors = _moe_tensors(w, c, state, arch) if _experts(c) else state
    w.add_block_count(c["num_hidden_layers"] + (arch == "glm4moe"))  # GLM: + its MTP block
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c.get("head_dim") or c["hidden_size"] // heads)
    w.add_rope_freq_base(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    if vocab:
        _add_vocab(w)
    kind = gguf.GGMLQuantizationType[qtype]
    rows = {"q_proj": heads, "k_proj": c["num_key_value_heads"]}
    for name, t in tensors.items():
        if name == "lm_head.weight" and c.get("tie_word_embeddings") or \
                gguf_name(name) in (extra or {}):
            continue
        proj = name.split(".")[-2]
        if proj in rows and arch == "llama":
            t = permute(t, rows[proj])
        arr = t.to(torch.float32).numpy()
        if arr.ndim >= 2 and kind != gguf.GGMLQuantizationType.F32 and "ffn_gate_inp" not in name:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name(name), arr)
    for key, value in (meta or {}).items():
        w.kv_data[0][key] = gguf.GGUFValue(value, gguf.GGUFValueType.UINT32)
    for name, (arr, raw) in (extra or {}).items():
        w.add_tensor(name, arr, raw_dtype=gguf.GGMLQuantizationType[raw])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _experts(c: dict) -> int:
    return c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0


def _moe_tensors(w, c: dict, state: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """A mixture's metadata written to `w`, its state with each layer's experts stacked
    into blk.N.ffn_{gate,up,down}_exps [E, rows, cols] as llama.cpp's converter does
    (Mixtral's w1/w3/w2 are gate/up/down), GLM's bias as exp_probs_b and a
    multi-token-prediction block past the last layer (the converter writes one)."""
    import gguf

    experts = _experts(c)
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    if arch != "llama":
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if arch == "glm4moe":
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        w.add_expert_weights_norm(c["norm_topk_prob"])
        w.add_rope_dimension_count(int(c["head_dim"] * c["rope_parameters"]["partial_rotary_factor"]))
        w.add_nextn_predict_layers(1)
    parts = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
             "down_proj": "down", "w2": "down"}
    expert = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
    out, stacks = {}, {}
    for name, t in state.items():
        m = expert.fullmatch(name)
        if m:
            stacks.setdefault(f"blk.{m.group(1)}.ffn_{parts[m.group(3)]}_exps.weight", {})[int(m.group(2))] = t
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            out[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for name, per in stacks.items():
        out[name] = torch.stack([per[e] for e in range(experts)])
    if arch == "glm4moe":           # past the model's layers: the loader must skip it
        last, hidden = c["num_hidden_layers"], c["hidden_size"]
        out[f"blk.{last}.nextn.eh_proj.weight"] = torch.ones(hidden, 2 * hidden)
        out[f"blk.{last}.attn_norm.weight"] = torch.ones(hidden)
    return out


def _add_vocab(w) -> None:
    inner = tiny_tokenizer().inner
    tokens = [inner.id_to_token(i) for i in range(inner.get_vocab_size())]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in (BOS_ID, EOS_ID) else 1 for i in range(len(tokens))])
    w.add_token_merges([])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def quantized_close(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    """Within `tol` of the tensor's largest magnitude: quantization's error, not a
    misplaced row (which would be off by the weights' own size)."""
    return float(np.abs(a - b).max()) <= tol * float(np.abs(b).max())


# --- hand-made headers, for files the gguf writer refuses to write ---------------------


def gguf_string(text: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string; `length` overrides the declared byte count."""
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def gguf_kv(key: str, kind: int, payload: bytes) -> bytes:
    """One metadata entry: key, value type (GGUFValueType), the value's bytes."""
    return gguf_string(key) + struct.pack("<I", kind) + payload


def gguf_array(kind: int, count: int, items: bytes = b"") -> bytes:
    """An array value (type 9): element type, declared count, the elements' bytes."""
    return struct.pack("<IQ", kind, count) + items


def gguf_tensor(name: str, dims: list[int], kind: int = 0, offset: int = 0) -> bytes:
    """One tensor's info: name, dims (ggml order), GGML type, offset in the data."""
    return gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)


def raw_gguf(path: Path, kvs: list[bytes] = (), tensors: list[bytes] = (), n_kv: int | None = None,
             n_tensors: int | None = None, tail: bytes = b"") -> Path:
    """A GGUF v3 file from raw parts; the counts default to the parts given."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    path.write_bytes(head + b"".join(kvs) + b"".join(tensors) + tail)
    return path
